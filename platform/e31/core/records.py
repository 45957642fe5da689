"""Plain records the repository returns: data, no behaviour, no session attached."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

from e31.core.clock import utcnow
from e31.core.spec import JobSpec
from e31.core.states import FINAL_STATES, AttemptReason, JobState


def iso(ts: datetime | None) -> str | None:
    return ts.isoformat() if ts else None


@dataclass(frozen=True)
class TenantRecord:
    id: str
    name: str
    admin: bool
    weight: float
    quotas: dict[str, int] = field(default_factory=dict)   # size class -> most GPUs at once
    # Tenancy (e31.store.tenants): when an admin disabled it (None: enabled), and its own
    # limits over the pool's defaults (tenants.limits; empty: the defaults).
    disabled_at: datetime | None = None
    limits: dict[str, Any] = field(default_factory=dict)
    # The API key a request was authenticated with (the audit log's actor_key); None when the
    # record was read otherwise. Not part of the tenant's identity.
    key_id: str | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {"tenant": self.name, "admin": self.admin, "weight": self.weight,
                "quotas": dict(sorted(self.quotas.items())),
                "disabled": self.disabled_at is not None, "disabled_at": iso(self.disabled_at),
                "limits": dict(sorted(self.limits.items()))}


@dataclass(frozen=True)
class TokenRecord:
    """One API key as its tenant may see it: never the token, only its name and prefix."""

    id: str
    tenant: str
    name: str
    prefix: str | None
    created_at: datetime
    expires_at: datetime | None
    last_used_at: datetime | None
    revoked_at: datetime | None = None

    def to_dict(self, *, now: datetime) -> dict[str, Any]:
        return {"name": self.name, "tenant": self.tenant, "prefix": self.prefix,
                "created_at": iso(self.created_at), "last_used_at": iso(self.last_used_at),
                "expires_at": iso(self.expires_at),
                "expired": self.expires_at is not None and self.expires_at <= now,
                "revoked_at": iso(self.revoked_at)}


@dataclass(frozen=True)
class Actor:
    """Who asks for a change that the audit log records: a tenant and its key over the API, or
    `local` (the CLI on the store), and the client's address."""

    name: str
    key_id: str | None = None
    source: str | None = None


LOCAL_ACTOR = Actor("local")


@dataclass(frozen=True)
class AuditRecord:
    """One line of the audit log (`e31 audit`, GET /v1/admin/audit)."""

    id: int
    at: datetime
    actor: str
    actor_key: str | None
    action: str
    target: str
    source: str | None
    detail: dict[str, Any] | None

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "at": iso(self.at), "actor": self.actor,
                "actor_key": self.actor_key, "action": self.action, "target": self.target,
                "source": self.source, "detail": self.detail}


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
    # How it ran (`e31.store.attempts`); None where not known.
    isolation: str | None = None
    start: str | None = None
    start_ms: float | None = None
    setup_s: float | None = None
    gpu_mem_peak_gb: float | None = None
    gpu_util_mean: float | None = None
    idle_since: datetime | None = None      # flagged by its watchdog (docs/jobs.md)
    moved_to: str | None = None             # an oom attempt's job went on to this class
    limits: dict[str, Any] | None = None    # what it ran under: pids_max, mem_gb, disk_gb

    def to_dict(self) -> dict[str, Any]:
        return {"n": self.n, "worker": self.worker, "gpus": self.gpus,
                "started_at": iso(self.started_at), "ended_at": iso(self.ended_at),
                "reason": self.reason, "error": self.error, "exit_code": self.exit_code,
                "isolation": self.isolation, "start": self.start, "start_ms": self.start_ms,
                "setup_s": self.setup_s, "gpu_mem_peak_gb": self.gpu_mem_peak_gb,
                "gpu_util_mean": self.gpu_util_mean, "idle_since": iso(self.idle_since),
                "moved_to": self.moved_to, "limits": self.limits}


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
    array_id: str | None = None      # the array this job is an item of, if any
    array_index: int | None = None
    pending: dict[str, Any] | None = None   # a queued job's reason, position, estimated start
    queued_since: datetime | None = None    # a queued job's: when its present wait began
    artifacts_removed_at: datetime | None = None   # when `e31 gc` removed its logs and outputs

    def to_status(self) -> dict[str, Any]:
        """The status dict of the public contract (`job.status()`, `e31 status --json`).
        A queued job's `queued_seconds` counts its present wait up to now: what the claim will
        store, read before it (the store keeps the waits of the attempts before)."""
        queued_s = self.queued_seconds
        if self.queued_since is not None and self.state == JobState.QUEUED.value:
            queued_s += max(0.0, (utcnow() - self.queued_since).total_seconds())
        return {
            "id": self.id, "name": self.name, "tenant": self.tenant, "state": self.state,
            "reason": self.reason, "error": self.error,
            "size_class": self.size_class, "queue": self.queue, "gpus": self.gpus,
            "priority": self.priority,
            "submitted_at": iso(self.submitted_at), "started_at": iso(self.started_at),
            "ended_at": iso(self.ended_at), "not_before": iso(self.not_before),
            "gpu_seconds": round(self.gpu_seconds, 3), "run_seconds": round(self.run_seconds, 3),
            "queued_seconds": round(queued_s, 3),
            "progress": ({"done": self.progress_done, "total": self.progress_total}
                         if self.progress_done is not None else None),
            "result": self.result, "outputs": self.outputs,
            "attempts": [a.to_dict() for a in self.attempts],
            "array_id": self.array_id, "array_index": self.array_index,
            "after": list(self.spec.get("after") or []),
            "pending": self.pending,
            "idle_since": self.idle_since,
            "artifacts_removed_at": iso(self.artifacts_removed_at),
        }

    @property
    def idle_since(self) -> str | None:
        """Since when the running job has not moved (log, progress, GPUs), once its watchdog
        flagged it; None otherwise, and always for a job that is not running."""
        if self.state != JobState.RUNNING.value or not self.attempts:
            return None
        return iso(self.attempts[-1].idle_since)


ARRAY_COUNTS = tuple(s.value for s in JobState)   # an array status has a count per state


def array_state(counts: dict[str, int]) -> str:
    """One word for a whole array: `queued` until an item starts, `running` until every item
    is final, then `succeeded` if all did, else `failed` if any did, else `cancelled`."""
    total = sum(counts.values())
    final = sum(counts.get(s, 0) for s in FINAL_STATES)
    if final < total:
        queued = counts.get(JobState.QUEUED, 0) == total
        return (JobState.QUEUED if queued else JobState.RUNNING).value
    if counts.get(JobState.SUCCEEDED, 0) == total:
        return JobState.SUCCEEDED.value
    return (JobState.FAILED if counts.get(JobState.FAILED, 0) else JobState.CANCELLED).value


@dataclass(frozen=True)
class ArrayItem:
    """One item of an array as its status lists it."""

    index: int
    id: str
    state: str
    reason: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "id": self.id, "state": self.state, "reason": self.reason}


@dataclass(frozen=True)
class ArrayRecord:
    """An array and how far it got: item counts by state, and its items when asked for."""

    id: str
    tenant: str
    name: str
    size: int
    submitted_at: datetime
    counts: dict[str, int]
    items: list[ArrayItem] | None = None

    @property
    def done(self) -> int:
        """Items that ended, whichever way."""
        return sum(self.counts.get(s, 0) for s in FINAL_STATES)

    def to_status(self) -> dict[str, Any]:
        """The array status of the public contract (`array.status()`, `e31 status a-… --json`)."""
        status: dict[str, Any] = {
            "id": self.id, "name": self.name, "tenant": self.tenant,
            "submitted_at": iso(self.submitted_at), "state": array_state(self.counts),
            "total": self.size, "done": self.done,
            **{s: self.counts.get(s, 0) for s in ARRAY_COUNTS},
        }
        if self.items is not None:
            status["items"] = [i.to_dict() for i in self.items]
        return status


@dataclass(frozen=True)
class ManifestItem:
    """One item of an array's manifest: what it was given and what it left."""

    index: int
    id: str
    state: str
    params: dict[str, Any]
    result: Any
    outputs: list[dict[str, Any]]
    reason: str | None
    error: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "id": self.id, "state": self.state, "params": self.params,
                "result": self.result, "outputs": self.outputs, "reason": self.reason,
                "error": self.error}


@dataclass(frozen=True)
class ArrayManifest:
    """Every item's result, outputs and error, in index order."""

    array: ArrayRecord
    items: list[ManifestItem]

    def to_dict(self) -> dict[str, Any]:
        return {**self.array.to_status(), "items": [i.to_dict() for i in self.items]}


@dataclass(frozen=True)
class Claim:
    """What a worker holds after a successful claim: the job's spec, validated, and the
    fencing token its outcome is written with."""

    job_id: str
    tenant_id: str
    token: int
    attempt: int
    spec: JobSpec
    gpus: int
    array_id: str | None = None   # the array it is an item of (a worker may chain its next)


@dataclass(frozen=True)
class Outcome:
    """How an attempt ended, as the worker reports it."""

    reason: AttemptReason
    result: Any = None
    error: str | None = None
    exit_code: int | None = None
    outputs: list[dict[str, Any]] = field(default_factory=list)
    # The job's last progress (done, total) as its child left it: stored with the outcome, so
    # that a job ending between two lease ticks shows it without a renewal of its own.
    progress: tuple[float, float] | None = None


@dataclass(frozen=True)
class Candidate:
    """A runnable queued job the scheduler may publish: what `Repo.heads` reads (each tenant's
    oldest per queue and priority band) and what `e31.scheduling.admission.decide` ranks and
    places. Its times are seconds, so the policy runs the same on a simulated clock."""

    id: str
    tenant_id: str
    queue: str            # e31.<class> or e31.<class>.xN
    size_class: str
    gpus: int             # N of .xN; 1 for a one-GPU job, 0 for cpu
    priority: int         # 0..9, higher first
    submitted_at_s: float
    timeout_s: float      # per attempt: the bound backfill relies on
    name: str = ""        # the job's display name, for the task name Flower shows
    pending_reason: str | None = None   # as the scheduler last stored it, so that it writes
    pending_detail: str | None = None   # only what changed
    queued_since_s: float | None = None   # since its latest queueing: a preemption's grace
    deadline_s: float | None = None       # when it is due (a batch's window), if it is

    @property
    def order(self) -> tuple[float, float, str]:
        """Its place among its tenant's jobs of its band: the earliest deadline first, then
        the jobs without one, oldest first."""
        return (self.deadline_s if self.deadline_s is not None else float("inf"),
                self.submitted_at_s, self.id)


@dataclass(frozen=True)
class RunningJob:
    """A running job: who holds which worker until when (started_at + timeout_s at the latest)."""

    id: str
    tenant_id: str
    node: str | None
    size_class: str
    gpus: int
    started_at: datetime | None     # of the current attempt
    timeout_s: float
    lease_live: bool
    priority: int = 0
    preemptible: bool = False
    preempt_requested: bool = False    # the scheduler asked it to stop; it has not yet
    held_gpus: str = ""                # its attempt's GPU indexes on its host ("0,1")


@dataclass(frozen=True)
class TenantShare:
    """A tenant as fair share sees it: weight, quotas, decayed usage as of `usage_at`."""

    id: str
    name: str
    weight: float
    quotas: dict[str, int]
    usage_gpu_s: float
    usage_at: datetime | None
    disabled: bool = False     # an admin disabled it: its queued jobs do not start


class Published(NamedTuple):
    """A job published and not claimed yet: its message holds a slot of its queue."""

    tenant_id: str
    queue: str
    size_class: str
    gpus: int
    timeout_s: float
    id: str = ""
    priority: int = 0
    queued_since: datetime | None = None   # a preemption's grace runs from here
    dispatch_host: str | None = None       # a gang dispatch: the host and the GPUs it holds
    dispatch_gpus: str | None = None


class Renewal(NamedTuple):
    """What a lease renewal answers: still ours, and whether to stop (cancel, preempt)."""

    ours: bool
    cancel: bool
    preempt: bool


@dataclass(frozen=True)
class SchedulingView:
    """What one tick reads besides the heads: tenants, running jobs, published-unclaimed
    jobs. All bounded by the pool, not the backlog."""

    tenants: list[TenantShare]
    running: list[RunningJob]
    outstanding: list[Published]


@dataclass(frozen=True)
class QueuePosition:
    """What a queued job's explanation needs from the store (read on request only)."""

    tenant_id: str
    older_own: int                        # the tenant's older runnable jobs in the band (capped)
    first_dependency: str | None          # a dependency not succeeded yet
    published: bool                       # published, not claimed yet
    stored_reason: str | None             # as the scheduler last judged it
    stored_detail: str | None


@dataclass(frozen=True)
class QueueLoad:
    """A queue's backlog per (tenant id, band) and its recent starts: shared by every queued
    job's explanation in that queue, so the service may reuse it for a few seconds."""

    backlog: dict[tuple[str, int], int]
    starts_recent: int
    window_s: float


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
                "gpu_seconds": round(self.gpu_seconds, 3),
                "run_seconds": round(self.run_seconds, 3),
                "queued_seconds": round(self.queued_seconds, 3)}


# -- the pool as the store counts it (e31.store.pool; e31.ops.scrape reads it) ----------

JobKey = tuple[str, str, str]       # (state, class, tenant id)


@dataclass(frozen=True)
class Totals:
    """Sums over a set of jobs: jobs and GPU-seconds per (state, class, tenant id), ended
    attempts per (class, reason), failed jobs per (class, reason: their last attempt's). Two
    sets' totals add up (`+`)."""

    jobs: Mapping[JobKey, int] = field(default_factory=dict)
    gpu_seconds: Mapping[JobKey, float] = field(default_factory=dict)
    attempts: Mapping[tuple[str, str], int] = field(default_factory=dict)
    failed: Mapping[tuple[str, str], int] = field(default_factory=dict)

    def __add__(self, other: Totals) -> Totals:
        def add(a: Mapping[Any, Any], b: Mapping[Any, Any]) -> dict[Any, Any]:
            out = dict(a)
            for k, v in b.items():
                out[k] = out.get(k, 0) + v
            return out
        return Totals(add(self.jobs, other.jobs), add(self.gpu_seconds, other.gpu_seconds),
                      add(self.attempts, other.attempts), add(self.failed, other.failed))


@dataclass(frozen=True)
class Spread:
    """One class's histogram: how many values fell at or below each bound (cumulative, in
    the order of `bounds_s`), how many there were in all and their sum."""

    bounds_s: tuple[float, ...]
    at_or_below: tuple[int, ...]
    count: int
    sum_s: float

    @classmethod
    def empty(cls, bounds_s: tuple[float, ...]) -> Spread:
        return cls(bounds_s, tuple(0 for _ in bounds_s), 0, 0.0)


@dataclass(frozen=True)
class LeaseHolder:
    """A running job's lease: the node that holds it, the job's class and GPUs, and whether
    the lease is still live."""

    node: str
    size_class: str
    gpus: int
    live: bool
    held_gpus: str = ""     # its attempt's GPU indexes on the node's host ("0,1")


@dataclass(frozen=True)
class PoolCounts:
    """What the metrics read from the store at each scrape, besides the settled history."""

    current: Totals                                   # live jobs, and those ended since a time
    tenants: Mapping[str, str]                        # tenant id -> name
    oldest_queued_at: Mapping[str, datetime]          # class -> oldest runnable job's wait
    queue_wait: Mapping[str, Spread]                  # class -> jobs started in the window
    run_time: Mapping[str, Spread]                    # class -> jobs ended in the window
    holders: tuple[LeaseHolder, ...]
