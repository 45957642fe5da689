"""The one way the store changes a job's state, checked against `e31.core.states.TRANSITIONS`.

`move(ids, src, dst)` is an `UPDATE jobs SET state = dst WHERE id … AND state = src`, built
only after the table allowed `src -> dst` (`IllegalTransition` otherwise). Every state change
is one (the claim, an attempt's end, a cancel, a failed dependency's dependants), each
adding its own conditions and values, so a row can only take a step the table allows: the
check covers the step asked for, the condition makes it the row's real one. A row that is
no longer in `src` (a race lost to a cancel or another claim) is left alone, and the
caller sees it in the row count. New jobs are inserted `queued` (`rows.queued_job`).
`move_by_key(src, dst)` is the same step for one job whose id and values are bound when it
runs, built once per step (an attempt's end).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BindParameter,
    ColumnElement,
    Connection,
    Select,
    Update,
    bindparam,
    delete,
    update,
)
from sqlalchemy.orm import Session

from e31.core.errors import IllegalTransition
from e31.core.states import JobState, can_transition
from e31.store.db import core_of, unindexed
from e31.store.models import JOBS, Job, JobDep
from e31.store.rows import CHUNK, seconds


def runnable_prefix(queue: str | BindParameter[str]) -> tuple[ColumnElement[bool], ...]:
    """The equality prefix of `ix_jobs_heads`: queued, no dependency left, this queue (what
    the scheduler's heads read, and what a row of array items checks waits before it); the
    queue may be a parameter bound when the statement runs."""
    return (Job.state == JobState.QUEUED.value, Job.deps_pending == 0, Job.queue == queue)


def move(ids: str | BindParameter[str] | Sequence[str] | Select[Any], src: JobState,
         dst: JobState) -> Update:
    """The statement that moves the jobs `ids` still in `src` to `dst`; add conditions with
    `.where`, columns with `.values`. The state is compared unindexed: every move names its
    rows by key (an id, bound now or when it runs, ids, or the select of at most one id,
    compared with `=` so that PostgreSQL runs it once: under `IN` it may run it again for
    each row it looks at, and a `LIMIT 1 ... SKIP LOCKED` select then names a second row), and
    the key is the index to use."""
    if not can_transition(src, dst):
        raise IllegalTransition(f"a job may not go from {src.value} to {dst.value}")
    if isinstance(ids, Select):
        rows = Job.id == ids.scalar_subquery()
    else:
        rows = Job.id == ids if isinstance(ids, str | BindParameter) else Job.id.in_(ids)
    return update(Job).where(rows, unindexed(Job.state) == src.value).values(state=dst.value)


@functools.cache
def move_by_key(src: JobState, dst: JobState) -> Update:
    """`move` of the one job whose id is bound when it runs (`b_id`), as a Core statement of
    the jobs table built once per step: the columns it sets besides the state are those its
    parameters name (Core takes an UPDATE's SET from them), so a caller binds its values
    instead of building `.values` each time, which the ORM coerced column by column (issue
    31). Add conditions with `.where` on `JOBS.c`; a parameter that names no column is not
    set, so callers pass the model's own column names."""
    if not can_transition(src, dst):
        raise IllegalTransition(f"a job may not go from {src.value} to {dst.value}")
    return (update(JOBS).where(JOBS.c.id == bindparam("b_id"),
                               unindexed(JOBS.c.state) == src.value)
            .values(state=dst.value))


def cancel_queued(session: Session | Connection, jobs: Sequence[tuple[str, datetime | None]],
                  *, now: datetime, reason: str, error: str | None = None) -> None:
    """End queued jobs, given as (id, queued_since), as cancelled without running: their wait
    counts as queued time, their pending reason and the dependencies they waited for go.
    `error` replaces the stored error (an earlier attempt's) when given. The caller resolves
    what waited for them (`deps.on_final`)."""
    by_since: dict[datetime | None, list[str]] = defaultdict(list)
    for job_id, since in jobs:
        by_since[since].append(job_id)
    values: dict[str, object] = {
        "reason": reason, "ended_at": now, "queued_since": None, "deps_pending": 0,
        "pending_reason": None, "pending_detail": None}
    if error is not None:
        values["error"] = error
    s = core_of(session)   # Core: the session's models of these rows are not read again
    for since, ids in by_since.items():   # jobs queued together share their `since`
        for start in range(0, len(ids), CHUNK):
            chunk = ids[start:start + CHUNK]
            s.execute(move(chunk, JobState.QUEUED, JobState.CANCELLED).values(
                queued_seconds=Job.queued_seconds + seconds(since, now), **values))
            s.execute(delete(JobDep).where(JobDep.job_id.in_(chunk)))


# A resubmit (`e31 retry A-ID --failed`) is the one way out of a final state, and only for
# an array's failed or cancelled items and the jobs that were cancelled because one of them
# failed: the same job runs again as its next attempt. It is kept apart from
# `e31.core.states.TRANSITIONS`, which says what a job's own life allows (a final state stays
# final there): only `resubmit` takes these steps, each asked for by the job's owner.
RESUBMITS: dict[JobState, JobState] = {JobState.FAILED: JobState.QUEUED,
                                       JobState.CANCELLED: JobState.QUEUED}


def resubmit(s: Session, jobs: Sequence[tuple[str, str]], *, now: datetime) -> list[str]:
    """Queue again ended jobs, given as (id, state), from where each ended: a fresh wait
    (`queued_since = now`), no outcome, no outputs, no dispatch; the attempt counter goes on.
    The caller holds the rows locked and read their states; returns the ids.
    `IllegalTransition` for a state `RESUBMITS` does not name."""
    by_state: dict[str, list[str]] = defaultdict(list)
    for job_id, state in jobs:
        by_state[state].append(job_id)
    moved: list[str] = []
    for state, ids in by_state.items():
        src = JobState(state)
        if src not in RESUBMITS:
            raise IllegalTransition(f"a job may not be resubmitted from {src.value}")
        for start in range(0, len(ids), CHUNK):
            chunk = ids[start:start + CHUNK]
            s.execute(update(Job).where(Job.id.in_(chunk), unindexed(Job.state) == src.value)
                      .values(state=RESUBMITS[src].value, reason=None, error=None, result=None,
                              ended_at=None, queued_since=now, not_before=None,
                              dispatched_at=None, dispatch_token=None, cancel_requested=False,
                              lease_owner=None, lease_expires_at=None, progress_done=None,
                              progress_total=None, pending_reason=None, pending_detail=None,
                              deps_pending=0, outputs=None),
                      execution_options={"synchronize_session": False})
            moved += chunk
    return moved
