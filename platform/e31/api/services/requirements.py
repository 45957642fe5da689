"""The job's requirements file, read from its code bundle at submit and checked line by line
(`e31.core.requirements`): a line that is an option, a path or a URL refuses the job with 422 naming
`python.requirements`, the line's number and why, before anything is stored.

The file is read from the tenant's stored bundle (`e31.edge.bundlefiles`), at most
`REQUIREMENTS_MAX_BYTES`, outside any write transaction; the worker checks the same again
before it builds (`e31_worker.attempt.environment`).
"""

from __future__ import annotations

from e31.core.errors import SpecError
from e31.core.requirements import REQUIREMENTS_MAX_BYTES, requirements_refusals
from e31.core.spec import JobSpec
from e31.edge.bundlefiles import read_member
from e31.edge.bundlestore import BundleStore

FIELD = "python.requirements"
REFUSALS_SHOWN = 20      # refused lines named in one answer

Memo = dict[tuple[str, str, str], list[dict[str, str]]]   # (tenant, code, file) -> errors


class RequirementsCheck:
    """The requirements files of the specs a tenant submits, read from its bundles."""

    def __init__(self, *, store: BundleStore) -> None:
        self._store = store

    def check(self, tenant_id: str, spec: JobSpec, *, memo: Memo | None = None) -> None:
        """`SpecError` naming `python.requirements` when the spec's requirements file is not
        a file of its code or holds a line that is no plain requirement. Nothing to check
        without a file, or while the bundle is not uploaded (the bundle check says so).
        `memo`: what one request already learnt of a bundle's file (an array's items)."""
        python = spec.python
        if python is None or python.requirements is None or spec.code is None:
            return
        key = (tenant_id, spec.code, python.requirements)
        if memo is not None and key in memo:
            errors = memo[key]
        else:
            errors = self._errors(tenant_id, spec.code, python.requirements)
            if memo is not None:
                memo[key] = errors
        if errors:
            raise SpecError(errors)

    def _errors(self, tenant_id: str, code: str, name: str) -> list[dict[str, str]]:
        try:
            with self._store.open(tenant_id, code) as bundle:
                data = read_member(bundle, name, max_bytes=REQUIREMENTS_MAX_BYTES)
        except FileNotFoundError:
            if not self._store.exists(tenant_id, code):
                return []           # not uploaded yet: the bundle check answers for it
            return [_error(f"{name} is not a file of the job's code ({code})")]
        except ValueError as exc:
            return [_error(f"{name}: {exc}")]
        try:
            text = data.decode()
        except UnicodeDecodeError:
            return [_error(f"{name} is not UTF-8 text")]
        refused = requirements_refusals(text)
        errors = [_error(f"{name}, {r}") for r in refused[:REFUSALS_SHOWN]]
        if len(refused) > REFUSALS_SHOWN:
            errors.append(_error(f"{name}: {len(refused)} lines refused; the first "
                                 f"{REFUSALS_SHOWN} are named"))
        return errors


def _error(reason: str) -> dict[str, str]:
    return {"field": FIELD, "reason": reason}
