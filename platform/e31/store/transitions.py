"""The one way the store changes a job's state, checked against `e31.states.TRANSITIONS`.

`move(ids, src, dst)` is an `UPDATE jobs SET state = dst WHERE id … AND state = src`, built
only after the table allowed `src -> dst` (`IllegalTransition` otherwise). Every state change
is one (the claim, an attempt's end, a cancel, a failed dependency's dependants), each
adding its own conditions and values, so a row can only take a step the table allows: the
check covers the step asked for, the condition makes it the row's real one. A row that is
no longer in `src` (a race lost to a cancel or another claim) is left alone, and the
caller sees it in the row count. New jobs are inserted `queued` (`rows.queued_job`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import Update, delete, update
from sqlalchemy.orm import Session

from e31.errors import IllegalTransition
from e31.states import JobState, can_transition
from e31.store.db import unindexed
from e31.store.models import Job, JobDep
from e31.store.rows import CHUNK, seconds


def move(ids: str | Sequence[str], src: JobState, dst: JobState) -> Update:
    """The statement that moves the jobs `ids` still in `src` to `dst`; add conditions with
    `.where`, columns with `.values`. The state is compared unindexed: every move names its
    rows by key, and the key is the index to use."""
    if not can_transition(src, dst):
        raise IllegalTransition(f"a job may not go from {src.value} to {dst.value}")
    rows = Job.id == ids if isinstance(ids, str) else Job.id.in_(ids)
    return update(Job).where(rows, unindexed(Job.state) == src.value).values(state=dst.value)


def cancel_queued(s: Session, jobs: Sequence[tuple[str, datetime | None]], *, now: datetime,
                  reason: str, error: str | None = None) -> None:
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
    sync = {"synchronize_session": False}
    for since, ids in by_since.items():   # jobs queued together share their `since`
        for start in range(0, len(ids), CHUNK):
            chunk = ids[start:start + CHUNK]
            s.execute(move(chunk, JobState.QUEUED, JobState.CANCELLED).values(
                queued_seconds=Job.queued_seconds + seconds(since, now), **values),
                execution_options=sync)
            s.execute(delete(JobDep).where(JobDep.job_id.in_(chunk)), execution_options=sync)
