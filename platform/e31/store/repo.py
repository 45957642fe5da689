"""`Repo`: every query of E31 Batch, including the atomic claim and the fenced outcome write.

Reads and writes are short transactions. On SQLite a write transaction starts with
`BEGIN IMMEDIATE` (see `db.py`), so concurrent writers wait instead of failing.
Every job query a tenant can reach is scoped by `tenant_id`.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Engine, func, or_, select, update
from sqlalchemy.exc import IntegrityError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session

from e31.core.errors import NotFound, StoreError, StoreUnavailable
from e31.core.records import (
    AttemptRecord,
    Claim,
    JobRecord,
    Outcome,
    Renewal,
    UsageRow,
)
from e31.core.retries import RetryPolicy
from e31.core.sizeclasses import OomRule, Route
from e31.core.spec import JobSpec
from e31.core.states import AttemptReason, JobState
from e31.store import deps, tenants, transitions
from e31.store.arrays import ArrayQueries
from e31.store.attempts import AttemptQueries
from e31.store.db import WRITE_OPTION
from e31.store.drains import DrainQueries
from e31.store.limits import hold_queued
from e31.store.models import Attempt, Job, Tenant
from e31.store.pool import PoolQueries
from e31.store.quotas import QuotaQueries
from e31.store.rows import queued_job, seconds
from e31.store.scheduling import SchedulerQueries
from e31.store.secrets import SecretQueries
from e31.store.tenancy import TenancyQueries
from e31.store.tokens import TOKEN_PREFIX, hash_token

__all__ = ["TOKEN_PREFIX", "Repo", "hash_token"]

JOB_ID = re.compile(r"^j-[0-9a-f]{20}$")
ERROR_MAX_CHARS = 16_384   # an attempt's error text; the whole story is in the log
COUNTED_REASONS = [r.value for r in AttemptReason if r.counts_against_retries]
EXPIRE_BATCH = 100         # most expired leases recovered per call (the next tick does the rest)


class Repo(ArrayQueries, AttemptQueries, DrainQueries, PoolQueries, QuotaQueries,
           SchedulerQueries, TenancyQueries, SecretQueries):
    """All database access, over one engine. `half_life_s` decays tenants' usage when an
    attempt's bill is added: `fair_share_half_life_s`, the same in every process, so it has
    no default here (`e31.edge.wiring.repo` builds a Repo from settings)."""

    def __init__(self, engine: Engine, *, half_life_s: float) -> None:
        self._engine = engine
        self._half_life_s = half_life_s

    @property
    def engine(self) -> Engine:
        return self._engine

    @contextmanager
    def _session(self, *, write: bool = False) -> Iterator[Session]:
        try:
            with Session(self._engine, expire_on_commit=False) as s, s.begin():
                s.connection(execution_options={WRITE_OPTION: write})
                yield s
        except OperationalError as exc:
            raise StoreUnavailable(f"results store unavailable: {exc.orig}") from exc
        except IntegrityError:
            raise
        except SQLAlchemyError as exc:
            raise StoreError(f"results store error: {type(exc).__name__}: {exc}") from exc

    # -- submit, read, cancel -------------------------------------------------------------

    def insert_job(self, tenant_id: str, spec: JobSpec, route: Route, *,
                   now: datetime, max_queued: int | None = None) -> JobRecord:
        """Store a queued job; its `after` dependencies must be the tenant's and not failed
        (`SpecError` naming `after[i]` otherwise), checked before the write transaction opens
        as an array's are (`insert_array`). With `max_queued`, refused (`LimitExceeded`) when
        the tenant holds that many queued jobs, counted in the same transaction."""
        checked = self._check_after(tenant_id, [spec.after], [""])
        with self._session(write=True) as s:
            if max_queued is not None:
                hold_queued(s, tenant_id, adding=1, max_queued=max_queued)
            [waits] = deps.confirm_after(s, tenant_id, [spec.after], [""], checked)
            job = Job(**{**queued_job(tenant_id, spec, route, now), "deps_pending": len(waits)})
            s.add(job)
            s.flush()
            deps.links(self._engine.dialect, [(job.id, waits)]).run(s)
            return self._record(s, job)

    def get_job(self, tenant_id: str | None, job_id: str) -> JobRecord:
        """A job of the tenant (any tenant when `tenant_id` is None: workers, operators)."""
        with self._session() as s:
            job = self._job(s, tenant_id, job_id)
            return self._record(s, job, with_attempts=True)

    def job_state(self, tenant_id: str, job_id: str) -> str:
        """A job's state alone, by key (the API's long poll reads it while it waits); NotFound
        for a job that is not the tenant's."""
        if not JOB_ID.fullmatch(job_id):
            raise NotFound(f"no job {job_id[:64]!r}")
        with self._session() as s:
            state = s.scalar(select(Job.state).where(Job.id == job_id, Job.tenant_id == tenant_id))
        if state is None:
            raise NotFound(f"no job {job_id}")
        return str(state)

    def list_jobs(self, tenant_id: str, *, state: str | None = None,
                  limit: int = 100) -> list[JobRecord]:
        with self._session() as s:
            q = select(Job).where(Job.tenant_id == tenant_id)
            if state:
                q = q.where(Job.state == state)
            jobs = s.scalars(q.order_by(Job.submitted_at.desc()).limit(limit)).all()
            names = self._tenant_names(s)
            return [_job_record(j, names[j.tenant_id]) for j in jobs]

    def request_cancel(self, tenant_id: str, job_id: str, *, now: datetime) -> JobRecord:
        """Cancel a queued job at once; ask a running job's worker to kill it. Final jobs stay."""
        with self._session(write=True) as s:
            # The row lock serialises this with a concurrent claim or outcome write (PostgreSQL;
            # SQLite's BEGIN IMMEDIATE already does): neither can act on a stale state.
            job = self._job(s, tenant_id, job_id, lock=True)
            if job.state == JobState.QUEUED.value:
                transitions.cancel_queued(s, [(job.id, job.queued_since)], now=now,
                                          reason=AttemptReason.CANCELLED.value)
                deps.on_final(s, [(job.id, job.array_id, JobState.CANCELLED.value)], now=now)
                s.refresh(job)
            elif job.state == JobState.RUNNING.value:
                job.cancel_requested = True
                s.flush()
            return self._record(s, job, with_attempts=True)

    # -- worker: claim, renew, record ------------------------------------------------------

    def claim(self, job_id: str, *, dispatch_token: str, worker: str, gpus: str, gpu_count: int,
              now: datetime, lease_ttl_s: float) -> Claim | None:
        """Atomically move a runnable queued job to running, for the message that carries the
        job's current dispatch token; None if it is not claimable. The claim clears the token:
        the same message delivered again, or replayed, claims nothing."""
        with self._session(write=True) as s:
            row = s.execute(transitions.move(job_id, JobState.QUEUED, JobState.RUNNING).where(
                holds_dispatch(dispatch_token), Job.cancel_requested.is_(False),
                or_(Job.not_before.is_(None), Job.not_before <= now))
                .values(lease_owner=worker,
                        lease_token=Job.lease_token + 1,
                        lease_expires_at=now + timedelta(seconds=lease_ttl_s),
                        attempts_used=Job.attempts_used + 1,
                        started_at=func.coalesce(Job.started_at, now),
                        dispatched_at=None, dispatch_token=None, dispatch_host=None,
                        dispatch_gpus=None, progress_done=None, progress_total=None)
                .returning(Job.lease_token, Job.attempts_used, Job.queued_since, Job.spec,
                           Job.tenant_id, Job.gpus)).first()
            if row is None:
                return None
            token, attempt, queued_since, spec, tenant_id, job_gpus = row
            s.execute(update(Job).where(Job.id == job_id).values(
                queued_seconds=Job.queued_seconds + seconds(queued_since, now), queued_since=None))
            s.add(Attempt(job_id=job_id, n=attempt, worker=worker, gpus=gpus, gpu_count=gpu_count,
                          started_at=now))
        # Validated after the commit: params of up to a megabyte are not checked while the
        # write transaction holds the store. It was validated on submit, so it passes again.
        return Claim(job_id=job_id, tenant_id=tenant_id, token=token, attempt=attempt,
                     spec=JobSpec.parse(spec, stored=True), gpus=job_gpus)

    def renew(self, job_id: str, token: int, *, now: datetime, lease_ttl_s: float,
              progress: tuple[float, float] | None = None) -> Renewal:
        """Extend the lease; says whether it is still ours and whether the job's owner
        cancelled it or the scheduler asked to preempt it."""
        values: dict[str, Any] = {"lease_expires_at": now + timedelta(seconds=lease_ttl_s)}
        if progress is not None:
            values.update(progress_done=progress[0], progress_total=progress[1])
        with self._session(write=True) as s:
            row = s.execute(update(Job).where(
                Job.id == job_id, Job.lease_token == token, Job.state == JobState.RUNNING.value)
                .values(**values).returning(Job.cancel_requested, Job.preempt_requested_at)
            ).first()
            if row is None:
                return Renewal(False, False, False)
            return Renewal(True, bool(row[0]), row[1] is not None)

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

    def record_outcome(self, job_id: str, token: int, outcome: Outcome, *,
                       now: datetime, oom: OomRule | None = None) -> JobState | None:
        """Write an attempt's outcome if `token` still holds the lease; None when fenced off.
        `oom`: the pool's rule for an attempt that ran out of memory (the next size class);
        None: such an attempt is retried in its own class like any failure."""
        with self._session(write=True) as s:
            job = s.scalar(select(Job).where(Job.id == job_id).with_for_update())
            if job is None or job.state != JobState.RUNNING.value or job.lease_token != token:
                return None
            return self._end_attempt(s, job, outcome, ended_at=now, now=now, oom=oom)

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
            done = []
            for job in jobs:
                assert job.lease_expires_at is not None
                renewed = job.lease_expires_at - timedelta(seconds=lease_ttl_s)
                outcome = Outcome(AttemptReason.LOST, error=(
                    f"lease of worker {job.lease_owner} expired at "
                    f"{job.lease_expires_at.isoformat()}: the worker or its node died or was "
                    "cut off"))
                state = self._end_attempt(s, job, outcome, ended_at=renewed, now=now)
                if state is not None:
                    done.append((job.id, state))
            return done

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

    def _end_attempt(self, s: Session, job: Job, outcome: Outcome, *, ended_at: datetime,
                     now: datetime, oom: OomRule | None = None) -> JobState | None:
        """End the running attempt of a row-locked `job` with `outcome`, bill it (the job and its
        tenant's decayed usage), move the job on, and settle what waited for it. An `oom`
        attempt that `oom` sends to a bigger class queues the job there at once, noted on the
        attempt (`moved_to`) and not counted against its retries (docs/scheduling.md)."""
        token = job.lease_token
        attempt = s.scalar(select(Attempt).where(Attempt.job_id == job.id,
                                                 Attempt.n == job.attempts_used))
        duration = bill_s = 0.0
        if attempt is not None:
            ended_at = max(ended_at, attempt.started_at)
            attempt.ended_at, attempt.reason = ended_at, outcome.reason.value
            attempt.error, attempt.exit_code = _clean(outcome.error), outcome.exit_code
            # Run time from the end of its setup, which its worker noted (`setup_s`): fetching
            # code, building the environment and staging inputs is never billed.
            duration = max(0.0, seconds(attempt.started_at, ended_at) - (attempt.setup_s or 0.0))
            bill_s = duration * attempt.gpu_count
            job.gpu_seconds += bill_s
        job.run_seconds += duration
        move = None
        if outcome.reason is AttemptReason.OOM and oom is not None and attempt is not None \
                and not job.cancel_requested:
            move = oom.target((job.spec.get("resources") or {}).get("on_oom"), job.size_class,
                              job.gpus)
            attempt.moved_to = move.size_class if move else None
        s.flush()
        # The tally of earlier endings decides only whether a retryable ending is retried: a
        # success, a cancel or a final error skips it (one statement less per outcome).
        tally: dict[str | None, int] = {}
        # Attempts that moved the job to a bigger class are not failures of it.
        if outcome.reason.is_retryable and not job.cancel_requested and move is None:
            tally = dict(s.execute(select(Attempt.reason, func.count()).where(
                Attempt.job_id == job.id, Attempt.moved_to.is_(None))
                .group_by(Attempt.reason)).tuples().all())
        failures = sum(n for reason, n in tally.items() if reason in COUNTED_REASONS)
        lost = tally.get(AttemptReason.LOST.value, 0)
        state, error = _next_state(job, outcome, failures, lost)
        if move is not None:
            state, error = JobState.QUEUED, f"oom: moved to {move.size_class}: {outcome.error}"
        values = _outcome_values(job, dataclasses.replace(outcome, error=error), state, now,
                                 failures)
        if move is not None:    # its next attempt, in the bigger class, may start at once
            values.update(size_class=move.size_class, queue=move.queue, not_before=now)
        res = s.execute(transitions.move(job.id, JobState.RUNNING, state)
                        .where(Job.lease_token == token).values(**values))
        if not res.rowcount:  # type: ignore[attr-defined]
            return None
        if state.is_final:
            deps.on_final(s, [(job.id, job.array_id, state.value)], now=now)
        tenants.bill(s, job.tenant_id, bill_s, now=now, half_life_s=self._half_life_s)
        return state

    # -- usage ---------------------------------------------------------------------------

    def usage(self, tenant_id: str | None, *, now: datetime) -> list[UsageRow]:
        """Per tenant and size class: jobs by state, billed GPU-seconds, run and queued time."""
        with self._session() as s:
            q = select(Tenant.name, Job.size_class, Job.state, func.count(),
                       func.sum(Job.gpu_seconds), func.sum(Job.run_seconds),
                       func.sum(Job.queued_seconds)).join(Tenant, Tenant.id == Job.tenant_id)
            waiting = select(Tenant.name, Job.size_class, Job.queued_since).join(
                Tenant, Tenant.id == Job.tenant_id).where(Job.queued_since.is_not(None))
            if tenant_id is not None:
                q = q.where(Job.tenant_id == tenant_id)
                waiting = waiting.where(Job.tenant_id == tenant_id)
            acc: dict[tuple[str, str], dict[str, Any]] = defaultdict(
                lambda: {"jobs": {}, "gpu": 0.0, "run": 0.0, "queued": 0.0})
            for tenant, cls, state, n, gpu, run, queued in s.execute(
                    q.group_by(Tenant.name, Job.size_class, Job.state)):
                a = acc[(tenant, cls)]
                a["jobs"][state] = int(n)
                a["gpu"] += gpu or 0.0
                a["run"] += run or 0.0
                a["queued"] += queued or 0.0
            for tenant, cls, since in s.execute(waiting):  # time waiting right now counts too
                acc[(tenant, cls)]["queued"] += seconds(since, now)
            return [UsageRow(t, c, a["jobs"], a["gpu"], a["run"], a["queued"])
                    for (t, c), a in sorted(acc.items())]

    # -- helpers -------------------------------------------------------------------------

    @staticmethod
    def _job(s: Session, tenant_id: str | None, job_id: str, *, lock: bool = False) -> Job:
        if not JOB_ID.fullmatch(job_id):
            raise NotFound(f"no job {job_id[:64]!r}")
        q = select(Job).where(Job.id == job_id)
        if tenant_id is not None:
            q = q.where(Job.tenant_id == tenant_id)
        job = s.scalar(q.with_for_update() if lock else q)
        if job is None:
            raise NotFound(f"no job {job_id}")
        return job

    @staticmethod
    def _tenant_names(s: Session) -> dict[str, str]:
        return dict(s.execute(select(Tenant.id, Tenant.name)).tuples().all())

    def _record(self, s: Session, job: Job, *, with_attempts: bool = False) -> JobRecord:
        tenant = s.scalar(select(Tenant.name).where(Tenant.id == job.tenant_id)) or ""
        attempts: list[AttemptRecord] = []
        if with_attempts:
            attempts = [AttemptRecord(a.n, a.worker, a.gpus, a.gpu_count, a.started_at, a.ended_at,
                                      a.reason, a.error, a.exit_code, a.isolation, a.start,
                                      a.start_ms, a.setup_s, a.gpu_mem_peak_gb, a.gpu_util_mean,
                                      a.idle_since, a.moved_to, a.limits)
                        for a in s.scalars(select(Attempt).where(Attempt.job_id == job.id)
                                           .order_by(Attempt.n))]
        return _job_record(job, tenant, attempts)


def holds_dispatch(dispatch_token: str) -> ColumnElement[bool]:
    """The condition that a message's token is its job's current dispatch token: the one
    check that lets a message claim a job or hand its publication back (docs/security.md,
    "The broker is not a trust boundary")."""
    return Job.dispatch_token == dispatch_token


def _job_record(j: Job, tenant: str, attempts: list[AttemptRecord] | None = None) -> JobRecord:
    return JobRecord(
        id=j.id, tenant=tenant, name=j.name, spec=j.spec, state=j.state, size_class=j.size_class,
        queue=j.queue, gpus=j.gpus, priority=j.priority, reason=j.reason, error=j.error,
        result=j.result, submitted_at=j.submitted_at, started_at=j.started_at, ended_at=j.ended_at,
        not_before=j.not_before, gpu_seconds=j.gpu_seconds, run_seconds=j.run_seconds,
        queued_seconds=j.queued_seconds, progress_done=j.progress_done,
        progress_total=j.progress_total, outputs=j.outputs or [], attempts=attempts or [],
        array_id=j.array_id, array_index=j.array_index, queued_since=j.queued_since)


def _clean(text: str | None) -> str | None:
    """Error text as every backend stores it: no NUL (PostgreSQL refuses it), bounded."""
    if text is None:
        return None
    text = text.replace("\x00", "\\0")
    return text if len(text) <= ERROR_MAX_CHARS else text[:ERROR_MAX_CHARS] + " [cut]"


def _next_state(job: Job, outcome: Outcome, failures: int,
                lost: int) -> tuple[JobState, str | None]:
    """The job's next state and its error text.

    `failures`: attempts so far, this one included, that count against `retries.max`;
    `lost`: attempts lost with their worker, capped separately by `retries.max_lost`.
    """
    if outcome.reason is AttemptReason.SUCCEEDED:
        return JobState.SUCCEEDED, None
    if outcome.reason is AttemptReason.CANCELLED or job.cancel_requested:
        return JobState.CANCELLED, outcome.error
    if not outcome.reason.is_retryable:
        return JobState.FAILED, outcome.error
    retries = RetryPolicy.model_validate(job.spec.get("retries") or {})
    if outcome.reason is AttemptReason.LOST and lost >= retries.max_lost:
        return JobState.FAILED, (
            f"poison job: lost its worker {lost} times (retries.max_lost={retries.max_lost}); "
            f"it may be killing the workers it runs on. Last: {outcome.error}")
    if not outcome.reason.counts_against_retries:
        return JobState.QUEUED, outcome.error
    return (JobState.QUEUED if failures <= retries.max else JobState.FAILED), outcome.error


def _outcome_values(job: Job, outcome: Outcome, state: JobState, now: datetime,
                    failures: int) -> dict[str, Any]:
    values: dict[str, Any] = {
        "gpu_seconds": job.gpu_seconds, "run_seconds": job.run_seconds,
        "lease_owner": None, "lease_expires_at": None, "preempt_requested_at": None}
    if outcome.outputs:
        values["outputs"] = outcome.outputs
    if state is JobState.QUEUED:
        retries = RetryPolicy.model_validate(job.spec.get("retries") or {})
        delay_s = retries.delay_s(failures) if outcome.reason.counts_against_retries else 0.0
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


