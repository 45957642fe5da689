"""Arrays: N jobs submitted as one, read, cancelled and retried as one; the routes are
`e31.api.routes.arrays`. Every call is scoped by the caller's tenant.

`submit` takes the steps of a submission (`e31.api.services.submission`) for each item in
their order (limits → bundles → secrets → placement), then the caps on the request's jobs
together, then one insert for the whole array.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from e31.api.services.requirements import Memo
from e31.api.services.submission import Submission
from e31.core.clock import utcnow
from e31.core.errors import SpecConflict, SpecError, SpecForbidden
from e31.core.names import NAME_MAX, check_name
from e31.core.records import ArrayManifest, ArrayRecord, TenantRecord
from e31.core.sizeclasses import Route
from e31.core.spec import JobSpec, describe_error
from e31.core.tenantlimits import TenantLimits
from e31.ops.sweep import MAX_ARRAY_ITEMS, merge_item
from e31.scheduling import placement
from e31.store import Repo
from e31.store.arrays import RetryRecord

log = logging.getLogger(__name__)

ITEM_ERRORS_MAX = 20      # bad items named in one answer; a bad default would name them all
DEFAULT_ARRAY_NAME = "array"


class ArrayService:
    """The arrays of each tenant, over one store and the steps of a submission."""

    def __init__(self, *, repo: Repo, steps: Submission) -> None:
        self._repo = repo
        self._steps = steps

    def submit(self, tenant: TenantRecord, items: Sequence[Any], *, name: str | None = None,
               defaults: Mapping[str, Any] | None = None, body_bytes: int = 0,
               deadline_at: datetime | None = None) -> ArrayRecord:
        """Validate and route every item (`defaults` merged under each), then store them all as
        one array in one transaction and wake the scheduler once. One bad item refuses the
        whole array with a `SpecError` naming it (`items[3].resources.gpus`); nothing is stored.

        The items are untrusted mappings: each is validated here, once, by `JobSpec.parse`, and
        checked against the caps on one job; the caps on the request's jobs together refuse
        the whole array as soon as a total passes one. Each field of `defaults` must be valid
        on its own, even where every item sets it over. The answer is the strongest refusal of any
        item: an invalid one (422) before a forbidden input (403) before a missing bundle,
        secret or dependency (409). The tenant's limits apply as in `JobService.submit`; an
        array is one request of its submit rate, and each item one of its queued jobs.
        `deadline_at`: when every item is due (a batch's window), for the scheduler's order."""
        limits = self._steps.tenant_limits(tenant, body_bytes=body_bytes, rate=True)
        called = array_name(name)
        _check_count(tenant, items, limits)
        admitted = self._admit(tenant, items, limits, called=called, named=name is not None,
                               defaults=defaults or {})
        with self._steps.inserting():
            record = self._repo.insert_array(tenant.id, called, admitted, now=utcnow(),
                                             max_queued=limits.max_queued,
                                             deadline_at=deadline_at)
        log.info("array_submitted array=%s tenant=%s size=%d", record.id, tenant.name, record.size)
        self._steps.wake(record.id)
        return record

    def _admit(self, tenant: TenantRecord, items: Sequence[Any], limits: TenantLimits, *,
               called: str, named: bool, defaults: Mapping[str, Any]
               ) -> list[tuple[JobSpec, Route]]:
        """Each item through the steps up to placement, its refusal collected (the first
        ITEM_ERRORS_MAX named); each good one counted in the request's tally. The strongest
        refusal of any item refuses the array."""
        steps = self._steps
        admitted: list[tuple[JobSpec, Route]] = []
        errors: list[dict[str, str]] = []
        kinds: set[type[SpecError]] = set()
        bad, shown = 0, 0
        tally = steps.tally(field="items")
        nodes = steps.nodes()
        memo: Memo = {}
        for i, item in enumerate(items):
            data = merge_item(defaults, _named(item, called, i, given=named))
            try:
                spec = steps.within_limits(JobSpec.parse(data), tenant, limits)
                steps.check_bundles(tenant, spec, memo=memo)
                steps.check_secrets(tenant, spec)
                admitted.append(steps.place(spec, nodes))
            except SpecError as exc:
                bad += 1
                kinds.add(type(exc))
                if shown < ITEM_ERRORS_MAX:
                    shown += 1
                    errors.extend({"field": _item_field(i, e["field"]), "reason": e["reason"]}
                                  for e in exc.errors)
                continue
            tally.add(spec)
        if bad > shown:
            errors.append({"field": "items", "reason": f"{bad} of {len(items)} items are "
                                                       f"invalid; the first {shown} are named"})
        if SpecError in kinds:
            raise SpecError(errors)
        _check_defaults(defaults)     # a bad default that every item set over
        if errors:
            raise (SpecForbidden if SpecForbidden in kinds else SpecConflict)(errors)
        return admitted

    def nodes(self) -> placement.Shapes | None:
        """The GPUs the registered nodes have, per size class and host."""
        return self._steps.nodes()

    def reader_of(self, tenant: TenantRecord, array_id: str) -> str:
        """The tenant id under which `tenant` reads the array: its own; an admin's token reads
        any tenant's (never a write), as `JobService.reader_of` says of jobs."""
        return self._repo.array_tenant_id(array_id) if tenant.admin else tenant.id

    def get(self, tenant: TenantRecord, array_id: str, *, items: bool = True) -> ArrayRecord:
        return self._repo.get_array(self.reader_of(tenant, array_id), array_id, items=items)

    def cancel(self, tenant: TenantRecord, array_id: str) -> ArrayRecord:
        record = self._repo.cancel_array(tenant.id, array_id, now=utcnow())
        log.info("array_cancel_requested array=%s cancelled=%d running=%d", array_id,
                 record.counts.get("cancelled", 0), record.counts.get("running", 0))
        return record

    def retry(self, tenant: TenantRecord, array_id: str) -> RetryRecord:
        """Queue the array's failed and cancelled items again, and what they had stopped."""
        record = self._repo.retry_array(tenant.id, array_id, now=utcnow())
        log.info("array_retried array=%s items=%d rearmed=%d", array_id,
                 len(record.resubmitted), len(record.rearmed))
        if record.resubmitted:
            self._steps.wake(array_id)
        return record

    def manifest(self, tenant: TenantRecord, array_id: str) -> ArrayManifest:
        return self._repo.array_manifest(self.reader_of(tenant, array_id), array_id)


def array_name(name: str | None) -> str:
    """An array's name as given (checked as a job's name is), or `DEFAULT_ARRAY_NAME`."""
    if name is None:
        return DEFAULT_ARRAY_NAME
    if not name or len(name) > NAME_MAX or "\x00" in name:
        raise SpecError.one("name", f"must be text of 1 to {NAME_MAX} characters, without NUL")
    try:
        return check_name(name)
    except ValueError as exc:
        raise SpecError.one("name", str(exc)) from None


def _check_count(tenant: TenantRecord, items: Sequence[Any], limits: TenantLimits) -> None:
    """`SpecError` naming `items` when there are none, or more than an array may hold."""
    if not items:
        raise SpecError.one("items", "must be a non-empty list of job specs")
    if len(items) > MAX_ARRAY_ITEMS:
        raise SpecError.one("items", f"{len(items)} items; at most {MAX_ARRAY_ITEMS} per array "
                                     "(submit several arrays)")
    if len(items) > limits.max_array_items:
        raise SpecError.one("items", f"{len(items)} items; at most {limits.max_array_items} "
                                     f"per array for tenant {tenant.name} "
                                     "(limits.max_array_items): submit several arrays, or "
                                     "ask an admin")


def _check_defaults(defaults: Mapping[str, Any]) -> None:
    """`SpecError` naming each field of an array's `defaults` that is invalid on its own (the
    rules between fields apply to each item with its defaults, in `ArrayService.submit`)."""
    if not isinstance(defaults, Mapping):
        raise SpecError.one("defaults", "must be a mapping of spec fields")
    try:
        JobSpec.model_validate(dict(defaults))
    except ValidationError as exc:
        errors = [describe_error(e) for e in exc.errors() if e.get("loc")]
        if errors:
            raise SpecError([{"field": f"defaults.{e['field']}", "reason": e["reason"]}
                             for e in errors]) from None


def _named(item: Any, called: str, index: int, *, given: bool) -> Any:
    """An item without a name of its own is called `<array name>[<index>]` when the array has
    one."""
    if not given or not isinstance(item, Mapping) or item.get("name") is not None:
        return item
    suffix = f"[{index}]"
    return {**item, "name": called[:NAME_MAX - len(suffix)] + suffix}


def _item_field(index: int, field: str) -> str:
    return f"items[{index}]" if field == "spec" else f"items[{index}].{field}"
