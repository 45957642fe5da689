"""`ArrayStore`: arrays, N jobs submitted as one (sweeps, fan-outs): their submit, status,
progress, cancel, retry and manifest.

Who uses it: the API (the array routes, a fan-out's submit, an array input's check) and the
CLI; the worker reads a manifest through `AttemptStore.array_manifest`. A fan-out returns its
merge job through `JobStore.get_job` on the same engine.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session

from e31.core.errors import NotFound
from e31.core.records import (
    ArrayItem,
    ArrayManifest,
    ArrayRecord,
    JobRecord,
    ManifestItem,
)
from e31.core.sizeclasses import Route
from e31.core.spec import JobSpec
from e31.core.states import AttemptReason, JobState
from e31.store import bulk, deps, tenantlimits, transitions
from e31.store.base import Store
from e31.store.jobs import JobStore
from e31.store.models import Array, Job, Tenant
from e31.store.rows import new_array_id, queued_job

ARRAY_ID = re.compile(r"^a-[0-9a-f]{20}$")


@dataclass(frozen=True)
class RetryRecord:
    """What `retry_array` did: the array as it stands, the items queued again, and the jobs
    that waited on them and were queued again too."""

    array: ArrayRecord
    resubmitted: list[str]
    rearmed: list[str]

    def to_status(self) -> dict[str, Any]:
        return {**self.array.to_status(), "resubmitted": self.resubmitted,
                "rearmed": self.rearmed}


class ArrayStore(Store):
    """Arrays and fan-outs."""

    @cached_property
    def _jobs(self) -> JobStore:
        return JobStore(self._engine)

    def insert_array(self, tenant_id: str, name: str, items: Sequence[tuple[JobSpec, Route]], *,
                     now: datetime, max_queued: int | None = None,
                     deadline_at: datetime | None = None) -> ArrayRecord:
        """Store an array and every item as a queued job: one short write transaction of bulk
        inserts. Every item's dependencies are checked in bulk (`deps.check_after`) and the
        rows prepared for the driver (`bulk.prepare`) before it opens; inside, only what can
        have changed meanwhile is read again (`deps.confirm_after`), so the store's write
        lock is held for the inserts and little else (docs/reliability.md). With `max_queued`,
        refused (`LimitExceeded`) when the items would take the tenant's queued jobs past it;
        `deadline_at` is every item's (a batch's window: the scheduler's order in a band)."""
        array_id = new_array_id()
        after = [spec.after for spec, _ in items]
        fields = [f"items[{i}]." for i in range(len(items))]
        checked = self._check_after(tenant_id, after, fields)
        rows = [{**queued_job(tenant_id, spec, where, now), "array_id": array_id, "array_index": i,
                 "deps_pending": len(wait), "deadline_at": deadline_at}
                for i, ((spec, where), wait) in enumerate(zip(items, checked, strict=True))]
        jobs, links = self._prepare(rows, checked)
        with self._session(write=True) as s:
            if max_queued is not None:
                tenantlimits.hold_queued(s, tenant_id, adding=len(rows), max_queued=max_queued)
            waits = deps.confirm_after(s, tenant_id, after, fields, checked)
            if waits != checked:   # a dependency succeeded meanwhile: fewer to wait for
                for row, wait in zip(rows, waits, strict=True):
                    row["deps_pending"] = len(wait)
                jobs, links = self._prepare(rows, waits)
            s.execute(insert(Array).values(id=array_id, tenant_id=tenant_id, name=name,
                                           size=len(rows), submitted_at=now))
            jobs.run(s)
            links.run(s)
            tenant = s.scalar(select(Tenant.name).where(Tenant.id == tenant_id)) or ""
        queued = JobState.QUEUED.value
        return ArrayRecord(id=array_id, tenant=tenant, name=name, size=len(rows), submitted_at=now,
                           counts={queued: len(rows)} if rows else {},
                           items=[ArrayItem(r["array_index"], r["id"], queued, None) for r in rows])

    def _prepare(self, rows: Sequence[dict[str, Any]],
                 waits: Sequence[Sequence[str]]) -> tuple[bulk.Prepared, bulk.Prepared]:
        """The inserts of new jobs' rows and of their `job_deps` rows, for the driver."""
        return (bulk.prepare(self.engine.dialect, Job, rows),
                deps.links(self.engine.dialect, [(row["id"], wait)
                                                 for row, wait in zip(rows, waits, strict=True)]))

    def array_tenant_id(self, array_id: str) -> str:
        """The id of the tenant whose array `array_id` is (`NotFound` for none)."""
        with self._session() as s:
            found = s.scalar(select(Array.tenant_id).where(Array.id == array_id)) \
                if ARRAY_ID.fullmatch(array_id) else None
            if found is None:
                raise NotFound(f"no array {array_id[:64]!r}")
            return str(found)

    def get_array(self, tenant_id: str, array_id: str, *, items: bool = True) -> ArrayRecord:
        """An array of the tenant: item counts by state, and each item's state when `items`."""
        with self._session() as s:
            return self._array_record(s, self._array(s, tenant_id, array_id), items=items)

    def cancel_array(self, tenant_id: str, array_id: str, *, now: datetime) -> ArrayRecord:
        """Cancel every queued item at once and ask the workers of running ones to stop them;
        final items stay. One transaction; the live rows are locked first, as `request_cancel`
        locks its one row, so no claim or outcome write acts on a stale state."""
        queued, running = JobState.QUEUED.value, JobState.RUNNING.value
        with self._session(write=True) as s:
            array = self._array(s, tenant_id, array_id)
            mine = (Job.array_id == array.id, Job.tenant_id == tenant_id)
            live = s.execute(select(Job.id, Job.state, Job.queued_since)
                             .where(*mine, Job.state.in_([queued, running]))
                             .order_by(Job.id).with_for_update()).all()
            waiting = [(job_id, since) for job_id, state, since in live if state == queued]
            transitions.cancel_queued(s, waiting, now=now, reason=AttemptReason.CANCELLED.value)
            deps.on_final(s, [(job_id, array.id, JobState.CANCELLED.value)
                              for job_id, _ in waiting], now=now)
            if any(state == running for _, state, _ in live):
                s.execute(update(Job).where(*mine, Job.state == running)
                          .values(cancel_requested=True),
                          execution_options={"synchronize_session": False})
            return self._array_record(s, array, items=True)

    def array_manifest(self, tenant_id: str, array_id: str) -> ArrayManifest:
        """Every item's params, state, result, outputs and error, in index order."""
        with self._session() as s:
            array = self._array(s, tenant_id, array_id)
            rows = s.execute(select(Job.array_index, Job.id, Job.state, Job.spec, Job.result,
                                    Job.outputs, Job.reason, Job.error)
                             .where(Job.array_id == array.id, Job.tenant_id == tenant_id)
                             .order_by(Job.array_index)).all()
            items = [ManifestItem(index=i or 0, id=jid, state=state,
                                  params=(spec or {}).get("params", {}), result=result,
                                  outputs=outputs or [], reason=reason, error=error)
                     for i, jid, state, spec, result, outputs, reason, error in rows]
            counts: dict[str, int] = defaultdict(int)
            for item in items:
                counts[item.state] += 1
            return ArrayManifest(array=self._array_record(s, array, counts=dict(counts)),
                                 items=items)

    @staticmethod
    def _array(s: Session, tenant_id: str, array_id: str) -> Array:
        if not ARRAY_ID.fullmatch(array_id):
            raise NotFound(f"no array {array_id[:64]!r}")
        array = s.scalar(select(Array).where(Array.id == array_id, Array.tenant_id == tenant_id))
        if array is None:
            raise NotFound(f"no array {array_id}")
        return array

    @staticmethod
    def _array_record(s: Session, array: Array, *, items: bool = False,
                      counts: dict[str, int] | None = None) -> ArrayRecord:
        """The record of `array`; its counts come from one grouped query unless given."""
        mine = (Job.array_id == array.id, Job.tenant_id == array.tenant_id)
        listed: list[ArrayItem] | None = None
        if items:
            listed = [ArrayItem(index or 0, job_id, state, reason)
                      for index, job_id, state, reason in s.execute(
                          select(Job.array_index, Job.id, Job.state, Job.reason).where(*mine)
                          .order_by(Job.array_index)).tuples()]
            tally: dict[str, int] = defaultdict(int)
            for item in listed:
                tally[item.state] += 1
            counts = dict(tally)
        elif counts is None:
            counts = {state: int(n) for state, n in s.execute(
                select(Job.state, func.count()).where(*mine).group_by(Job.state)).tuples()}
        tenant = s.scalar(select(Tenant.name).where(Tenant.id == array.tenant_id)) or ""
        return ArrayRecord(id=array.id, tenant=tenant, name=array.name, size=array.size,
                           submitted_at=array.submitted_at, counts=counts, items=listed)

    def insert_fanout(self, tenant_id: str, name: str, items: Sequence[tuple[JobSpec, Route]],
                      merge: Callable[[str], tuple[JobSpec, Route]], *, now: datetime,
                      max_queued: int | None = None) -> tuple[ArrayRecord, JobRecord]:
        """Store a fan-out in one write transaction: an array of `items` and the job that
        `merge(array_id)` specifies, which waits for the array (`after: [array_id]`). Nothing
        half-submitted is ever seen: the array and its merge job commit together. With
        `max_queued`, refused (`LimitExceeded`) as `insert_array` is."""
        array_id = new_array_id()
        spec, where = merge(array_id)
        rows = [{**queued_job(tenant_id, item, route, now), "array_id": array_id,
                 "array_index": i} for i, (item, route) in enumerate(items)]
        last = {**queued_job(tenant_id, spec, where, now), "deps_pending": 1,
                "array_id": None, "array_index": None}
        jobs = bulk.prepare(self.engine.dialect, Job, [*rows, last])
        with self._session(write=True) as s:
            if max_queued is not None:
                tenantlimits.hold_queued(s, tenant_id, adding=len(rows) + 1, max_queued=max_queued)
            s.execute(insert(Array).values(id=array_id, tenant_id=tenant_id, name=name,
                                           size=len(rows), submitted_at=now))
            jobs.run(s)
            deps.links(self.engine.dialect, [(last["id"], [array_id])]).run(s)
            tenant = s.scalar(select(Tenant.name).where(Tenant.id == tenant_id)) or ""
        queued = JobState.QUEUED.value
        array = ArrayRecord(id=array_id, tenant=tenant, name=name, size=len(rows),
                            submitted_at=now, counts={queued: len(rows)},
                            items=[ArrayItem(r["array_index"], r["id"], queued, None)
                                   for r in rows])
        return array, self._jobs.get_job(tenant_id, last["id"])

    def array_progress(self, tenant_id: str, array_id: str) -> float:
        """The progress its items reported, summed: a succeeded item's whole total, a live
        one's done so far (a fan-out's chunks report frames). 0 for no array of the tenant."""
        succeeded = JobState.SUCCEEDED.value
        with self._session() as s:
            rows = s.execute(select(Job.state, func.sum(Job.progress_done),
                                    func.sum(Job.progress_total))
                             .where(Job.array_id == array_id, Job.tenant_id == tenant_id)
                             .group_by(Job.state)).tuples().all()
        return float(sum((total if state == succeeded else done) or 0
                         for state, done, total in rows))

    def retry_array(self, tenant_id: str, array_id: str, *, now: datetime) -> RetryRecord:
        """Queue again the array's failed and cancelled items, the same jobs as their next
        attempt (the manifest stays one object keyed by item), and the jobs that were
        cancelled because one of them failed (`deps.rearm`): a merge job waiting on the array
        runs once they succeed. One transaction, the items' rows locked first."""
        bad = [JobState.FAILED.value, JobState.CANCELLED.value]
        with self._session(write=True) as s:
            array = self._array(s, tenant_id, array_id)
            s.execute(select(Array.id).where(Array.id == array.id).with_for_update())
            ended = s.execute(select(Job.id, Job.state, Job.ended_at)
                              .where(Job.array_id == array.id, Job.tenant_id == tenant_id,
                                     Job.state.in_(bad))
                              .order_by(Job.id).with_for_update()).all()
            items = transitions.resubmit(s, [(job_id, state) for job_id, state, _ in ended],
                                         now=now)
            rearmed: list[str] = []
            if items:
                since = min(at for _, _, at in ended if at is not None)
                rearmed = deps.rearm(s, tenant_id, [array.id, *items], since=since, now=now)
            return RetryRecord(array=self._array_record(s, array, items=True),
                               resubmitted=items, rearmed=rearmed)
