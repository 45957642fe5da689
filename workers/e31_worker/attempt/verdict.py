"""What Celery, and so Flower, is told about a delivered `e31.run` message: the job's real
outcome (docs/operations.md, "Flower").

The task body records an attempt's outcome in the store and then returns. Were that the whole
story, every delivered message would show as a task that SUCCEEDED, a job that failed, timed
out or was cancelled included. So after the outcome is recorded, `task_result` returns a
short line for an attempt that left its job succeeded (Flower's "Result" column shows it) and
raises `JobNotSucceeded` for any other: Celery marks that task FAILURE and Flower shows the
job id, the attempt's reason and the job's state as its exception.

Raising changes nothing else: the message is still acknowledged (the app keeps
`task_acks_on_failure_or_timeout` at its default, True, so a task that raises is acked like
one that returns), there is no result backend to write, and the worker's thread goes on to
the next message. The task lists `JobNotSucceeded` in its `throws`, so the worker logs it as
an expected outcome, in one INFO line without a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass

from e31.core.states import AttemptReason, JobState

ERROR_SHOWN_CHARS = 300     # of an attempt's error message, in what Flower shows
NO_ATTEMPT = "no attempt: the message claimed no job (the worker's log says why)"


class JobNotSucceeded(Exception):
    """An attempt ended and left its job not succeeded (failed, cancelled, queued again for a
    retry, or recovered elsewhere). Raised by the task only after the outcome is recorded."""


@dataclass(frozen=True)
class Ended:
    """How one attempt of a delivered job ended, once its outcome was offered to the store."""

    job_id: str
    attempt: int
    reason: AttemptReason
    state: str | None           # the job's state after the write; None when it was refused
    error: str | None = None    # the attempt's error message, if any


def task_result(ended: Ended | None) -> str:
    """The task's result for Flower: a line when the job succeeded (or no attempt ran: a
    duplicate, stale or refused message, which the worker's log explains); raises
    `JobNotSucceeded` with `describe(ended)` otherwise."""
    if ended is None:
        return NO_ATTEMPT
    if ended.state == JobState.SUCCEEDED.value:
        return f"job {ended.job_id} attempt {ended.attempt} succeeded"
    raise JobNotSucceeded(describe(ended))


def describe(ended: Ended) -> str:
    """One line: the job, the attempt's reason, what became of the job, the error."""
    if ended.state is None:
        fate = "its outcome was not recorded (the job was recovered elsewhere)"
    elif ended.state == JobState.QUEUED.value:
        fate = "the job is queued again"
    else:
        fate = f"the job is {ended.state}"
    line = f"job {ended.job_id} attempt {ended.attempt} ended {ended.reason.value}; {fate}"
    if ended.error:
        error = " ".join(ended.error.split())   # one line, whatever the job printed
        if len(error) > ERROR_SHOWN_CHARS:
            error = error[:ERROR_SHOWN_CHARS] + "..."
        line += f": {error}"
    return line
