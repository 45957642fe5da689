"""The jobs of a tenant: submit (and its dry run), read, list, cancel, logs and outputs; the
routes are `e31.api.routes.jobs`. Every call is scoped by the caller's tenant.

`submit` is the pipeline of `e31.api.services.submission`, its steps called in their order:
limits → bundles → secrets → placement → insert; `dry_run` takes the same steps without the
insert. A footage `source` fans out into an array and a merge job (`FanoutService`).
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
import logging
from collections.abc import Iterator
from typing import IO, Any

from starlette.concurrency import run_in_threadpool

from e31.api.services.fanout import FanoutService
from e31.api.services.readings import PoolReadings
from e31.api.services.submission import Submission
from e31.api.waits import JobEnds
from e31.core.clock import utcnow
from e31.core.errors import Forbidden, NotFound
from e31.core.records import JobRecord, QueuePosition, TenantRecord, iso
from e31.core.sizeclasses import Route
from e31.core.spec import JobSpec
from e31.core.states import FINAL_STATES
from e31.core.tenantlimits import TenantLimits
from e31.edge.artifacts import ArtifactStore
from e31.edge.settings import Settings
from e31.ops import gpuseries
from e31.ops.fanout import MERGE_ENTRYPOINT, is_fanout
from e31.ops.heartbeat import WorkerInfo
from e31.scheduling import explain, placement
from e31.scheduling.fairshare import Reason
from e31.store import Repo

log = logging.getLogger(__name__)

LIST_LIMIT_MAX = 1000


@dataclasses.dataclass(frozen=True)
class LogChunk:
    """One bounded piece of a job's logs: the bytes it streams, where the next piece starts,
    and how big the logs were when it was cut (docs/jobs.md, "Results, logs, outputs")."""

    size_bytes: int
    next_offset: int
    body: Iterator[bytes]


class JobService:
    """The jobs of each tenant, over one store, artifact store and view of the pool."""

    def __init__(self, *, settings: Settings, repo: Repo, artifacts: ArtifactStore,
                 steps: Submission, fanout: FanoutService, readings: PoolReadings,
                 ends: JobEnds) -> None:
        self._settings = settings
        self._repo = repo
        self._artifacts = artifacts
        self._steps = steps
        self._fanout = fanout
        self._readings = readings
        self._ends = ends

    def submit(self, tenant: TenantRecord, spec: JobSpec, *, body_bytes: int = 0) -> JobRecord:
        """Check a validated spec against the installation's caps and the tenant's limits
        (`e31.core.tenantlimits`: its submit rate, body size and priority here; its most queued jobs
        in the transaction that stores the job), check what it names, route it, store the job
        as queued, then wake the scheduler. A refusal stores nothing."""
        steps = self._steps
        limits = steps.tenant_limits(tenant, body_bytes=body_bytes, rate=True)
        if is_fanout(spec.entrypoint, spec.params):
            return self._fanout.submit(tenant, spec, limits)
        steps.tally().add(steps.within_limits(spec, tenant, limits))
        steps.check_bundles(tenant, spec)
        steps.check_secrets(tenant, spec)
        steps.check_array_inputs(tenant, spec)
        spec, where = steps.place(spec, steps.nodes())
        return self._insert(tenant, spec, where, limits)

    def _insert(self, tenant: TenantRecord, spec: JobSpec, where: Route,
                limits: TenantLimits) -> JobRecord:
        """Store the job as queued (within the tenant's most queued jobs), then wake the
        scheduler."""
        with self._steps.inserting():
            record = self._repo.insert_job(tenant.id, spec, where, now=utcnow(),
                                           max_queued=limits.max_queued)
        log.info("job_submitted job=%s tenant=%s queue=%s", record.id, tenant.name, record.queue)
        self._steps.wake(record.id)
        return record

    def dry_run(self, tenant: TenantRecord, spec: JobSpec, *,
                body_bytes: int = 0) -> dict[str, Any]:
        """What `submit` would store for `spec` (the spec as the pool runs it, its class and
        queue, its code bundle), after the same checks; nothing is stored. A bundle the tenant
        has not uploaded yet is listed in `missing_bundles` instead of refused, a secret it has
        not set in `missing_secrets`. The tenant's body size and priority limits apply; its
        submit rate and most queued jobs do not (they depend on the moment of the submit).
        Also whether it could start now and on which worker (`could_run_now`, `where`), when
        it should start (`estimated_start`), and why it would wait (`pending`, as a queued
        job's status says it)."""
        steps = self._steps
        limits = steps.tenant_limits(tenant, body_bytes=body_bytes, rate=False)
        if is_fanout(spec.entrypoint, spec.params):
            return self._fanout.dry_run(tenant, spec, limits)
        steps.tally().add(steps.within_limits(spec, tenant, limits))
        missing = steps.check_bundles(tenant, spec, dry_run=True)
        workers = self._readings.workers()
        nodes = self._readings.shapes(workers)
        spec, where = steps.place(spec, nodes)
        return {"dry_run": True, "name": spec.display_name, "size_class": where.size_class,
                "queue": where.queue, "gpus": where.gpus, "code": spec.code,
                "missing_bundles": missing,
                "missing_secrets": steps.missing_secrets(tenant, spec),
                **self._placement(tenant, spec, where, workers, nodes),
                "spec": spec.model_dump(mode="json")}

    def _placement(self, tenant: TenantRecord, spec: JobSpec, where: Route,
                   workers: builtins.list[WorkerInfo] | None,
                   nodes: placement.Shapes | None) -> dict[str, Any]:
        """A dry run's answer to "could it start now, where, when, and if not why": the
        explanation a queued job's status gives (`explain.pending`), for a job not stored.
        It could start now when a live idle worker serves its queue and nothing of the
        queue's backlog, the tenant's quota or a dependency goes first."""
        now = utcnow()
        draft = JobRecord(
            id="dry-run", tenant=tenant.name, name=spec.display_name,
            spec=spec.model_dump(mode="json"), state="queued", size_class=where.size_class,
            queue=where.queue, gpus=where.gpus, priority=spec.priority, reason=None,
            error=None, result=None, submitted_at=now, started_at=None, ended_at=None,
            not_before=None, gpu_seconds=0.0, run_seconds=0.0, queued_seconds=0.0,
            progress_done=None, progress_total=None, outputs=[])
        load = self._readings.queue_load(where.queue, now)
        own = sum(n for (t, band), n in load.backlog.items()
                  if t == tenant.id and band == spec.priority)
        pos = QueuePosition(tenant_id=tenant.id, older_own=own,
                            first_dependency=spec.after[0] if spec.after else None,
                            published=False, stored_reason=None, stored_detail=None)
        pending = explain.pending(
            draft, pos, load, self._readings.tenant_views(self._readings.view(now)), now=now,
            half_life_s=self._settings.fair_share_half_life_s,
            owns=lambda other: self._owns(tenant, other), workers=workers, nodes=nodes,
            scheduler=self._readings.scheduler_leads(workers))
        idle = sorted((w for w in workers or () if where.queue in w.queues
                       and w.busy_job is None), key=lambda w: (w.queues[0] != where.queue,
                                                               w.node))
        if idle and pending["reason"] == Reason.NO_CAPACITY.value \
                and pending["position"] == 0:
            return {"could_run_now": True, "where": {"worker": idle[0].node,
                                                     "host": idle[0].host},
                    "estimated_start": iso(now), "pending": None}
        return {"could_run_now": False, "where": None,
                "estimated_start": pending["estimated_start"], "pending": pending}

    def reader_of(self, tenant: TenantRecord, job_id: str) -> str:
        """The tenant id under which `tenant` reads the job: its own; an admin's token reads
        any tenant's job (status, log, outputs, GPUs; never a write), as it may make that
        tenant's token anyway (`POST /v1/tokens?tenant=`). `NotFound` as ever for a job
        that is not there or, to a tenant, another's."""
        return self._repo.job_tenant_id(job_id) if tenant.admin else tenant.id

    def get(self, tenant: TenantRecord, job_id: str, *, owner: str | None = None) -> JobRecord:
        """A job; a queued one with its `pending` reason, position and estimated start.
        `owner`: the tenant id it is read under, when the caller asked `reader_of` already."""
        owner = owner or self.reader_of(tenant, job_id)
        record = self._with_fanout_progress(owner, self._repo.get_job(owner, job_id))
        if record.state != "queued":
            return record
        why = self.pending(tenant, [record], owner_id=owner)
        return dataclasses.replace(record, pending=why[record.id])

    def pending(self, tenant: TenantRecord, records: builtins.list[JobRecord], *,
                owner_id: str | None = None) -> dict[str, dict[str, Any]]:
        """Why each of the tenant's queued `records` waits (`explain.pending`, as `get` says
        it), the pool's view, the tenants' and the workers read once for all of them (a list
        page's queued rows)."""
        now = utcnow()
        readings = self._readings
        tenants = readings.tenant_views(readings.view(now))
        workers = readings.workers()
        nodes = readings.shapes(workers)
        leads = readings.scheduler_leads(workers)
        owner = owner_id or tenant.id
        return {r.id: explain.pending(
            r, self._repo.queue_position(owner, r.id), readings.queue_load(r.queue, now),
            tenants, now=now, half_life_s=self._settings.fair_share_half_life_s,
            owns=lambda other: self._owns(tenant, other), workers=workers, nodes=nodes,
            scheduler=leads)
            for r in records if r.state == "queued"}

    async def poll(self, tenant: TenantRecord, job_id: str, *, wait_s: int) -> JobRecord:
        """`get`, after a long poll of up to `wait_s` for the job to be final (0: at once):
        woken by the worker's announcement (`e31.api.waits`), else a store read."""
        if not wait_s:
            return await run_in_threadpool(self.get, tenant, job_id)
        owner = await run_in_threadpool(self.reader_of, tenant, job_id)

        async def is_final() -> bool:
            return await run_in_threadpool(self._repo.job_state, owner, job_id) in FINAL_STATES

        await self._ends.wait_until_final(job_id, is_final, wait_s)
        return await run_in_threadpool(functools.partial(self.get, tenant, job_id, owner=owner))

    def _with_fanout_progress(self, tenant_id: str, record: JobRecord) -> JobRecord:
        """A live fan-out merge job's progress is its array's: frames done of those planned,
        summed over the items (a succeeded item counts whole). So is an ended one's when its
        own last progress was never relayed (a merge that ends within one heartbeat)."""
        if record.spec.get("entrypoint") != MERGE_ENTRYPOINT:
            return record
        if record.state not in ("queued", "running") and record.progress_total is not None:
            return record
        arrays = [a for a in record.spec.get("after") or [] if a.startswith("a-")]
        total = (record.spec.get("params") or {}).get("total_frames") or 0
        if not arrays or not total:
            return record
        done = sum(self._repo.array_progress(tenant_id, a) for a in arrays)
        return dataclasses.replace(record, progress_done=min(done, total), progress_total=total)

    def _owns(self, tenant: TenantRecord, job_id: str) -> bool:
        """Whether `job_id` is a job of `tenant` (what a pending reason may name)."""
        try:
            self._repo.get_job(tenant.id, job_id)
        except NotFound:
            return False
        return True

    def list(self, tenant: TenantRecord, *, state: str | None, limit: int,
             name: str | None = None, size_class: str | None = None,
             array_id: str | None = None, before: str | None = None,
             all_tenants: bool = False) -> builtins.list[JobRecord]:
        """The tenant's jobs (`all_tenants`: every tenant's, an admin's token only), newest
        first, filtered as `Repo.list_jobs` says; `before` a job id: the page after it."""
        if all_tenants and not tenant.admin:
            raise Forbidden("jobs of all tenants need an admin token")
        limit = min(max(limit, 1), LIST_LIMIT_MAX)
        return self._repo.list_jobs(None if all_tenants else tenant.id, state=state,
                                    limit=limit, name=name,
                                    size_class=size_class, array_id=array_id, before=before)

    def cancel(self, tenant: TenantRecord, job_id: str) -> JobRecord:
        record = self._repo.request_cancel(tenant.id, job_id, now=utcnow())
        log.info("job_cancel_requested job=%s state=%s", job_id, record.state)
        return record

    def logs(self, tenant: TenantRecord, job_id: str, *, attempt: int | None, offset: int,
             limit: int | None = None) -> LogChunk:
        """At most `log_chunk_max_bytes` (or `limit`, if smaller) of one attempt's log, or of
        every attempt's log with a header each, from `offset`; streamed from the store."""
        owner = self.reader_of(tenant, job_id)
        record = self._repo.get_job(owner, job_id)  # 404 for another tenant's job
        view = self._artifacts.log_view(owner, record.id, attempt)
        size = view.size_bytes
        bound = self._settings.log_chunk_max_bytes
        length = max(0, min(bound if limit is None else min(limit, bound), size - offset))
        return LogChunk(size_bytes=size, next_offset=offset + length,
                        body=view.read(offset, length))

    def gpu_series(self, tenant: TenantRecord, job_id: str) -> dict[str, Any]:
        """The job's GPU memory and utilisation over its run, a point every few heartbeats
        of its worker (`e31.ops.gpuseries`: bounded, the newest kept); `known` False when
        Redis could not be read."""
        record = self._repo.get_job(self.reader_of(tenant, job_id), job_id)   # 404: another's
        points = self._readings.gpu_series(record.id)
        return {"known": points is not None, "points": points or [],
                "step_s": gpuseries.STEP_S, "max_points": gpuseries.MAX_POINTS}

    def outputs(self, tenant: TenantRecord, job_id: str) -> builtins.list[dict[str, Any]]:
        owner = self.reader_of(tenant, job_id)
        record = self._repo.get_job(owner, job_id)
        return self._artifacts.list_outputs(owner, record.id)

    def open_output(self, tenant: TenantRecord, job_id: str, path: str) -> IO[bytes]:
        owner = self.reader_of(tenant, job_id)
        record = self._repo.get_job(owner, job_id)
        return self._artifacts.open_output(owner, record.id, path)


