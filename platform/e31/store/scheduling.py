"""`SchedulingStore`: what the scheduler's leader reads and writes, and what explains a queued
job. Who uses it: the scheduler (`e31.scheduling.leader`: the admission inputs, the marks of
what it published, the expiry of lost publications and of leases, the preemption requests)
and the API (a queued job's position, its queue's load, `e31 queue`'s counts).

The leader's reads are bounded by the pool and the number of tenants, never by the backlog
(docs/scheduling.md, "Cost"):

- `heads`: per queue, each tenant's first K runnable jobs per priority band (earliest
  deadline, then oldest). Which
  (queue, tenant, band) have work is found by a skip-scan of `ix_jobs_heads` (one index
  seek per step), and each head is one index range read with LIMIT K.
- `view`: tenants, running jobs (bounded by the workers) and published-unclaimed jobs
  (bounded by the free slots plus headroom, through `ix_jobs_dispatched_at`).
"""

from __future__ import annotations

import secrets
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Integer,
    String,
    Update,
    and_,
    bindparam,
    case,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.orm import Session

from e31.core.records import (
    Candidate,
    Outcome,
    Published,
    QueueLoad,
    QueuePosition,
    RunningJob,
    SchedulingView,
    TenantShare,
)
from e31.core.states import AttemptReason, JobState
from e31.store import deps
from e31.store.attempts import end_attempt
from e31.store.base import BillingStore
from e31.store.db import unindexed
from e31.store.jobs import find_job
from e31.store.models import Attempt, Job, Tenant, UTCDateTime
from e31.store.rows import CHUNK
from e31.store.transitions import runnable_prefix

QUEUED = JobState.QUEUED.value
RECENT_STARTS_S = 600.0     # the window of starts behind a queued job's estimated start
POSITION_CAP = 10_000       # own older jobs counted for a position: deeper, the figure is a floor
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)   # `dispatched_at >= EPOCH`: IS NOT NULL as an index range
DISPATCH_TOKEN_BYTES = 24   # 192 random bits: no one guesses a publication's token
EXPIRE_BATCH = 100          # most expired leases recovered per call (the next tick does the rest)


def new_dispatch_token() -> str:
    """A publication's token: random, URL-safe, 32 characters."""
    return secrets.token_urlsafe(DISPATCH_TOKEN_BYTES)


# The heads' reads, built once with their values bound at each execution: built anew for each
# seek of each tick, their construction and cache keys were a fifth of the scheduler's CPU
# (issue 31). The SQL is the same.
_RUNNABLE = runnable_prefix(bindparam("queue"))
_NEXT_TENANT = (select(Job.tenant_id).where(*_RUNNABLE, Job.tenant_id > bindparam("after"))
                .order_by(Job.tenant_id).limit(1))
_TOP_BAND = (select(Job.priority)   # ORDER BY … LIMIT 1: one index seek
             .where(*_RUNNABLE, Job.tenant_id == bindparam("tenant"),
                    Job.priority < bindparam("below"))
             .order_by(Job.priority.desc()).limit(1))
_HEAD_ROWS = (select(Job.id, Job.name, Job.size_class, Job.gpus, Job.submitted_at, Job.timeout_s,
                     Job.pending_reason, Job.pending_detail, Job.queued_since, Job.deadline_at)
              .where(*_RUNNABLE, Job.tenant_id == bindparam("tenant"),
                     Job.priority == bindparam("band"), Job.dispatched_at.is_(None),
                     or_(Job.not_before.is_(None), Job.not_before <= bindparam("now")))
              # the earliest deadline first, then those without one, oldest first
              .order_by(Job.deadline_at.is_(None), Job.deadline_at, Job.submitted_at)
              .limit(bindparam("k", type_=Integer)))


def tenants_with_work(s: Connection, queue: str) -> list[str]:
    """Tenant ids with queued, dependency-free jobs in `queue`: one index seek per tenant."""
    found: list[str] = []
    after = ""
    while True:
        nxt = s.scalar(_NEXT_TENANT, {"queue": queue, "after": after})
        if nxt is None:
            return found
        found.append(nxt)
        after = nxt


def bands(s: Connection, queue: str, tenant_id: str) -> list[int]:
    """The tenant's priority bands with queued jobs in `queue`, highest first."""
    found: list[int] = []
    below = 10 ** 6
    while True:
        top = s.scalar(_TOP_BAND, {"queue": queue, "tenant": tenant_id, "below": below})
        if top is None:
            return found
        found.append(int(top))
        below = int(top)


def heads(s: Connection, queues: Mapping[str, int], *, now: datetime) -> list[Candidate]:
    """Per queue (-> K), each tenant's K oldest runnable jobs per band: unpublished, out of
    back-off. Published and backing-off jobs in the range are skipped row by row; both are
    few (published ones are bounded by the free slots)."""
    out: list[Candidate] = []
    for queue, k in sorted(queues.items()):
        for tenant_id in tenants_with_work(s, queue):
            for band in bands(s, queue, tenant_id):
                rows = s.execute(_HEAD_ROWS, {"queue": queue, "tenant": tenant_id, "band": band,
                                              "now": now, "k": k}).all()
                out += [Candidate(id=r[0], tenant_id=tenant_id, queue=queue, size_class=r[2],
                                  gpus=r[3], priority=band, submitted_at_s=r[4].timestamp(),
                                  timeout_s=r[5], name=r[1], pending_reason=r[6],
                                  pending_detail=r[7],
                                  queued_since_s=r[8].timestamp() if r[8] else None,
                                  deadline_s=r[9].timestamp() if r[9] else None)
                        for r in rows]
    return out


def view(s: Connection, *, now: datetime, queues: Sequence[str]) -> SchedulingView:
    """Tenants, running jobs with their current attempt's start, and published-unclaimed jobs
    of `queues` (every queue the pool can have: one range of `ix_jobs_dispatch` each)."""
    tenants = [TenantShare(id=t.id, name=t.name, weight=t.weight, quotas=dict(t.quotas or {}),
                           usage_gpu_s=t.usage_gpu_s, usage_at=t.usage_at,
                           disabled=t.disabled_at is not None)
               for t in s.execute(_TENANTS)]
    running = [RunningJob(id=r[0], tenant_id=r[1], node=r[2], size_class=r[3], gpus=r[4],
                          started_at=r[5], timeout_s=r[6],
                          lease_live=r[7] is not None and r[7] > now, priority=r[8],
                          preemptible=bool(r[9]), preempt_requested=r[10] is not None,
                          held_gpus=r[11] or "")
               for r in s.execute(_RUNNING)]
    outstanding = [Published._make(r) for r in s.execute(_OUTSTANDING,
                                                         {"queues": list(queues)})]
    return SchedulingView(tenants=tenants, running=running, outstanding=outstanding)


def _mark(rows: ColumnElement[bool], *, at: Any, token: Any, host: Any,
          gpus: Any) -> Update:
    """The mark of the queued, unpublished jobs `rows` as published `at`, each with its
    `token` (and gang `host` and `gpus`, or None): values, or expressions bound or built over
    the ids (`mark_dispatched`). Returns (id, token) of each marked job."""
    return (update(Job).where(rows, unindexed(Job.state) == JobState.QUEUED.value,
                              unindexed(Job.dispatched_at).is_(None))
            .values(dispatched_at=at, dispatch_count=Job.dispatch_count + 1,
                    dispatch_token=token, dispatch_host=host, dispatch_gpus=gpus,
                    pending_reason=None, pending_detail=None)
            .returning(Job.id, Job.dispatch_token))


# The mark of one job published to its class's queue, built once
_MARK_ONE = _mark(Job.id == bindparam("job_id"), at=bindparam("now", type_=UTCDateTime()),
                  token=bindparam("token", type_=String()), host=None, gpus=None)

# The view's reads, built once as the heads' are
_TENANTS = select(Tenant.id, Tenant.name, Tenant.weight, Tenant.quotas, Tenant.usage_gpu_s,
                  Tenant.usage_at, Tenant.disabled_at)
_RUNNING = (select(Job.id, Job.tenant_id, Job.lease_owner, Job.size_class, Job.gpus,
                   Attempt.started_at, Job.timeout_s, Job.lease_expires_at, Job.priority,
                   Job.preemptible, Job.preempt_requested_at, Attempt.gpus)
            .outerjoin(Attempt, and_(Attempt.job_id == Job.id, Attempt.n == Job.attempts_used))
            .where(Job.state == JobState.RUNNING.value))
_OUTSTANDING = (select(Job.tenant_id, Job.queue, Job.size_class, Job.gpus, Job.timeout_s, Job.id,
                       Job.priority, Job.queued_since, Job.dispatch_host, Job.dispatch_gpus)
                .where(Job.state == QUEUED, Job.queue.in_(bindparam("queues", expanding=True)),
                       Job.dispatched_at >= EPOCH))


def write_pending(s: Connection,
                  changes: Iterable[tuple[str, str | None, str | None]]) -> int:
    """Store each job's (reason, detail), grouped so one UPDATE serves all with the same."""
    groups: dict[tuple[str | None, str | None], list[str]] = defaultdict(list)
    for job_id, reason, detail in changes:
        groups[(reason, detail)].append(job_id)
    n = 0
    for (reason, detail), ids in groups.items():
        for start in range(0, len(ids), CHUNK):
            s.execute(_WRITE_PENDING, {"b_ids": ids[start:start + CHUNK], "b_reason": reason,
                                       "b_detail": detail})
        n += len(ids)
    return n


# What a tick writes of why jobs wait, built once (issue 31): one group's ids and values bound
_WRITE_PENDING = (update(Job).where(Job.id.in_(bindparam("b_ids", expanding=True)),
                                    unindexed(Job.state) == QUEUED)
                  .values(pending_reason=bindparam("b_reason", type_=String()),
                          pending_detail=bindparam("b_detail", type_=String())))


def load(s: Session, queue: str, *, now: datetime) -> QueueLoad:
    """A queue's runnable backlog per (tenant, band) and its starts in the recent window.
    Read when someone asks about a queued job (the service reuses it a few seconds), never
    on the scheduler's tick; one index range over the queue's runnable jobs."""
    backlog = {(t, int(p)): int(n) for t, p, n in s.execute(
        select(Job.tenant_id, Job.priority, func.count()).where(
            *runnable_prefix(queue), Job.dispatched_at.is_(None))
        .group_by(Job.tenant_id, Job.priority)).tuples()}
    starts = int(s.scalar(select(func.count()).select_from(Attempt)
                          .join(Job, Job.id == Attempt.job_id)
                          .where(Attempt.started_at >= now - timedelta(seconds=RECENT_STARTS_S),
                                 Job.queue == queue)) or 0)
    return QueueLoad(backlog=backlog, starts_recent=starts, window_s=RECENT_STARTS_S)


def position(s: Session, job: Job) -> QueuePosition:
    """What one queued job's explanation needs besides its queue's load: its tenant's older
    jobs in its band (counted up to POSITION_CAP), its first unfinished dependency."""
    older = select(Job.id).where(
        *runnable_prefix(job.queue), Job.tenant_id == job.tenant_id,
        Job.priority == job.priority, Job.dispatched_at.is_(None),
        Job.submitted_at < job.submitted_at).limit(POSITION_CAP).subquery()
    older_own = int(s.scalar(select(func.count()).select_from(older)) or 0)
    first = deps.first_pending(s, job.id) if job.deps_pending else None
    return QueuePosition(tenant_id=job.tenant_id, older_own=older_own, first_dependency=first,
                         published=job.dispatched_at is not None,
                         stored_reason=job.pending_reason, stored_detail=job.pending_detail)


def queued_by_tenant(s: Session) -> dict[tuple[str, str], int]:
    """(size class, tenant id) -> queued jobs: one grouped read, for `e31 queue`."""
    return {(c, t): int(n) for c, t, n in s.execute(
        select(Job.size_class, Job.tenant_id, func.count()).where(Job.state == QUEUED)
        .group_by(Job.size_class, Job.tenant_id)).tuples()}


def running_gpus(running: Sequence[RunningJob], outstanding: Sequence[Published], *,
                 slots: bool = False) -> dict[str, dict[str, int]]:
    """Tenant id -> size class -> GPUs running or published and not yet claimed. With
    `slots`, the slots they hold: a job of no GPU (the cpu class's) holds one CPU slot, which
    is what `e31 queue` counts for a CPU class (fair share and quotas count GPUs only)."""
    acc: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in running:
        acc[r.tenant_id][r.size_class] += r.gpus or int(slots)
    for p in outstanding:
        acc[p.tenant_id][p.size_class] += p.gpus or int(slots)
    return {t: dict(c) for t, c in acc.items()}


class SchedulingStore(BillingStore):
    """The leader's reads and writes, and the explanations' reads. It ends the attempts of
    expired leases (`attempts.end_attempt`), so it bills them: a `BillingStore`."""

    def heads(self, queues: Mapping[str, int], *, now: datetime) -> list[Candidate]:
        """Per queue (-> K), each tenant's K oldest runnable jobs per band (store/scheduling.py)."""
        with self._core() as c:
            return heads(c, queues, now=now)

    def scheduling_view(self, *, now: datetime, queues: Sequence[str]) -> SchedulingView:
        """Tenants, running jobs and the published-unclaimed jobs of `queues` (all the pool's:
        `sizeclasses.all_queues`): one read per tick."""
        with self._core() as c:
            return view(c, now=now, queues=queues)

    def write_pending(self, changes: Sequence[tuple[str, str | None, str | None]]) -> int:
        """Store why queued jobs wait, as (job id, reason, detail); only changes are passed."""
        if not changes:
            return 0
        with self._core(write=True) as c:
            return write_pending(c, changes)

    def queue_position(self, tenant_id: str, job_id: str) -> QueuePosition:
        """What a queued job's position needs besides its queue's load (on request only)."""
        with self._session() as s:
            return position(s, find_job(s, tenant_id, job_id))

    def queue_load(self, queue: str, *, now: datetime) -> QueueLoad:
        """A queue's backlog per (tenant, band) and recent starts (on request only)."""
        with self._session() as s:
            return load(s, queue, now=now)

    def queued_by_tenant(self) -> dict[tuple[str, str], int]:
        """(size class, tenant id) -> queued jobs."""
        with self._session() as s:
            return queued_by_tenant(s)

    def mark_dispatched(self, job_ids: Sequence[str], *, now: datetime,
                        places: Mapping[str, tuple[str, str]] | None = None,
                        pending: Sequence[tuple[str, str | None, str | None]] = (),
                        ) -> dict[str, str]:
        """Mark jobs published, each with a new dispatch token; returns job id -> token for
        those still queued and unpublished (the ones to send: each message carries its job's
        token, and only a message with the current token claims the job). `places`: job id ->
        (host, GPU indexes) of the jobs published to a host's gang queue. `pending`: why
        other queued jobs wait (`write_pending`'s), stored in the same transaction."""
        if not job_ids:
            self.write_pending(pending)
            return {}
        tokens = {job_id: new_dispatch_token() for job_id in dict.fromkeys(job_ids)}
        places = places or {}
        hosts = {j: places[j][0] for j in tokens if j in places}
        gpus = {j: places[j][1] for j in tokens if j in places}
        with self._core(write=True) as c:
            write_pending(c, pending)
            if len(tokens) == 1 and not places:   # a tick after one job's end: the usual one
                [(job_id, token)] = tokens.items()
                statement, bound = _MARK_ONE, {"job_id": job_id, "token": token, "now": now}
            else:
                statement, bound = _mark(
                    Job.id.in_(list(tokens)), at=now, token=case(tokens, value=Job.id),
                    host=case(hosts, value=Job.id, else_=None) if hosts else None,
                    gpus=case(gpus, value=Job.id, else_=None) if gpus else None), {}
            rows = c.execute(statement, bound).tuples().all()
            return {job_id: token for job_id, token in rows if token is not None}

    def expire_dispatches(self, queues: Sequence[str] | None, *, now: datetime,
                          timeout_s: float) -> int:
        """Forget publications never claimed within `timeout_s`, so they are published again
        (with new tokens: a late message of the forgotten one claims nothing).

        Only for `queues` that have an idle consumer: a message waiting behind busy workers
        is not lost, and publishing it again would only pile up duplicates. `queues=None`
        means every queue (the broker lost its messages: nothing is waiting anywhere).
        """
        if queues is not None and not queues:
            return 0
        with self._session(write=True) as s:
            q = update(Job).where(Job.state == JobState.QUEUED.value,
                                  Job.dispatched_at < now - timedelta(seconds=timeout_s))
            if queues is not None:
                q = q.where(Job.queue.in_(list(queues)))
            res = s.execute(q.values(dispatched_at=None, dispatch_token=None,
                                     dispatch_host=None, dispatch_gpus=None))
            return int(res.rowcount or 0)  # type: ignore[attr-defined]

    def request_preemption(self, job_ids: Sequence[str], *, now: datetime) -> list[str]:
        """Ask the running attempts of `job_ids` to stop for a preemption (their workers see
        it at their next renewal); only preemptible running jobs not asked already. Returns
        the ids asked now."""
        if not job_ids:
            return []
        with self._session(write=True) as s:
            return list(s.scalars(update(Job).where(
                Job.id.in_(list(job_ids)), Job.state == JobState.RUNNING.value,
                Job.preemptible.is_(True), Job.preempt_requested_at.is_(None))
                .values(preempt_requested_at=now).returning(Job.id),
                execution_options={"synchronize_session": False}))

    def expire_leases(self, *, now: datetime, lease_ttl_s: float,
                      limit: int = EXPIRE_BATCH) -> list[tuple[str, JobState]]:
        """Recover running jobs whose lease expired: their worker or node died or was cut off.

        Each one's attempt ends as `lost` when its lease was last renewed (so the user is
        billed for what the worker last confirmed, not for the time it was silent), and the
        job is queued again at once, or fails when `retries.max_lost` attempts were lost.
        The fencing token stays, so the old worker's late writes are refused.
        """
        with self._session(write=True) as s:
            jobs = s.scalars(select(Job).where(
                Job.state == JobState.RUNNING.value, Job.lease_expires_at < now)
                .order_by(Job.lease_expires_at).limit(limit).with_for_update()).all()
            return self._end_lost(s, jobs, now=now, lease_ttl_s=lease_ttl_s, why=lambda job: (
                f"lease of worker {job.lease_owner} expired at "
                f"{_iso(job.lease_expires_at)}: the worker or its node died or was cut off"))

    def overdue_leases(self, *, now: datetime, lease_ttl_s: float,
                       silent_s: float) -> list[tuple[str, str]]:
        """(job id, lease owner) of running jobs whose lease was last renewed more than
        `silent_s` ago and has not expired yet: the jobs of workers that may have died (the
        scheduler asks their heartbeats, `e31.scheduling.leader`). One read of running rows."""
        renewed_before = now + timedelta(seconds=lease_ttl_s - silent_s)
        with self._session() as s:
            return [(job_id, owner) for job_id, owner in s.execute(
                select(Job.id, Job.lease_owner).where(
                    Job.state == JobState.RUNNING.value, Job.lease_expires_at >= now,
                    Job.lease_expires_at < renewed_before)).tuples()
                    if owner is not None]

    def expire_silent(self, job_ids: Sequence[str], *, now: datetime, lease_ttl_s: float,
                      silent_s: float) -> list[tuple[str, JobState]]:
        """End as `lost` the attempts of `job_ids` whose worker went silent (its lease not
        renewed for `silent_s`, its heartbeat gone or beating without the job), before their
        lease expires: as
        `expire_leases` does, with the same fence (the token stays, the job leaves `running`,
        so the old worker's renewal and outcome are refused). The staleness is checked again
        under the row lock: a renewal that came in meanwhile keeps its job."""
        if not job_ids:
            return []
        renewed_before = now + timedelta(seconds=lease_ttl_s - silent_s)
        with self._session(write=True) as s:
            jobs = s.scalars(select(Job).where(
                Job.id.in_(list(job_ids)), Job.state == JobState.RUNNING.value,
                Job.lease_expires_at < renewed_before)
                .order_by(Job.id).with_for_update()).all()
            return self._end_lost(s, jobs, now=now, lease_ttl_s=lease_ttl_s, why=lambda job: (
                f"worker {job.lease_owner} went silent (no lease renewal for {silent_s:g} s, "
                "and no heartbeat with this job): the worker or its node died"))

    def _end_lost(self, s: Session, jobs: Sequence[Job], *, now: datetime, lease_ttl_s: float,
                  why: Callable[[Job], str]) -> list[tuple[str, JobState]]:
        """End each job's attempt `lost` at its last renewal (`attempts.end_attempt`)."""
        done = []
        for job in jobs:
            assert job.lease_expires_at is not None
            renewed = job.lease_expires_at - timedelta(seconds=lease_ttl_s)
            state = end_attempt(s, job, Outcome(AttemptReason.LOST, error=why(job)),
                                ended_at=renewed, now=now, half_life_s=self._half_life_s)
            if state is not None:
                done.append((job.id, state))
        return done


def _iso(at: datetime | None) -> str:
    return at.isoformat() if at is not None else "?"
