"""`AttemptStore`: everything a worker asks of the store for the attempts it runs.

Who uses it: the worker (`e31_worker`): the claim of a published job for the message that
carries its dispatch token, the lease's renewal, the fenced outcome write, the dispatch
checks of a message that claimed nothing, the facts it notes on an attempt while it runs
(`AttemptFacts`, carried by its next renewal or its outcome as an `AttemptNote`), the
ciphertexts of the attempt's secrets, the charge of its outputs against its tenant's quota.
Two of the worker's calls are other nouns' and reach their stores on the same engine: an
array's manifest (`ArrayStore`, for an array input) and its node's drain requests
(`DrainStore`). `end_attempt`, the statement that ends an attempt and moves its job
on, also serves the scheduler's recovery of expired leases (`SchedulingStore.expire_leases`).

The attempt facts' columns are nullable: an attempt started before they existed, or one whose
worker did not get as far as measuring, shows null ("not known"), never a made-up zero.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from functools import cache, cached_property
from typing import Any, NamedTuple, TypeAlias

from sqlalchemy import (
    BindParameter,
    ColumnElement,
    Connection,
    Float,
    Row,
    Select,
    String,
    Update,
    and_,
    bindparam,
    exists,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.orm import Session

from e31.core.errors import StoreError
from e31.core.records import ArrayManifest, Claim, Outcome, Renewal
from e31.core.retries import RetryPolicy
from e31.core.sizeclasses import OomRule
from e31.core.spec import JobSpec
from e31.core.states import INFRA_RETRIES_DEFAULT, AttemptReason, Isolation, JobState, Start
from e31.store import deps, quotas, secrets, tenants, transitions
from e31.store.arrays import ArrayStore
from e31.store.base import BillingStore
from e31.store.db import core_of
from e31.store.drains import DrainStore
from e31.store.models import ATTEMPTS, JOBS, Attempt, Job, Tenant, UTCDateTime
from e31.store.quotas import OutputsCharge
from e31.store.rows import seconds

ERROR_MAX_CHARS = 16_384   # an attempt's error text; the whole story is in the log
COUNTED_REASONS = [r.value for r in AttemptReason if r.counts_against_retries]
INFRA_REASONS = [r.value for r in AttemptReason if r.is_infra_fault]   # infra_retries caps
QUEUED = JobState.QUEUED.value
NEXT_ITEMS_READ = 64   # an array's items after an ended one that claim_next_item looks at


@dataclass(frozen=True)
class AttemptFacts:
    """What one note sets on an attempt row; a field left None is left as it was."""

    isolation: Isolation | None = None
    start: Start | None = None
    start_ms: float | None = None           # from fork/exec to the child running
    setup_s: float | None = None            # bundle, environment and inputs; never billed
    gpu_mem_peak_gb: float | None = None
    gpu_util_mean: float | None = None      # percent, 0..100
    # The limits it runs under: {"pids_max", "mem_gb", "disk_gb"[, "network"]}, each None
    # where not applied (e31_worker.attempt.attemptlimits).
    limits: dict[str, Any] | None = None

    def values(self) -> dict[str, object]:
        """The columns to write: the fields that are set, enums as their wire strings."""
        out: dict[str, object] = {}
        for name, value in asdict(self).items():
            if value is None:
                continue
            if isinstance(value, float | int) and not isinstance(value, bool) and value < 0:
                raise StoreError(f"attempt fact {name} cannot be negative: {value}")
            out[name] = value.value if isinstance(value, Isolation | Start) else value
        return out


# A job as an outcome reads it: its model (the scheduler's recovery loads them), or a row of
# its columns (a worker's outcome reads one, as Core: issue 31)
JobRow: TypeAlias = Job | Row[*tuple[Any, ...]]


@dataclass(frozen=True)
class AttemptNote:
    """Facts for attempt `n` of a job that a renewal or an outcome writes in its own
    transaction: a worker keeps what it learns at an attempt's start (how it started, its
    limits, its setup's time) for its next store write instead of a write of its own."""

    n: int
    facts: AttemptFacts


def _write_note(s: Session | Connection, job_id: str, note: AttemptNote | None) -> bool:
    """Set `note`'s facts on its attempt of `job_id`; False when there is no such attempt.
    Not fenced by the lease: the row is the attempt's own, and what it notes describes how
    it ran, whoever records its outcome."""
    if note is None or not (values := note.facts.values()):
        return True
    res = s.execute(update(Attempt).where(Attempt.job_id == job_id, Attempt.n == note.n)
                    .values(**values))
    return bool(res.rowcount)  # type: ignore[attr-defined]


class AttemptStore(BillingStore):
    """The worker's store: claim, renew, record; dispatch checks; attempt facts; secrets and
    outputs for an attempt; and, through their stores, array manifests and drain requests."""

    @cached_property
    def _arrays(self) -> ArrayStore:
        return ArrayStore(self._engine)

    @cached_property
    def _drains(self) -> DrainStore:
        return DrainStore(self._engine)

    # -- claim, renew, record --------------------------------------------------------------

    def claim(self, job_id: str, *, dispatch_token: str, worker: str, gpus: str, gpu_count: int,
              now: datetime, lease_ttl_s: float) -> Claim | None:
        """Atomically move a runnable queued job to running, for the message that carries the
        job's current dispatch token; None if it is not claimable. The claim clears the token:
        the same message delivered again, or replayed, claims nothing."""
        with self._core(write=True) as c:
            taken = _take(c, _CLAIM, worker=worker, gpus=gpus, gpu_count=gpu_count, now=now,
                          lease_ttl_s=lease_ttl_s, job_id=job_id, token=dispatch_token)
        return _claim(taken)

    def claim_next_item(self, ended_job_id: str, *, queue: str | None, worker: str, gpus: str,
                        gpu_count: int, now: datetime, lease_ttl_s: float) -> Claim | None:
        """The next item of the array of `ended_job_id`, an item this worker just ran, claimed
        without a publication (docs/scheduling.md, "Array items in a row"); None when the
        scheduler must choose instead. `queue` is the worker's own class's: an item it took
        from a queue it spills to is not followed by more (its bigger GPU goes back to its
        own class's work); None for a gang worker, whose dispatch chose the ended item's
        GPUs for its class: the next item must be of that class. One transaction: the
        runnable ones of the `NEXT_ITEMS_READ` items after the ended one
        (`_runnable_after`); whether anything waits that the scheduler could put before the first
        runnable one, and whether its tenant may have one more (`_may_take`); then the claim
        of the first runnable one no other transaction holds, as a published job's claim
        (its fencing token, its queued time, its attempt row)."""
        with self._core(write=True) as c:
            runnable = _runnable_after(c, ended_job_id, queue, now)
            if not runnable or not _may_take(c, runnable[0]):
                return None
            # The first of them that no one else is taking: the scheduler publishes an array's
            # items from the same end, and other workers chain from the same window. SKIP
            # LOCKED passes over the rows their transactions hold instead of waiting for them
            # (SQLite has one writer: no lock to skip).
            taken = _take(c, _TAKE_NEXT, worker=worker, gpus=gpus, gpu_count=gpu_count, now=now,
                          lease_ttl_s=lease_ttl_s, ids=[item.id for item in runnable])
        return _claim(taken)

    def renew(self, job_id: str, token: int, *, now: datetime, lease_ttl_s: float,
              progress: tuple[float, float] | None = None,
              note: AttemptNote | None = None) -> Renewal:
        """Extend the lease; says whether it is still ours and whether the job's owner
        cancelled it or the scheduler asked to preempt it. `note`: facts of the attempt
        written in the same transaction."""
        values: dict[str, Any] = {"lease_expires_at": now + timedelta(seconds=lease_ttl_s)}
        if progress is not None:
            values.update(progress_done=progress[0], progress_total=progress[1])
        with self._core(write=True) as c:
            _write_note(c, job_id, note)
            row = c.execute(_RENEW, {"b_id": job_id, "b_token": token, **values}).first()
            if row is None:
                return Renewal(False, False, False)
            return Renewal(True, bool(row[0]), row[1] is not None)

    def held_by(self, worker: str) -> list[tuple[str, int]]:
        """The running jobs whose lease `worker` (a node name) holds, each with its fencing
        token: what its launcher ends `lost` when that worker process died
        (e31_worker.node.release). Bounded by the pool, not the backlog."""
        with self._session() as s:
            return [(job_id, token) for job_id, token in s.execute(
                select(Job.id, Job.lease_token).where(
                    Job.state == JobState.RUNNING.value, Job.lease_owner == worker)).tuples()]

    def record_outcome(self, job_id: str, token: int, outcome: Outcome, *,
                       now: datetime, oom: OomRule | None = None,
                       infra_retries: int = INFRA_RETRIES_DEFAULT,
                       note: AttemptNote | None = None) -> JobState | None:
        """Write an attempt's outcome if `token` still holds the lease; None when fenced off.
        `oom`: the pool's rule for an attempt that ran out of memory (the next size class);
        None: such an attempt is retried in its own class like any failure. `infra_retries`:
        the pool's patience with its own faults (`AttemptReason.is_infra_fault`), which the
        worker reads from its settings as it reads `oom`'s. `note`: facts of the attempt not
        written yet, written in the same transaction, fenced off or not (its setup's time
        before the bill is reckoned from it)."""
        with self._core(write=True) as c:
            job = c.execute(_JOB_TO_END, {"job_id": job_id}).first()
            if job is None or job.state != JobState.RUNNING.value or job.lease_token != token:
                _write_note(c, job_id, note)
                return None
            # the token is this claim's: the job's current attempt is the note's
            return end_attempt(c, job, outcome, ended_at=now, now=now,
                               half_life_s=self._half_life_s, oom=oom,
                               infra_retries=infra_retries,
                               facts=note.facts if note is not None else None)

    def release_dispatch(self, job_id: str, dispatch_token: str) -> bool:
        """Forget a publication that a worker received but will not claim (it is draining),
        so the scheduler publishes the job again at once instead of after the dispatch timeout.
        Only the message that carries the publication's token may hand it back."""
        with self._session(write=True) as s:
            res = s.execute(update(Job).where(
                Job.id == job_id, Job.state == JobState.QUEUED.value,
                Job.dispatched_at.is_not(None), holds_dispatch(dispatch_token))
                .values(dispatched_at=None, dispatch_token=None, dispatch_host=None,
                        dispatch_gpus=None))
            return bool(res.rowcount)  # type: ignore[attr-defined]

    def dispatch_place(self, job_id: str, dispatch_token: str) -> tuple[str, str] | None:
        """The host and GPU indexes a gang dispatch gives the job, for the message that carries
        its current token; None for any other message, or a class queue's."""
        with self._session() as s:
            row = s.execute(select(Job.dispatch_host, Job.dispatch_gpus).where(
                Job.id == job_id, Job.state == JobState.QUEUED.value,
                holds_dispatch(dispatch_token))).first()
            if row is None or row[0] is None or row[1] is None:
                return None
            return str(row[0]), str(row[1])

    def dispatch_refused(self, job_id: str, dispatch_token: str) -> bool:
        """Whether a message that claimed nothing was refused for its token: its job waits to
        be claimed, under another publication's token or none, so the message was forged,
        replayed, or superseded by a re-publication. False when the job itself was not
        claimable (running, final, cancelled, not due yet, or no such job)."""
        with self._session() as s:
            return s.scalar(select(Job.id).where(
                Job.id == job_id, Job.state == JobState.QUEUED.value,
                or_(Job.dispatch_token.is_(None), ~holds_dispatch(dispatch_token)))) is not None

    # -- what a worker notes on an attempt ------------------------------------------------

    def note_attempt(self, job_id: str, attempt: int, facts: AttemptFacts) -> bool:
        """Set `facts` on attempt `attempt` of `job_id`; False when there is no such attempt.

        Not fenced by the lease: the row is this attempt's own, and what it notes describes
        how it ran, whoever records its outcome.
        """
        if not facts.values():
            return True
        with self._session(write=True) as s:
            return _write_note(s, job_id, AttemptNote(attempt, facts))

    def mark_idle(self, job_id: str, attempt: int, since: datetime | None) -> bool:
        """Flag attempt `attempt` of `job_id` idle since `since` (its watchdog saw no log,
        progress or GPU use move for its idle_timeout_s), or clear the flag (None) when it
        moves again; False when there is no such attempt."""
        with self._session(write=True) as s:
            res = s.execute(update(Attempt).where(Attempt.job_id == job_id,
                                                  Attempt.n == attempt).values(idle_since=since))
            return bool(res.rowcount)  # type: ignore[attr-defined]

    # -- an attempt's secrets and outputs ---------------------------------------------------

    def secret_ciphertexts(self, tenant_id: str, names: Sequence[str]) -> dict[str, str]:
        """The ciphertexts of the tenant's secrets among `names` (a worker decrypts them for
        the attempt it starts); a name the tenant lacks is absent."""
        if not names:
            return {}
        with self._session() as s:
            return secrets.ciphertexts(s, tenant_id, names)

    def charge_outputs(self, tenant_id: str, deltas_bytes: Sequence[int], *,
                       default_max_bytes: int, force: bool = False) -> OutputsCharge:
        """Add each delta to the tenant's outputs total, in order, if the total stays within
        its cap (the tenant's own, else `default_max_bytes`); a delta <= 0 (a refund, a file
        replaced by a smaller one) is always taken, and every delta with `force` (bytes that
        are stored already). One row-locked transaction, so the concurrent charges of one
        tenant's jobs add up and none is lost."""
        with self._session(write=True) as s:
            return quotas.charge(s, tenant_id, deltas_bytes, default_max_bytes=default_max_bytes,
                                 force=force)

    # -- other nouns' statements a worker calls, through their stores -----------------------

    def array_manifest(self, tenant_id: str, array_id: str) -> ArrayManifest:
        """An array's manifest, for an array input (`ArrayStore.array_manifest`)."""
        return self._arrays.array_manifest(tenant_id, array_id)

    def request_drain(self, nodes: Sequence[str], *, now: datetime,
                      reason: str | None = None) -> None:
        """A node's own drain request, for a GPU's XID error (`DrainStore.request_drain`)."""
        self._drains.request_drain(nodes, now=now, reason=reason)

    def drain_requested(self, node: str, *, since: datetime) -> bool:
        """Whether the node was asked to drain (`DrainStore.drain_requested`)."""
        return self._drains.drain_requested(node, since=since)

    def drained_since(self, *, since: datetime) -> set[str]:
        """The nodes a launcher leaves stopped (`DrainStore.drained_since`)."""
        return self._drains.drained_since(since=since)

    def clear_drain(self, nodes: Sequence[str]) -> int:
        """Forget the drain requests of the nodes a launcher starts (`DrainStore.clear_drain`)."""
        return self._drains.clear_drain(nodes)


# -- statements on a session a store opens -------------------------------------------------

def holds_dispatch(dispatch_token: str | BindParameter[str]) -> ColumnElement[bool]:
    """The condition that a message's token is its job's current dispatch token: the one
    check that lets a message claim a job or hand its publication back (docs/security.md,
    "The broker is not a trust boundary")."""
    return Job.dispatch_token == dispatch_token


class _Item(NamedTuple):
    """An item of an array after the one a worker ran, as `claim_next_item` reads it."""

    id: str
    state: str
    queue: str
    tenant_id: str
    priority: int
    size_class: str
    gpus: int
    submitted_at: datetime
    dispatched_at: datetime | None
    deps_pending: int
    cancel_requested: bool
    not_before: datetime | None

    def runnable(self, queue: str, now: datetime) -> bool:
        """Queued in `queue`, unpublished, not cancelled, no dependency left, due."""
        return (self.state == QUEUED and self.queue == queue and self.dispatched_at is None
                and self.deps_pending == 0 and not self.cancel_requested
                and (self.not_before is None or self.not_before <= now))


def _take_statement(job: BindParameter[str] | Select[Any],
                    claimable: ColumnElement[bool]) -> Update:
    """The statement that moves the queued job `job` (a bound id, or the select of at most
    one) to running if `claimable` holds and it is runnable now: a new lease and fencing
    token, one more attempt used. Its values are bound when it runs (`_take`): `worker`,
    `now`, `expires` (the lease's end)."""
    now = bindparam("now", type_=UTCDateTime())
    return (transitions.move(job, JobState.QUEUED, JobState.RUNNING)
            .where(claimable, Job.cancel_requested.is_(False),
                   or_(Job.not_before.is_(None), Job.not_before <= now))
            .values(lease_owner=bindparam("worker", type_=String()),
                    lease_token=Job.lease_token + 1,
                    lease_expires_at=bindparam("expires", type_=UTCDateTime()),
                    attempts_used=Job.attempts_used + 1,
                    started_at=func.coalesce(Job.started_at, now),
                    dispatched_at=None, dispatch_token=None, dispatch_host=None,
                    dispatch_gpus=None, progress_done=None, progress_total=None)
            .returning(Job.id, Job.lease_token, Job.attempts_used, Job.queued_since, Job.spec,
                       Job.tenant_id, Job.gpus, Job.array_id))


def _claim_statement() -> Update:
    """A published job's claim: the job and the message's token are bound at each claim, and
    only the job's current dispatch token claims it (`holds_dispatch`)."""
    return _take_statement(bindparam("job_id", type_=String()),
                           holds_dispatch(bindparam("token", type_=String())))


# Built once (its construction was a tenth of a claim's CPU, issue 31)
_CLAIM = _claim_statement()
# The job an outcome ends, row-locked (built once)
_JOB_TO_END = (select(*JOBS.c)
               .where(JOBS.c.id == bindparam("job_id", type_=String()))
               .with_for_update())
# The next item's claim in a row (`claim_next_item`), built once: the first of the runnable
# items (`ids`) that no other transaction holds. The scheduler publishes an array's items from
# the same end, and other workers chain from the same window: SKIP LOCKED passes over the rows
# their transactions hold instead of waiting for them (SQLite has one writer: no lock to skip).
_TAKE_NEXT = _take_statement(
    select(Job.id).where(Job.id.in_(bindparam("ids", expanding=True)), Job.state == QUEUED,
                         Job.dispatched_at.is_(None))
    .order_by(Job.array_index).limit(1).with_for_update(skip_locked=True),
    Job.dispatched_at.is_(None))
# What the claim also writes: the job's queued time, and the attempt's row.
_COUNT_QUEUED = (update(Job).where(Job.id == bindparam("taken", type_=String()))
                 .values(queued_seconds=Job.queued_seconds + bindparam("waited", type_=Float()),
                         queued_since=None))
_ADD_ATTEMPT = insert(ATTEMPTS)


def _take(c: Connection, statement: Update, *, worker: str, gpus: str, gpu_count: int,
          now: datetime, lease_ttl_s: float,
          **bound: str | list[str]) -> tuple[str, str, int, int, Any, int, str | None] | None:
    """Run a take (`_take_statement`, with `bound`: its own parameters), and if it took the
    job, count its queued time and add the attempt's row. Returns what `_claim` makes the
    claim of (its spec as stored), None if it is not claimable."""
    row = c.execute(statement, {"worker": worker, "now": now,
                                "expires": now + timedelta(seconds=lease_ttl_s),
                                **bound}).first()
    if row is None:
        return None
    job_id, token, attempt, queued_since, spec, tenant_id, job_gpus, array_id = row
    c.execute(_COUNT_QUEUED, {"taken": job_id, "waited": seconds(queued_since, now)})
    c.execute(_ADD_ATTEMPT, {"job_id": job_id, "n": attempt, "worker": worker, "gpus": gpus,
                             "gpu_count": gpu_count, "started_at": now})
    return job_id, tenant_id, token, attempt, spec, job_gpus, array_id


def _claim(taken: tuple[str, str, int, int, Any, int, str | None] | None) -> Claim | None:
    """The claim of what `_take` took, its spec validated after the commit: params of up to a
    megabyte are not checked while the write transaction holds the store. It was validated on
    submit, so it passes again."""
    if taken is None:
        return None
    job_id, tenant_id, token, attempt, spec, gpus, array_id = taken
    return Claim(job_id=job_id, tenant_id=tenant_id, token=token, attempt=attempt,
                 spec=JobSpec.parse(spec, stored=True), gpus=gpus, array_id=array_id)


def _runnable_after(s: Connection, ended_job_id: str, queue: str | None,
                    now: datetime) -> list[_Item]:
    """The items among the `NEXT_ITEMS_READ` after `ended_job_id` in its array, by index, that
    may run now in `queue` (None: the ended item's own); none if it is no array's item or,
    with `queue` given, was not taken from it. One statement: the ended item's array, index
    and queue are its scalar subqueries, so the read is the array index's ordered range
    whatever the planner thinks of the rest (a filter on the state made PostgreSQL sort the
    whole array's queued items: 10 ms a claim at 10,000)."""
    q = _AFTER_IN_QUEUE if queue is not None else _AFTER
    items = []
    for *fields, ended_queue in s.execute(q, {"ended": ended_job_id, "queue": queue}).tuples():
        item = _Item._make(fields)
        if item.runnable(ended_queue, now):
            items.append(item)
    return items


def _after_statements() -> tuple[Select[*tuple[Any, ...]], Select[*tuple[Any, ...]]]:
    """`_runnable_after`'s read, built once: any queue's, and the given queue's."""
    ended = select(Job.array_id, Job.array_index, Job.queue).where(
        Job.id == bindparam("ended")).subquery()
    its_queue = select(ended.c.queue).scalar_subquery()
    q = (select(Job.id, Job.state, Job.queue, Job.tenant_id, Job.priority, Job.size_class,
                Job.gpus, Job.submitted_at, Job.dispatched_at, Job.deps_pending,
                Job.cancel_requested, Job.not_before, its_queue)
         .where(Job.array_id == select(ended.c.array_id).scalar_subquery(),
                Job.array_index > select(ended.c.array_index).scalar_subquery()))
    last = (Job.array_index,)
    return (q.order_by(*last).limit(NEXT_ITEMS_READ),
            q.where(its_queue == bindparam("queue")).order_by(*last).limit(NEXT_ITEMS_READ))


_AFTER, _AFTER_IN_QUEUE = _after_statements()


def _may_take(s: Connection, item: _Item) -> bool:
    """Whether the store may hand `item` to the worker instead of the scheduler choosing: no
    runnable job waits in its queue that the scheduler's order (docs/scheduling.md: band,
    share key, age) could put first (another tenant's, or the same tenant's in a higher band
    or older in the same band), its tenant is enabled, and its quota of the class, if it has
    one, holds one more (its jobs of the class running or published, as the scheduler counts
    them: `Tenant.fits_quota`). One statement with the tenant's row (a second only under a
    quota); each EXISTS is one range of the heads index (state, deps, queue, tenant, band,
    age), so the array's own queued items, however many, are never scanned."""
    row = s.execute(_TENANT_AND_BEFORE, {"queue": item.queue, "tenant": item.tenant_id,
                                         "band": item.priority,
                                         "submitted": item.submitted_at}).first()
    if row is None:
        return False
    quotas, disabled_at, put_first = row
    if put_first or disabled_at is not None:
        return False
    quota = (quotas or {}).get(item.size_class)
    if quota is None:
        return True
    held = s.scalar(select(func.coalesce(func.sum(Job.gpus), 0)).where(
        Job.tenant_id == item.tenant_id, Job.size_class == item.size_class,
        or_(Job.state == JobState.RUNNING.value,
            and_(Job.state == QUEUED, Job.dispatched_at.is_not(None)))))
    return int(held or 0) + item.gpus <= int(quota)


def _tenant_and_before() -> Select[dict[str, int] | None, datetime | None, bool]:
    """`_may_take`'s read, built once: the item's tenant's quotas and whether it is disabled,
    and whether anything waits in the item's queue that the scheduler could put first."""
    waiting = list(transitions.runnable_prefix(bindparam("queue", type_=String())))
    tenant: BindParameter[str] = bindparam("tenant", type_=String())
    own = [*waiting, Job.tenant_id == tenant]
    before = or_(*(exists().where(*where) for where in (
        [*waiting, Job.tenant_id < tenant],
        [*waiting, Job.tenant_id > tenant],
        [*own, Job.priority > bindparam("band")],
        [*own, Job.priority == bindparam("band"),
         Job.submitted_at < bindparam("submitted", type_=UTCDateTime())])))
    return select(Tenant.quotas, Tenant.disabled_at, before).where(Tenant.id == tenant)


_TENANT_AND_BEFORE = _tenant_and_before()


def end_attempt(s: Session | Connection, job: JobRow, outcome: Outcome, *, ended_at: datetime,
                now: datetime, half_life_s: float, oom: OomRule | None = None,
                infra_retries: int = INFRA_RETRIES_DEFAULT,
                facts: AttemptFacts | None = None) -> JobState | None:
    """End the running attempt of a row-locked `job` with `outcome`, bill it (the job and its
    tenant's decayed usage), move the job on, and settle what waited for it. An `oom`
    attempt that `oom` sends to a bigger class queues the job there at once, noted on the
    attempt (`moved_to`) and not counted against its retries (docs/scheduling.md). A fault of
    the pool's own is retried up to `infra_retries` such attempts (`_next_state`); the
    scheduler's recovery ends only `lost` attempts, which that cap leaves alone. `facts`:
    what the worker noted on the attempt and had not written yet, set with its end (its
    setup's time before the bill is reckoned)."""
    token = job.lease_token
    core = core_of(s)   # Core statements: a session's models of these rows are not read again
    attempt = core.execute(_CURRENT_ATTEMPT, {"job": job.id, "n": job.attempts_used}).first()
    duration = bill_s = 0.0
    ended: dict[str, Any] = facts.values() if facts is not None else {}
    if attempt is not None:
        ended_at = max(ended_at, attempt.started_at)
        ended.update(ended_at=ended_at, reason=outcome.reason.value,
                     error=_clean(outcome.error), exit_code=outcome.exit_code)
        # Run time from the end of its setup, which its worker noted (`setup_s`): fetching
        # code, building the environment and staging inputs is never billed.
        setup_s = ended.get("setup_s", attempt.setup_s) or 0.0
        duration = max(0.0, seconds(attempt.started_at, ended_at) - setup_s)
        bill_s = duration * attempt.gpu_count
    # The job's totals go in the statement that moves it on (`_outcome_values`), not in a
    # flush of their own: one UPDATE of the job per outcome.
    totals = {"gpu_seconds": job.gpu_seconds + bill_s, "run_seconds": job.run_seconds + duration}
    move = None
    if outcome.reason is AttemptReason.OOM and oom is not None and attempt is not None \
            and not job.cancel_requested:
        move = oom.target((job.spec.get("resources") or {}).get("on_oom"), job.size_class,
                          job.gpus)
        ended["moved_to"] = move.size_class if move else None
    if attempt is not None:   # one UPDATE by key, before the tally below reads it
        core.execute(_END_ATTEMPT, {"b_attempt": attempt.id, **ended})
    # The tally of earlier endings decides only whether a retryable ending is retried: a
    # success, a cancel or a final error skips it (one statement less per outcome).
    tally: dict[str | None, int] = {}
    # Attempts that moved the job to a bigger class are not failures of it.
    if outcome.reason.is_retryable and not job.cancel_requested and move is None:
        tally = dict(core.execute(select(Attempt.reason, func.count()).where(
            Attempt.job_id == job.id, Attempt.moved_to.is_(None))
            .group_by(Attempt.reason)).tuples().all())
    counts = Tally(failures=sum(n for reason, n in tally.items() if reason in COUNTED_REASONS),
                   lost=tally.get(AttemptReason.LOST.value, 0),
                   infra=sum(n for reason, n in tally.items() if reason in INFRA_REASONS))
    state, error = _next_state(job, outcome, counts, infra_retries)
    if move is not None:
        state, error = JobState.QUEUED, f"oom: moved to {move.size_class}: {outcome.error}"
    values = totals | _outcome_values(job, dataclasses.replace(outcome, error=error), state,
                                      now, counts)
    if move is not None:    # its next attempt, in the bigger class, may start at once
        values.update(size_class=move.size_class, queue=move.queue, not_before=now)
    res = core.execute(_end_job(state), {"b_id": job.id, "b_token": token, **values})
    if not res.rowcount:
        return None
    if state.is_final:
        deps.on_final(core, [(job.id, job.array_id, state.value)], now=now)
    tenants.bill(core, job.tenant_id, bill_s, now=now, half_life_s=half_life_s)
    return state


# A lease's renewal, fenced by its token: the columns it sets are its parameters' (the lease's
# end, and the progress when the worker has one), built once (issue 31)
_RENEW = (update(JOBS)
          .where(JOBS.c.id == bindparam("b_id"),
                 JOBS.c.lease_token == bindparam("b_token"),
                 JOBS.c.state == JobState.RUNNING.value)
          .returning(JOBS.c.cancel_requested,
                     JOBS.c.preempt_requested_at))

# An attempt's end, by key: the columns it sets are its parameters' (built once, issue 31)
_END_ATTEMPT = update(ATTEMPTS).where(ATTEMPTS.c.id == bindparam("b_attempt"))


@cache
def _end_job(state: JobState) -> Update:
    """A running job's move to `state` at its attempt's end, fenced by its lease token
    (`b_token`); the columns it sets are its parameters' (`transitions.move_by_key`)."""
    return transitions.move_by_key(JobState.RUNNING, state).where(
        JOBS.c.lease_token == bindparam("b_token"))


# The attempt an outcome ends, read by key with what its bill needs (built once, issue 31)
_CURRENT_ATTEMPT = select(Attempt.id, Attempt.started_at, Attempt.setup_s,
                          Attempt.gpu_count).where(Attempt.job_id == bindparam("job"),
                                                   Attempt.n == bindparam("n"))


def _clean(text: str | None) -> str | None:
    """Error text as every backend stores it: no NUL (PostgreSQL refuses it), bounded."""
    if text is None:
        return None
    text = text.replace("\x00", "\\0")
    return text if len(text) <= ERROR_MAX_CHARS else text[:ERROR_MAX_CHARS] + " [cut]"


@dataclass(frozen=True)
class Tally:
    """A job's attempts so far, this one included, by what caps them (e31.core.states.REASONS).

    `failures`: the user's, which count against `retries.max`; `lost`: lost with their
    worker, capped by `retries.max_lost`; `infra`: the pool's own faults, capped by the pool's
    `infra_retries`.
    """

    failures: int = 0
    lost: int = 0
    infra: int = 0


def _next_state(job: JobRow, outcome: Outcome, counts: Tally,
                infra_retries: int = INFRA_RETRIES_DEFAULT) -> tuple[JobState, str | None]:
    """The job's next state and its error text, as `REASONS` says for the attempt's reason:
    final, retried on the user's account (`retries.max`), or on the pool's (`max_lost`,
    `infra_retries`, or no cap for a drain or a preemption)."""
    if outcome.reason is AttemptReason.SUCCEEDED:
        return JobState.SUCCEEDED, None
    if outcome.reason is AttemptReason.CANCELLED or job.cancel_requested:
        return JobState.CANCELLED, outcome.error
    if not outcome.reason.is_retryable:
        return JobState.FAILED, outcome.error
    retries = RetryPolicy.model_validate(job.spec.get("retries") or {})
    if outcome.reason is AttemptReason.LOST and counts.lost >= retries.max_lost:
        return JobState.FAILED, (
            f"poison job: lost its worker {counts.lost} times "
            f"(retries.max_lost={retries.max_lost}); it may be killing the workers it runs on. "
            f"Last: {outcome.error}")
    if outcome.reason.is_infra_fault and counts.infra >= infra_retries:
        return JobState.FAILED, (
            f"the pool failed this job: {counts.infra} faults of its own "
            f"(infra_retries={infra_retries}); last: {outcome.error}")
    if not outcome.reason.counts_against_retries:
        return JobState.QUEUED, outcome.error
    return (JobState.QUEUED if counts.failures <= retries.max else JobState.FAILED), \
        outcome.error


def _outcome_values(job: JobRow, outcome: Outcome, state: JobState, now: datetime,
                    counts: Tally) -> dict[str, Any]:
    values: dict[str, Any] = {
        "lease_owner": None, "lease_expires_at": None, "preempt_requested_at": None}
    if outcome.outputs:
        values["outputs"] = outcome.outputs
    if outcome.progress is not None:
        values.update(progress_done=outcome.progress[0], progress_total=outcome.progress[1])
    if state is JobState.QUEUED:
        retries = RetryPolicy.model_validate(job.spec.get("retries") or {})
        delay_s = _backoff_s(retries, outcome.reason, counts)
        values.update(not_before=now + timedelta(seconds=delay_s),
                      queued_since=now, dispatched_at=None, reason=outcome.reason.value,
                      error=_clean(outcome.error), pending_reason=None, pending_detail=None)
        return values
    values.update(ended_at=now, reason=None if state is JobState.SUCCEEDED else (
        AttemptReason.CANCELLED.value if state is JobState.CANCELLED else outcome.reason.value),
        error=None if state is JobState.SUCCEEDED else _clean(outcome.error))
    if state is JobState.SUCCEEDED:
        values["result"] = outcome.result
    return values


def _backoff_s(retries: RetryPolicy, reason: AttemptReason, counts: Tally) -> float:
    """The wait before the job's next attempt: the retry policy's back-off after the user's
    failures and after the pool's own faults, each by its own count (a fault of the store or
    of an input server gets time to pass); none after a loss, a drain or a preemption."""
    if reason.counts_against_retries:
        return retries.delay_s(counts.failures)
    if reason.is_infra_fault:
        return retries.delay_s(counts.infra)
    return 0.0
