"""What one request may carry: the caps an installation sets (settings `max_*`,
docs/security.md), per job (`SpecLimits.check`) and for all the jobs of one request together
(`RequestTally`), and how the free-form text of a job is measured against them."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from e31.core.errors import SpecError
from e31.core.spec import JobSpec


def env_bytes(env: Mapping[str, str]) -> int:
    """What `env` takes in a process's environment: `NAME=value` and a NUL for each variable."""
    return sum(len(k) + len(v.encode()) + 2 for k, v in env.items())


def argv_bytes(argv: Sequence[str]) -> int:
    """What `argv` takes on a process's command line: each argument and a NUL."""
    return sum(len(a.encode()) + 1 for a in argv)


def spec_bytes(spec: JobSpec) -> int:
    """The free-form text a job brings to the store: its name, env, argv, pip requirements,
    inputs and params, in bytes (params as their JSON, as `MAX_PARAMS_BYTES` counts them)."""
    total = len(spec.name.encode()) if spec.name else 0
    total += env_bytes(spec.env) + argv_bytes(spec.command or ())
    total += argv_bytes(spec.python.pip) if spec.python else 0
    total += env_bytes(spec.inputs)     # NAME=source each, as env counts its variables
    return total + (len(json.dumps(spec.params)) if spec.params else 0)


@dataclass(frozen=True)
class SpecLimits:
    """What one request may carry, as an installation sets it (settings `max_env_vars`,
    `max_env_bytes`, `max_argv_bytes`, `max_after_per_request`, `max_spec_bytes_per_request`,
    `attempt_disk_max_gb`; docs/security.md). `check` applies the caps on one job; a
    `RequestTally` the caps on all the jobs of one request together, which an array's
    `defaults` would otherwise multiply."""

    env_vars: int
    env_bytes: int
    argv_bytes: int
    after_per_request: int
    spec_bytes_per_request: int
    disk_gb: float | None = None     # the most `resources.disk_gb` may ask; None: the spec's own

    def check(self, spec: JobSpec) -> list[dict[str, str]]:
        """The caps on one job that `spec` passes, each as an error naming its field."""
        errors: list[dict[str, str]] = []
        if len(spec.env) > self.env_vars:
            errors.append({"field": "env", "reason": f"{len(spec.env)} variables; at most "
                                                     f"{self.env_vars} per job (max_env_vars)"})
        elif (size := env_bytes(spec.env)) > self.env_bytes:
            errors.append({"field": "env", "reason": f"{size} bytes (NAME=value and a NUL each); "
                                                     f"at most {self.env_bytes} per job "
                                                     "(max_env_bytes)"})
        if spec.command is not None and (size := argv_bytes(spec.command)) > self.argv_bytes:
            errors.append({"field": "command", "reason": f"{size} bytes (each argument and a "
                                                         f"NUL); at most {self.argv_bytes} per "
                                                         "job (max_argv_bytes)"})
        asked = spec.resources.disk_gb
        if asked is not None and self.disk_gb is not None and asked > self.disk_gb:
            errors.append({"field": "resources.disk_gb", "reason": (
                f"{asked:g} GB; at most {self.disk_gb:g} GB on this pool (attempt_disk_max_gb)")})
        return errors


@dataclass
class RequestTally:
    """Running totals over the jobs of one request. `add` refuses the request as soon as a
    total passes its cap, so a request far over it costs no more than one just over it."""

    limits: SpecLimits
    field: str | None = None    # what a refusal names: an array's `items`; None: one job's field
    jobs: int = 0
    after: int = 0
    spec_bytes: int = 0

    def add(self, spec: JobSpec) -> None:
        """Count `spec` in; `SpecError` naming the cap when a total passes it."""
        self.jobs += 1
        self.after += len(spec.after)
        if self.after > (cap := self.limits.after_per_request):
            raise SpecError.one(self.field or "after", (
                f"after: {self.after} dependencies in the first {self.jobs} jobs of this "
                f"request; at most {cap} per request, all its jobs together "
                "(max_after_per_request): depend on an array id (a-…) instead of its items"))
        self.spec_bytes += spec_bytes(spec)
        if self.spec_bytes > (cap := self.limits.spec_bytes_per_request):
            raise SpecError.one(self.field or "spec", (
                f"names, env, argv and params take {self.spec_bytes} bytes in the first "
                f"{self.jobs} jobs of this request; at most {cap} per request, all its jobs "
                "together (max_spec_bytes_per_request)"))
