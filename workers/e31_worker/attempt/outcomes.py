"""What an attempt's child left, as the `Outcome` its attempt records: the end a directive
forced (cancel, drain, preemption, idle, a lost lease), or how the child exited (its result
files, its exit code or signal, the kernel's OOM killer). The supervisor's own stops, the
timeout and the disk limit, it words itself (e31_worker.attempt.supervisor).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import signal
import subprocess
from pathlib import Path

from e31.core.records import Outcome
from e31.core.states import AttemptReason
from e31_worker.attempt.plan import AttemptPlan, Directive
from e31_worker.attempt.sandbox import read_job_file

# What exec says of a program the job named that is not there or cannot run: the job's own
# error. Any other failure to start its child (a fork that fails, a cgroup file that is gone,
# the sandbox's own program missing, its setup between fork and exec failing) is the worker's.
USERS_START_ERRNOS = frozenset({errno.ENOENT, errno.EACCES, errno.ENOEXEC, errno.ENOTDIR,
                                errno.ENAMETOOLONG, errno.ELOOP})


def start_failed_outcome(exc: Exception, program: str, *, sandboxed: bool) -> Outcome:
    """The outcome of a child that could not be started: the user's `error` when the program
    the job named cannot be run (in a sandbox, bubblewrap reports that as the job's exit
    instead), else the pool's `worker_crashed` (retried on its account, docs/reliability.md)."""
    if isinstance(exc, OSError) and not sandboxed and exc.errno in USERS_START_ERRNOS:
        return Outcome(AttemptReason.ERROR, error=f"cannot start {program}: {exc.strerror}")
    if isinstance(exc, ValueError) and not isinstance(exc, subprocess.SubprocessError):
        return Outcome(AttemptReason.ERROR, error=f"cannot start {program}: {exc}")  # a NUL
    said = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return Outcome(AttemptReason.WORKER_CRASHED,
                   error=f"worker error: the job's process could not be started: "
                         f"{type(exc).__name__}: {said}")


def stopped_outcome(directive: Directive, *, exit_code: int | None = None) -> Outcome:
    """The outcome of an attempt that a tick's `directive` stopped (cancel, drain, a lost
    lease), while its child ran or while it was being set up."""
    if directive is Directive.CANCEL:
        return Outcome(AttemptReason.CANCELLED, exit_code=exit_code, error="cancelled by its owner")
    if directive is Directive.DRAIN:
        return Outcome(AttemptReason.DRAINED, exit_code=exit_code, error="worker shut down")
    if directive is Directive.GPU_FAULT:
        return Outcome(AttemptReason.GPU_FAULT, exit_code=exit_code,
                       error="its GPU reported an error the job's code cannot cause (an XID); "
                             "the node is out of service and the job runs again elsewhere, on "
                             "the pool's account")
    if directive is Directive.PREEMPT:
        return Outcome(AttemptReason.PREEMPTED, exit_code=exit_code,
                       error="preempted for a job of a higher priority band or of a tenant "
                             "below its fair share; it resumes from its last checkpoint")
    if directive is Directive.IDLE:
        return Outcome(AttemptReason.IDLE, exit_code=exit_code,
                       error="stopped as idle: no log output, progress or GPU use for its "
                             "idle_timeout_s (on_idle: kill)")
    return Outcome(AttemptReason.LOST, exit_code=exit_code, error="lease lost")


def exited_outcome(plan: AttemptPlan, code: int, oom_kills: int = 0) -> Outcome:
    """The outcome of an attempt whose child exited with `code` without being stopped; the
    kernel OOM-killed `oom_kills` of its processes meanwhile."""
    if oom_kills and code != 0:  # a helper process OOM-killed under a job that still exited
        # 0 is the job's business, not a failed attempt
        return Outcome(AttemptReason.OOM, exit_code=code,
                       error="killed by the kernel's OOM killer: out of host memory"
                             f"{_memory_limit_text(plan)}")
    if plan.spec.entrypoint:
        return _entrypoint_result(plan.root, code)
    if code == 0:
        return Outcome(AttemptReason.SUCCEEDED, exit_code=0)
    return Outcome(AttemptReason.ERROR, exit_code=code, error=_exit_text(code))


def _entrypoint_result(root: Path, code: int) -> Outcome:
    left = finished_outcome(root)
    if left is not None and (code == 0 or left.reason is not AttemptReason.SUCCEEDED):
        return dataclasses.replace(left, exit_code=code)
    if code == 0:
        return Outcome(AttemptReason.ERROR, exit_code=0,
                       error="the job exited before returning a result")
    return Outcome(AttemptReason.ERROR, exit_code=code, error=_exit_text(code))


def finished_outcome(root: Path) -> Outcome | None:
    """The outcome an entrypoint job wrote into its attempt directory (`root`) as it ended,
    or None if it did not finish. The runner writes it atomically before the child exits,
    so a worker restarted after its predecessor died can still record it."""
    result, error = read_job_file(root / "result.json"), read_job_file(root / "error.json")
    if result is not None:   # a regular file only: a job's link is never followed
        return Outcome(AttemptReason.SUCCEEDED, exit_code=0, result=json.loads(result)["result"])
    if error is not None:
        failure = json.loads(error)
        reason = AttemptReason.OOM if failure.get("reason") == "oom" else AttemptReason.ERROR
        return Outcome(reason, error=failure["error"])
    return None


def _memory_limit_text(plan: AttemptPlan) -> str:
    """Which memory limit an OOM-killed attempt had, for its error."""
    asked = plan.spec.resources.mem_gb
    if asked:
        return f" (its limit: resources.mem_gb={asked:g})"
    if plan.limits.mem_gb:
        return (f" (its limit: the pool's default of {plan.limits.mem_gb:g} GB for a job that "
                "asks no resources.mem_gb)")
    return ""


def _exit_text(code: int) -> str:
    """How a child exited, in words: its exit code, or the signal that killed it."""
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"
