"""Job states and the only table of allowed transitions.

The store changes a job's state only through `e31.store.transitions.move`, which refuses a
step this table does not allow, so the table is the rule, not a description of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class JobState(str, Enum):
    """A job's state as stored and sent: each member equals its wire string."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        """Whether the job has ended: it never changes state again."""
        return self in FINAL_STATES


# The states a job ends in. Members are `str`s, so a status string tests membership too
# (`status["state"] in FINAL_STATES`).
FINAL_STATES: frozenset[JobState] = frozenset(
    {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})

# queued -> running happens only through the atomic claim; running -> queued is a retry, a
# lost lease or a drain; cancel is allowed from both live states (a queued job also when a
# dependency of it fails).
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.CANCELLED}),
    JobState.RUNNING: frozenset(
        {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.QUEUED}
    ),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


def can_transition(src: JobState, dst: JobState) -> bool:
    """Whether a job may move from `src` to `dst`."""
    return dst in TRANSITIONS[src]


class AttemptReason(str, Enum):
    """Why an attempt ended. Whose fault it was, and so how the job goes on, is `REASONS`."""

    SUCCEEDED = "succeeded"
    ERROR = "error"
    TIMEOUT = "timeout"
    OOM = "oom"               # out of memory: a CUDA OOM in the job, or the kernel's OOM kill
    CANCELLED = "cancelled"
    LOST = "lost"
    DRAINED = "drained"
    SETUP = "setup"           # its code, environment or inputs could not be prepared: the
    #                           user's error (a requirement that does not install), final
    IDLE = "idle"             # its watchdog stopped it (`on_idle: kill`): no log output, progress
    #                           or GPU use for its idle_timeout_s; retried like a timeout
    PREEMPTED = "preempted"   # the scheduler took its GPUs back for a job of a higher band or a
    #                           tenant below its share; requeued, resumes from its checkpoint
    DISK_QUOTA = "disk_quota"  # its scratch, outputs and checkpoints passed its disk limit
    #                           (attempt_disk_gb or resources.disk_gb): the user's, like error
    SETUP_TRANSIENT = "setup_transient"  # its setup met a fault of ours that may pass: an
    #                           input server's 5xx or 429, a connection reset, refused or timed
    #                           out; retried on the pool's account (infra_retries)
    UPLOAD_FAILED = "upload_failed"  # it succeeded, but its outputs or checkpoints could not
    #                           be stored (the artifact store full or unreachable); retried on
    #                           the pool's account (infra_retries)
    GPU_FAULT = "gpu_fault"   # its GPU reported an error the job's code cannot cause (an XID
    #                           outside the application's): the node drains, the job runs
    #                           again elsewhere on the pool's account (infra_retries)
    WORKER_CRASHED = "worker_crashed"  # the worker's own code failed around the job ("worker
    #                           error: ..."): a stage, the supervisor; retried on the pool's
    #                           account (infra_retries)

    @property
    def owner(self) -> Owner:
        """Whose fault an attempt that ended this way is (`REASONS`)."""
        return REASONS[self].owner

    @property
    def is_retryable(self) -> bool:
        """Whether the job is queued again after an attempt ended this way (retries left)."""
        return REASONS[self].cap is not Cap.FINAL

    @property
    def counts_against_retries(self) -> bool:
        """Whether an attempt that ended this way spends one of the job's `retries.max`: only
        a retried ending of the user's. The pool's endings have caps of their own
        (`retries.max_lost`, the pool's `infra_retries`) or none (a drain, a preemption)."""
        return self.owner is Owner.USER and self.is_retryable

    @property
    def is_infra_fault(self) -> bool:
        """Whether an attempt that ended this way is one of the pool's own faults that the
        pool's `infra_retries` caps (a job that has had that many fails: the pool failed it)."""
        return REASONS[self].cap is Cap.INFRA_RETRIES


class Owner(str, Enum):
    """Whose fault an attempt's ending is: the user's spend the job's `retries.max`; the
    pool's never do (docs/reliability.md, "Whose failure it is")."""

    USER = "user"
    POOL = "pool"


class Cap(str, Enum):
    """What stops a job from being queued again after an attempt ended one way."""

    FINAL = "final"                 # never queued again for it (a success, a cancel, `setup`)
    RETRIES_MAX = "retries.max"     # the job's own `retries.max`, with its back-off
    MAX_LOST = "retries.max_lost"   # the job's poison cap on attempts lost with their worker
    INFRA_RETRIES = "infra_retries"  # the pool's patience with its own faults, with back-off
    NONE = "none"                   # queued again at once, without a cap (a drain, a preemption)


@dataclass(frozen=True)
class ReasonRule:
    """One row of `REASONS`: whose fault the ending is, and what caps the job's retries."""

    owner: Owner
    cap: Cap


# How many of the pool's own faults (`Cap.INFRA_RETRIES`) a job may have before it fails: the
# default of the pool's `infra_retries` setting.
INFRA_RETRIES_DEFAULT = 5

# The one table of attempt endings: whose each is and how the job goes on after it. Only
# the user's retried endings spend `retries.max`; the table is docs/reliability.md's.
REASONS: dict[AttemptReason, ReasonRule] = {
    AttemptReason.SUCCEEDED: ReasonRule(Owner.USER, Cap.FINAL),
    AttemptReason.CANCELLED: ReasonRule(Owner.USER, Cap.FINAL),
    AttemptReason.SETUP: ReasonRule(Owner.USER, Cap.FINAL),
    AttemptReason.ERROR: ReasonRule(Owner.USER, Cap.RETRIES_MAX),
    AttemptReason.TIMEOUT: ReasonRule(Owner.USER, Cap.RETRIES_MAX),
    AttemptReason.OOM: ReasonRule(Owner.USER, Cap.RETRIES_MAX),
    AttemptReason.IDLE: ReasonRule(Owner.USER, Cap.RETRIES_MAX),
    AttemptReason.DISK_QUOTA: ReasonRule(Owner.USER, Cap.RETRIES_MAX),
    AttemptReason.LOST: ReasonRule(Owner.POOL, Cap.MAX_LOST),
    AttemptReason.DRAINED: ReasonRule(Owner.POOL, Cap.NONE),
    AttemptReason.PREEMPTED: ReasonRule(Owner.POOL, Cap.NONE),
    AttemptReason.SETUP_TRANSIENT: ReasonRule(Owner.POOL, Cap.INFRA_RETRIES),
    AttemptReason.UPLOAD_FAILED: ReasonRule(Owner.POOL, Cap.INFRA_RETRIES),
    AttemptReason.WORKER_CRASHED: ReasonRule(Owner.POOL, Cap.INFRA_RETRIES),
    AttemptReason.GPU_FAULT: ReasonRule(Owner.POOL, Cap.INFRA_RETRIES),
}


class Isolation(str, Enum):
    """How an attempt's child was kept apart from its worker and from other jobs
    (docs/security.md): recorded on each attempt and in each worker's heartbeat."""

    SANDBOX = "sandbox"       # own uid, mount, PID and IPC namespaces, only its own files
    PROCESS = "process"       # a process group as the worker's user (a single-user machine)


class Start(str, Enum):
    """How an attempt's child was started. `cold`: a new process, today's only way; `warm`
    (forked from a process that imported torch already) joins it with the warm start."""

    COLD = "cold"
    WARM = "warm"
