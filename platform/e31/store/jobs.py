"""`JobStore`: a job's submit, reads, cancel, usage and the retention of what it left behind.

Who uses it: the API (submit, status, list, long poll, cancel, usage), the CLI on the store,
and `e31 gc` (`ended_jobs`, `mark_artifacts_removed`). Every query a tenant can reach is
scoped by `tenant_id`. `find_job`, a job's row by id within a transaction, is the statement
other stores use inside their own (the scheduler's explanation of a queued job).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import Row, Select, bindparam, func, insert, or_, select, update
from sqlalchemy.orm import Session

from e31.core.errors import NotFound
from e31.core.records import AttemptRecord, JobRecord, UsageRow
from e31.core.sizeclasses import Route
from e31.core.spec import JobSpec
from e31.core.states import AttemptReason, JobState
from e31.store import deps, quotas, transitions
from e31.store.base import Store
from e31.store.models import ATTEMPTS, JOBS, Attempt, Job, Tenant
from e31.store.rows import queued_job, seconds
from e31.store.tenantlimits import hold_queued

S = TypeVar("S", bound=Select[*tuple[Any, ...]])   # a select of any columns

JOB_ID = re.compile(r"^j-[0-9a-f]{20}$")
# get_job's reads, built once and run as Core (issue 31): the job's columns with its tenant's
# name, any tenant's or the one bound; then its attempts' columns, in order
_NAMED_JOB = (select(*JOBS.c, Tenant.name.label("tenant_name"))
              .join(Tenant, Tenant.id == Job.tenant_id).where(Job.id == bindparam("job_id")))
# An admin's read of whose job it is, and the long poll's of a job's state (built once)
_JOB_TENANT = select(Job.tenant_id).where(Job.id == bindparam("job_id"))
_JOB_STATE = select(Job.state).where(Job.id == bindparam("job_id"),
                                     Job.tenant_id == bindparam("tenant_id"))
_TENANT_NAME = select(Tenant.name).where(Tenant.id == bindparam("tenant_id"))
_INSERT_JOB = insert(JOBS)   # a submit's row (`rows.queued_job`)
_TENANTS_NAMED_JOB = _NAMED_JOB.where(Job.tenant_id == bindparam("tenant_id"))
_ATTEMPTS_OF = (select(*ATTEMPTS.c)
                .where(Attempt.job_id == bindparam("job_id")).order_by(Attempt.n))


@dataclass(frozen=True)
class EndedJob:
    """A job that ended and whose artifacts are still kept."""

    id: str
    tenant_id: str
    ended_at: datetime


class JobStore(Store):
    """Jobs: submit, read, cancel, usage, retention."""

    # -- submit, read, cancel -------------------------------------------------------------

    def insert_job(self, tenant_id: str, spec: JobSpec, route: Route, *,
                   now: datetime, max_queued: int | None = None) -> JobRecord:
        """Store a queued job; its `after` dependencies must be the tenant's and not failed
        (`SpecError` naming `after[i]` otherwise), checked before the write transaction opens
        as an array's are (`insert_array`). With `max_queued`, refused (`LimitExceeded`) when
        the tenant holds that many queued jobs, counted in the same transaction."""
        checked = self._check_after(tenant_id, [spec.after], [""])
        with self._core(write=True) as c:
            tenant = c.scalar(_TENANT_NAME, {"tenant_id": tenant_id}) if max_queued is None \
                else hold_queued(c, tenant_id, adding=1, max_queued=max_queued)
            [waits] = deps.confirm_after(c, tenant_id, [spec.after], [""], checked)
            row = {**queued_job(tenant_id, spec, route, now), "deps_pending": len(waits)}
            c.execute(_INSERT_JOB, row)   # Core: no unit of work for one row
            deps.links(self._engine.dialect, [(row["id"], waits)]).run(c)
        return _to_record(Job(**row), tenant or "")   # a transient model of the row

    def get_job(self, tenant_id: str | None, job_id: str) -> JobRecord:
        """A job of the tenant (any tenant when `tenant_id` is None: workers, operators)."""
        _check_id(job_id)
        with self._core() as c:
            row = c.execute(_NAMED_JOB if tenant_id is None else _TENANTS_NAMED_JOB,
                            {"job_id": job_id, "tenant_id": tenant_id}).first()
            if row is None:
                raise NotFound(f"no job {job_id}")
            attempts = [_attempt_record(a) for a in c.execute(_ATTEMPTS_OF, {"job_id": job_id})]
        return _to_record(row, row.tenant_name, attempts)

    def job_tenant_id(self, job_id: str) -> str:
        """The id of the tenant whose job `job_id` is (`NotFound` for none): one column read
        (an admin's every read of a job asks it first)."""
        _check_id(job_id)
        with self._core() as c:
            tenant_id = c.scalar(_JOB_TENANT, {"job_id": job_id})
        if tenant_id is None:
            raise NotFound(f"no job {job_id}")
        return str(tenant_id)

    def job_state(self, tenant_id: str, job_id: str) -> str:
        """A job's state alone, by key (the API's long poll reads it while it waits); NotFound
        for a job that is not the tenant's."""
        _check_id(job_id)
        with self._core() as c:
            state = c.scalar(_JOB_STATE, {"job_id": job_id, "tenant_id": tenant_id})
        if state is None:
            raise NotFound(f"no job {job_id}")
        return str(state)

    def list_jobs(self, tenant_id: str | None, *, state: str | None = None, limit: int = 100,
                  name: str | None = None, size_class: str | None = None,
                  array_id: str | None = None, before: str | None = None) -> list[JobRecord]:
        """The tenant's jobs, newest first (the index on tenant and submit time), of a state,
        a size class or an array, whose name contains `name`; `before`: only those listed
        after that job of the tenant (the next page; an unknown id lists nothing).
        `tenant_id` None: every tenant's (an admin's view; the index on submit time)."""
        mine = [] if tenant_id is None else [Job.tenant_id == tenant_id]
        with self._session() as s:
            q = select(Job).where(*mine)
            if state:
                q = q.where(Job.state == state)
            if name:
                q = q.where(Job.name.contains(name, autoescape=True))
            if size_class:
                q = q.where(Job.size_class == size_class)
            if array_id:
                q = q.where(Job.array_id == array_id)
            if before:
                last = s.execute(select(Job.submitted_at, Job.id).where(
                    *mine, Job.id == before)).first()
                if last is None:
                    return []
                # the range on the index's column alone, then the tie on the same instant
                q = q.where(Job.submitted_at <= last[0],
                            or_(Job.submitted_at < last[0], Job.id < last[1]))
            jobs = s.scalars(q.order_by(Job.submitted_at.desc(), Job.id.desc())
                             .limit(limit)).all()
            names = _tenant_names(s)
            return [_to_record(j, names[j.tenant_id]) for j in jobs]

    def request_cancel(self, tenant_id: str, job_id: str, *, now: datetime) -> JobRecord:
        """Cancel a queued job at once; ask a running job's worker to kill it. Final jobs stay."""
        with self._session(write=True) as s:
            # The row lock serialises this with a concurrent claim or outcome write (PostgreSQL;
            # SQLite's BEGIN IMMEDIATE already does): neither can act on a stale state.
            job = find_job(s, tenant_id, job_id, lock=True)
            if job.state == JobState.QUEUED.value:
                transitions.cancel_queued(s, [(job.id, job.queued_since)], now=now,
                                          reason=AttemptReason.CANCELLED.value)
                deps.on_final(s, [(job.id, job.array_id, JobState.CANCELLED.value)], now=now)
                s.refresh(job)
            elif job.state == JobState.RUNNING.value:
                job.cancel_requested = True
                s.flush()
            return _job_record(s, job, with_attempts=True)

    # -- usage ---------------------------------------------------------------------------

    def usage_by_day(self, tenant_id: str | None, *, since: datetime) -> list[dict[str, Any]]:
        """Per UTC day, tenant and size class, of the jobs that ended since `since` (the index
        on the end time): jobs, GPU-seconds and queued seconds; oldest day first."""
        with self._session() as s:
            ended: Any = Job.ended_at if s.get_bind().dialect.name == "sqlite" \
                else func.timezone("UTC", Job.ended_at)
            day = func.date(ended)
            q = select(day, Tenant.name, Job.size_class, func.count(), func.sum(Job.gpu_seconds),
                       func.sum(Job.queued_seconds)).join(Tenant, Tenant.id == Job.tenant_id) \
                .where(Job.ended_at >= since)
            if tenant_id is not None:
                q = q.where(Job.tenant_id == tenant_id)
            rows = s.execute(q.group_by(day, Tenant.name, Job.size_class)
                             .order_by(day, Tenant.name, Job.size_class))
            return [{"day": str(d), "tenant": t, "size_class": c, "jobs": int(n),
                     "gpu_seconds": round(gpu or 0.0, 3),
                     "queued_seconds": round(waited or 0.0, 3)}
                    for d, t, c, n, gpu, waited in rows]

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

    # -- retention (`e31 gc`) ------------------------------------------------------------

    def ended_jobs(self, *, ended_before: datetime, after_id: str = "",
                   limit: int) -> list[EndedJob]:
        """Up to `limit` jobs that ended before `ended_before` and whose artifacts are kept,
        by id after `after_id` (a page of `e31 gc`)."""
        with self._session() as s:
            rows = s.execute(select(Job.id, Job.tenant_id, Job.ended_at)
                             .where(Job.ended_at < ended_before,
                                    Job.artifacts_removed_at.is_(None), Job.id > after_id)
                             .order_by(Job.id).limit(limit)).all()
            return [EndedJob(job_id, tenant_id, ended_at) for job_id, tenant_id, ended_at in rows
                    if ended_at is not None]

    def mark_artifacts_removed(self, job_id: str, *, now: datetime,
                               freed_outputs_bytes: int) -> None:
        """Record that `e31 gc` removed the job's artifacts: its outputs list is emptied and
        the bytes its outputs took are given back to its tenant's total."""
        with self._session(write=True) as s:
            tenant_id = s.scalar(update(Job).where(Job.id == job_id)
                                 .values(artifacts_removed_at=now, outputs=None)
                                 .returning(Job.tenant_id))
            if tenant_id is not None:
                quotas.refund(s, tenant_id, freed_outputs_bytes)


# -- statements on a session a store opens -------------------------------------------------

def find_job(s: Session, tenant_id: str | None, job_id: str, *, lock: bool = False) -> Job:
    """The row of a job of the tenant (any tenant's when `tenant_id` is None), row-locked if
    asked; NotFound for a malformed id or a job that is not the tenant's."""
    q = _owned(select(Job), tenant_id, job_id)
    job = s.scalar(q.with_for_update() if lock else q)
    if job is None:
        raise NotFound(f"no job {job_id}")
    return job


def _check_id(job_id: str) -> None:
    """NotFound at once for a malformed job id: nothing is read for it."""
    if not JOB_ID.fullmatch(job_id):
        raise NotFound(f"no job {job_id[:64]!r}")


def _owned(q: S, tenant_id: str | None, job_id: str) -> S:
    """`q` narrowed to the job `job_id` of the tenant (any tenant's when `tenant_id` is None);
    NotFound at once for a malformed id."""
    _check_id(job_id)
    q = q.where(Job.id == job_id)
    return q if tenant_id is None else q.where(Job.tenant_id == tenant_id)


def _tenant_names(s: Session) -> dict[str, str]:
    """Tenant id -> name, of every tenant."""
    return dict(s.execute(select(Tenant.id, Tenant.name)).tuples().all())


def _job_record(s: Session, job: Job, *, with_attempts: bool = False,
                tenant: str | None = None) -> JobRecord:
    """The record of `job`, with its tenant's name (`tenant`, else read) and, if asked, its
    attempts in order."""
    if tenant is None:
        tenant = s.scalar(select(Tenant.name).where(Tenant.id == job.tenant_id)) or ""
    attempts: list[AttemptRecord] = []
    if with_attempts:
        attempts = [_attempt_record(a) for a in s.scalars(
            select(Attempt).where(Attempt.job_id == job.id).order_by(Attempt.n))]
    return _to_record(job, tenant, attempts)


def _attempt_record(a: Attempt | Row[*tuple[Any, ...]]) -> AttemptRecord:
    """An attempt's record, from its model or a row of its columns."""
    return AttemptRecord(a.n, a.worker, a.gpus, a.gpu_count, a.started_at, a.ended_at,
                         a.reason, a.error, a.exit_code, a.isolation, a.start, a.start_ms,
                         a.setup_s, a.gpu_mem_peak_gb, a.gpu_util_mean, a.idle_since,
                         a.moved_to, a.limits)


def _to_record(j: Job | Row[*tuple[Any, ...]], tenant: str,
               attempts: list[AttemptRecord] | None = None) -> JobRecord:
    """A job's record, from its model or a row of its columns."""
    return JobRecord(
        id=j.id, tenant=tenant, name=j.name, spec=j.spec, state=j.state, size_class=j.size_class,
        queue=j.queue, gpus=j.gpus, priority=j.priority, reason=j.reason, error=j.error,
        result=j.result, submitted_at=j.submitted_at, started_at=j.started_at, ended_at=j.ended_at,
        not_before=j.not_before, gpu_seconds=j.gpu_seconds, run_seconds=j.run_seconds,
        queued_seconds=j.queued_seconds, progress_done=j.progress_done,
        progress_total=j.progress_total, outputs=j.outputs or [], attempts=attempts or [],
        array_id=j.array_id, array_index=j.array_index, queued_since=j.queued_since,
        artifacts_removed_at=j.artifacts_removed_at)
