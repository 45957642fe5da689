"""Plain records the repository returns: data, no behaviour, no session attached."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from e31.states import AttemptReason


def iso(ts: datetime | None) -> str | None:
    return ts.isoformat() if ts else None


@dataclass(frozen=True)
class TenantRecord:
    id: str
    name: str
    admin: bool
    weight: float


@dataclass(frozen=True)
class AttemptRecord:
    n: int
    worker: str
    gpus: str
    gpu_count: int
    started_at: datetime
    ended_at: datetime | None
    reason: str | None
    error: str | None
    exit_code: int | None

    def to_dict(self) -> dict[str, Any]:
        return {"n": self.n, "worker": self.worker, "gpus": self.gpus,
                "started_at": iso(self.started_at), "ended_at": iso(self.ended_at),
                "reason": self.reason, "error": self.error, "exit_code": self.exit_code}


@dataclass(frozen=True)
class JobRecord:
    id: str
    tenant: str
    name: str
    spec: dict[str, Any]
    state: str
    size_class: str
    queue: str
    gpus: int
    priority: int
    reason: str | None
    error: str | None
    result: Any
    submitted_at: datetime
    started_at: datetime | None
    ended_at: datetime | None
    not_before: datetime | None
    gpu_seconds: float
    run_seconds: float
    queued_seconds: float
    progress_done: float | None
    progress_total: float | None
    outputs: list[dict[str, Any]]
    attempts: list[AttemptRecord] = field(default_factory=list)

    def to_status(self) -> dict[str, Any]:
        """The status dict of the public contract (`job.status()`, `e31 status --json`)."""
        return {
            "id": self.id, "name": self.name, "tenant": self.tenant, "state": self.state,
            "reason": self.reason, "error": self.error,
            "size_class": self.size_class, "queue": self.queue, "gpus": self.gpus,
            "priority": self.priority,
            "submitted_at": iso(self.submitted_at), "started_at": iso(self.started_at),
            "ended_at": iso(self.ended_at), "not_before": iso(self.not_before),
            "gpu_seconds": round(self.gpu_seconds, 3), "run_seconds": round(self.run_seconds, 3),
            "queued_seconds": round(self.queued_seconds, 3),
            "progress": ({"done": self.progress_done, "total": self.progress_total}
                         if self.progress_done is not None else None),
            "result": self.result, "outputs": self.outputs,
            "attempts": [a.to_dict() for a in self.attempts],
        }


@dataclass(frozen=True)
class Claim:
    """What a worker holds after a successful claim."""

    job_id: str
    tenant_id: str
    token: int
    attempt: int
    spec: dict[str, Any]
    gpus: int


@dataclass(frozen=True)
class Outcome:
    """How an attempt ended, as the worker reports it."""

    reason: AttemptReason
    result: Any = None
    error: str | None = None
    exit_code: int | None = None
    outputs: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Candidate:
    """A queued job the scheduler may publish."""

    id: str
    tenant: str
    name: str
    queue: str
    size_class: str
    priority: int
    submitted_at: datetime


@dataclass(frozen=True)
class UsageRow:
    tenant: str
    size_class: str
    jobs: dict[str, int]
    gpu_seconds: float
    run_seconds: float
    queued_seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "size_class": self.size_class, "jobs": self.jobs,
                "gpu_seconds": round(self.gpu_seconds, 3), "run_seconds": round(self.run_seconds, 3),
                "queued_seconds": round(self.queued_seconds, 3)}
