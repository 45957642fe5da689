"""`PoolStore`: the store's part of the metrics and of `e31 top`, a few grouped reads per
scrape (docs/operations.md, "Monitoring"). Who uses it: the API's `/metrics`
(`e31.ops.scrape.PoolReads`) and `/v1/top` (`e31.api.services.top.TopReads`).

Cost: the live counts, the oldest waits and the lease holders read ranges of the state
indexes (bounded by the backlog and the pool); the histograms read the starts and ends of a
recent window through `ix_attempts_started` and `ix_jobs_ended`; the counters (jobs ended,
jobs failed by their reason, attempts ended, GPU-seconds) read the jobs ended since a recent
watermark through `ix_jobs_ended`, and their attempts by job: the history before it is read
once per process (`e31.ops.scrape.EndedTally`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, and_, case, func, or_, select, union_all
from sqlalchemy.orm import Session

from e31.core.metrics import RUN_BUCKETS_S, WAIT_BUCKETS_S
from e31.core.records import LeaseHolder, PoolCounts, Spread, Totals
from e31.core.states import JobState
from e31.store.base import Store
from e31.store.db import unindexed
from e31.store.models import Attempt, Job, Tenant

QUEUED = JobState.QUEUED.value
RUNNING = JobState.RUNNING.value
FAILED = JobState.FAILED.value
FINAL = [JobState.SUCCEEDED.value, JobState.FAILED.value, JobState.CANCELLED.value]
LIVE = [QUEUED, RUNNING]


@dataclass(frozen=True)
class RunningRow:
    """A running job as `e31 top` shows it (the API hides other tenants' ids and names)."""

    id: str
    name: str
    tenant_id: str
    tenant: str
    size_class: str
    gpus: int
    node: str | None
    attempt: int
    started_at: datetime | None
    progress_done: float | None
    progress_total: float | None
    lease_expires_at: datetime | None
    idle_since: datetime | None = None     # flagged by its watchdog
    held_gpus: str = ""                    # its attempt's GPU indexes on its host ("0,1")


class PoolStore(Store):
    """The metrics' and `e31 top`'s reads."""

    def pool_counts(self, *, now: datetime, window_s: float,
                    ended_since: datetime) -> PoolCounts:
        """The live jobs' totals with those of the jobs ended at or after `ended_since` (one
        statement each, so a job that ends meanwhile is counted once); tenants' names; each
        class's oldest runnable queued job; wait and run-time histograms of the last
        `window_s`; the running jobs' lease holders."""
        since = now - timedelta(seconds=window_s)
        with self._session() as s:
            ended = _ended_between(ended_since, None)
            current = _totals(s, [Job.state.in_(LIVE), ended],
                              [and_(Job.state.in_(LIVE), Job.attempts_used > 0), ended])
            tenants = {str(i): str(n) for i, n in s.execute(select(Tenant.id, Tenant.name))}
            oldest = _oldest_runnable(s, now)
            wait = _spreads(s, Job.queued_seconds, WAIT_BUCKETS_S,
                            select().select_from(Attempt).join(Job, Job.id == Attempt.job_id)
                            .where(Attempt.started_at >= since))
            run = _spreads(s, Job.run_seconds, RUN_BUCKETS_S, select().select_from(Job).where(
                _ended_between(since, None), Job.started_at.is_not(None)))
            holders = tuple(LeaseHolder(str(node), cls, int(gpus), bool(exp and exp > now),
                                        held_gpus=held or "")
                            for node, cls, gpus, exp, held in s.execute(
                select(Job.lease_owner, Job.size_class, Job.gpus, Job.lease_expires_at,
                       Attempt.gpus)
                .outerjoin(Attempt, and_(Attempt.job_id == Job.id,
                                         Attempt.n == Job.attempts_used))
                .where(Job.state == RUNNING, Job.lease_owner.is_not(None))).tuples())
        return PoolCounts(current=current, tenants=tenants, oldest_queued_at=oldest,
                          queue_wait=wait, run_time=run, holders=holders)

    def ended_totals(self, *, since: datetime | None, until: datetime) -> Totals:
        """The totals of the jobs that ended in [`since`, `until`) (from the first end when
        `since` is None): a range of `ix_jobs_ended`, and their attempts by `job_id`."""
        ended = _ended_between(since, until)
        with self._session() as s:
            return _totals(s, [ended], [ended])

    def backlog(self, *, now: datetime) -> dict[str, tuple[int, datetime | None]]:
        """Per class: queued jobs, and when its oldest runnable one (no dependency pending, no
        back-off) started waiting (None: none is runnable)."""
        with self._session() as s:
            queued = {str(cls): int(n) for cls, n in s.execute(
                select(Job.size_class, func.count()).where(Job.state == QUEUED)
                .group_by(Job.size_class)).tuples()}
            oldest = _oldest_runnable(s, now)
        return {cls: (n, oldest.get(cls)) for cls, n in queued.items()}

    def running_jobs(self) -> list[RunningRow]:
        """Every running job with its tenant, node, current attempt's start and progress
        (bounded by the pool's slots)."""
        with self._session() as s:
            rows = s.execute(
                select(Job.id, Job.name, Job.tenant_id, Tenant.name, Job.size_class, Job.gpus,
                       Job.lease_owner, Job.attempts_used, Attempt.started_at,
                       Job.progress_done, Job.progress_total, Job.lease_expires_at,
                       Attempt.idle_since, Attempt.gpus)
                .join(Tenant, Tenant.id == Job.tenant_id)
                .outerjoin(Attempt, and_(Attempt.job_id == Job.id,
                                         Attempt.n == Job.attempts_used))
                .where(Job.state == RUNNING).order_by(Job.size_class, Job.id)).tuples()
            return [RunningRow(id=r[0], name=r[1], tenant_id=r[2], tenant=r[3], size_class=r[4],
                               gpus=r[5], node=r[6], attempt=r[7], started_at=r[8],
                               progress_done=r[9], progress_total=r[10], lease_expires_at=r[11],
                               idle_since=r[12], held_gpus=r[13] or "")
                    for r in rows]

    def idle_jobs(self) -> dict[str, int]:
        """Running jobs flagged idle, per size class (the metric `e31_jobs_idle`)."""
        with self._session() as s:
            rows = s.execute(
                select(Job.size_class, func.count())
                .join(Attempt, (Attempt.job_id == Job.id) & (Attempt.n == Job.attempts_used))
                .where(Job.state == RUNNING, Attempt.idle_since.is_not(None),
                       Attempt.ended_at.is_(None))
                .group_by(Job.size_class))
            return {str(cls): int(n) for cls, n in rows}


def _ended_between(since: datetime | None, until: datetime | None) -> ColumnElement[bool]:
    """Jobs that ended in [`since`, `until`) (either open), read through `ix_jobs_ended` (the
    state is checked on the rows found, not through a state index)."""
    return and_(unindexed(Job.state).in_(FINAL),
                *([Job.ended_at >= since] if since is not None else []),
                *([Job.ended_at < until] if until is not None else
                  [Job.ended_at.is_not(None)]))


def _totals(s: Session, jobs_picks: Sequence[ColumnElement[bool]],
            attempts_picks: Sequence[ColumnElement[bool]]) -> Totals:
    """Jobs and GPU-seconds per (state, class, tenant id) of the jobs each of `jobs_picks`
    selects, the failed ones among them per (class, reason), and the ended attempts per
    (class, reason) of the jobs each of `attempts_picks` selects. The picks are disjoint,
    each an index range, read as one statement (one snapshot) of `UNION ALL`s."""
    def union(picks: Sequence[ColumnElement[bool]], *cols: Any) -> Any:
        return union_all(*(select(*cols).where(p) for p in picks)).subquery()

    j = union(jobs_picks, Job.state, Job.size_class, Job.tenant_id, Job.reason,
              Job.gpu_seconds)
    jobs: Counter[tuple[str, str, str]] = Counter()
    gpu_s: dict[tuple[str, str, str], float] = {}
    failed: Counter[tuple[str, str]] = Counter()
    # By reason too (a bounded set), so that the failed jobs' reasons come in the same read.
    for state, cls, tenant_id, reason, n, billed in s.execute(
            select(j.c.state, j.c.size_class, j.c.tenant_id, j.c.reason, func.count(),
                   func.sum(j.c.gpu_seconds))
            .group_by(j.c.state, j.c.size_class, j.c.tenant_id, j.c.reason)).tuples():
        jobs[(state, cls, tenant_id)] += int(n)
        gpu_s[(state, cls, tenant_id)] = gpu_s.get((state, cls, tenant_id), 0.0) \
            + float(billed or 0.0)
        if state == FAILED:
            failed[(str(cls), str(reason))] += int(n)
    a = union(attempts_picks, Job.id, Job.size_class)
    attempts = {(str(cls), str(reason)): int(n) for cls, reason, n in s.execute(
        select(a.c.size_class, Attempt.reason, func.count())
        .join(Attempt, Attempt.job_id == a.c.id).where(Attempt.reason.is_not(None))
        .group_by(a.c.size_class, Attempt.reason)).tuples()}
    return Totals(dict(jobs), gpu_s, attempts, dict(failed))


def _oldest_runnable(s: Session, now: datetime) -> dict[str, datetime]:
    """Per class, when its oldest runnable queued job started waiting (`ix_jobs_heads`)."""
    return {str(cls): at for cls, at in s.execute(
        select(Job.size_class, func.min(Job.queued_since))
        .where(Job.state == QUEUED, Job.deps_pending == 0,
               or_(Job.not_before.is_(None), Job.not_before <= now))
        .group_by(Job.size_class)).tuples() if at is not None}


def _spreads(s: Session, value: Any, bounds_s: Sequence[float],
             base: Any) -> dict[str, Spread]:
    """Per class: how many of `value` over the rows of `base` fall at or below each bound,
    counted in the database (one row per class comes back)."""
    cols: list[ColumnElement[Any]] = [
        func.sum(case((value <= b, 1), else_=0)) for b in bounds_s]
    query = base.add_columns(Job.size_class, func.count(), func.sum(value), *cols) \
        .group_by(Job.size_class)
    out = {}
    for cls, n, total, *at_or_below in s.execute(query).tuples():
        out[str(cls)] = Spread(tuple(bounds_s), tuple(int(x or 0) for x in at_or_below),
                               int(n), float(total or 0.0))
    return out
