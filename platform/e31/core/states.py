"""Job states and the only table of allowed transitions.

The store changes a job's state only through `e31.store.transitions.move`, which refuses a
step this table does not allow, so the table is the rule, not a description of it.
"""

from __future__ import annotations

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
    """Why an attempt ended."""

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

    @property
    def is_retryable(self) -> bool:
        """Whether the job is queued again after an attempt ended this way (retries left)."""
        return self in {AttemptReason.ERROR, AttemptReason.TIMEOUT, AttemptReason.OOM,
                        AttemptReason.LOST, AttemptReason.DRAINED, AttemptReason.IDLE,
                        AttemptReason.PREEMPTED, AttemptReason.DISK_QUOTA}

    @property
    def counts_against_retries(self) -> bool:
        """Infrastructure failures (a lost worker, a drain) and preemptions are not the user's
        failures.

        Lost attempts have their own cap (`retries.max_lost`), which stops a poison job.
        """
        return self in {AttemptReason.ERROR, AttemptReason.TIMEOUT, AttemptReason.OOM,
                        AttemptReason.IDLE, AttemptReason.DISK_QUOTA}


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
