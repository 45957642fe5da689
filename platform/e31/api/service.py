"""The operations of E31 Batch — submit, get, list, cancel, logs, outputs, usage, arrays.

The API is a thin HTTP layer over this; every call is scoped by the caller's tenant.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import IO, Any

import redis
from pydantic import ValidationError

from e31.api.bundles import BundleChecks
from e31.api.limits import SubmitRate, spec_limits
from e31.api.requirements import Memo, RequirementsCheck
from e31.core.bundles import ARRAY_INPUT, parse_array_input
from e31.core.clock import utcnow
from e31.core.errors import (
    AuthError,
    Forbidden,
    NotFound,
    SpecConflict,
    SpecError,
    SpecForbidden,
    TooLarge,
)
from e31.core.footage import CHUNKS_INPUT
from e31.core.limits import TenantLimits
from e31.core.names import NAME_MAX, check_name
from e31.core.records import (
    ArrayManifest,
    ArrayRecord,
    JobRecord,
    QueueLoad,
    QueuePosition,
    SchedulingView,
    TenantRecord,
    iso,
)
from e31.core.sizeclasses import Route, all_queues, route
from e31.core.spec import JobSpec, describe_error
from e31.core.speclimits import RequestTally
from e31.edge.artifacts import ArtifactStore
from e31.edge.bundlestore import BundleStore
from e31.edge.settings import Settings
from e31.ops.fanout import MERGE_ENTRYPOINT, is_fanout
from e31.ops.fanout import plan as plan_fanout
from e31.ops.heartbeat import WorkerInfo, expand_gangs, read_workers, wake
from e31.ops.sweep import MAX_ARRAY_ITEMS, merge_item
from e31.scheduling import explain, placement
from e31.scheduling import inputs as policy
from e31.scheduling.fairshare import Reason, Tenant
from e31.store import Repo
from e31.store.arrays import RetryRecord
from e31.store.scheduling import running_gpus

log = logging.getLogger(__name__)

LIST_LIMIT_MAX = 1000
LOAD_CACHE_S = 5.0        # a queue's backlog counts behind `pending`, reused this long
NODES_REMEMBER_S = 60.0   # an API process writes the live node shapes to e31:nodes at most
#                           this often: every status poll reads them, and they count for a day
ITEM_ERRORS_MAX = 20      # bad items named in one answer; a bad default would name them all
DEFAULT_ARRAY_NAME = "array"


@dataclasses.dataclass(frozen=True)
class LogChunk:
    """One bounded piece of a job's logs: the bytes it streams, where the next piece starts,
    and how big the logs were when it was cut (docs/jobs.md, "Results, logs, outputs")."""

    size_bytes: int
    next_offset: int
    body: Iterator[bytes]


class Service:
    """The operations behind the routes, over one store, artifact store and Redis."""

    def __init__(self, *, settings: Settings, repo: Repo, artifacts: ArtifactStore,
                 redis_client: redis.Redis) -> None:
        self._settings = settings
        self._repo = repo
        self._artifacts = artifacts
        self._redis = redis_client
        self._limits = spec_limits(settings)
        self._rate = SubmitRate(redis_client)
        store = BundleStore(artifacts.url, artifacts.storage_options)
        self.bundles = BundleChecks(settings=settings, store=store)
        self._requirements = RequirementsCheck(store=store)   # python.requirements, line by line
        self._loads: dict[str, tuple[float, QueueLoad]] = {}   # queue -> (monotonic s, load)
        self._nodes_written = float("-inf")    # monotonic s of the last write to e31:nodes

    @property
    def repo(self) -> Repo:
        """The store it works on (the metrics and `/v1/top` read the pool through it)."""
        return self._repo

    @property
    def redis(self) -> redis.Redis:
        return self._redis

    def authenticate(self, token: str | None) -> TenantRecord:
        """The tenant of a live token, read from the store at every request (nothing cached:
        a revoked or expired token is refused on the very next one). 401 for no, an unknown,
        a revoked or an expired token (one answer: it tells a guesser nothing); 403 for the
        token of a disabled tenant, which only its holder can learn."""
        if not token:
            raise AuthError("missing API token: send 'Authorization: Bearer <token>'")
        tenant = self._repo.tenant_for_token(token, now=utcnow())
        if tenant is None:
            raise AuthError("invalid API token (unknown, revoked or expired)")
        if tenant.disabled_at is not None:
            raise Forbidden(f"tenant {tenant.name} is disabled (since "
                            f"{tenant.disabled_at.isoformat()}); ask an admin to enable it")
        return tenant

    def submit(self, tenant: TenantRecord, spec: JobSpec, *, body_bytes: int = 0) -> JobRecord:
        """Check a validated spec against the installation's caps and the tenant's limits
        (`e31.core.limits`: its submit rate, body size and priority here; its most queued jobs
        in the transaction that stores the job), route it, store the job as queued, then wake
        the scheduler. A refusal stores nothing."""
        limits = self._tenant_limits(tenant, body_bytes=body_bytes, rate=True)
        if is_fanout(spec.entrypoint, spec.params):
            return self._submit_fanout(tenant, spec, limits)
        RequestTally(self._limits).add(self._within_limits(spec, tenant, limits))
        self.bundles.check_spec(tenant.id, spec)
        self._requirements.check(tenant.id, spec)
        self._check_secrets(tenant, spec)
        self._check_array_inputs(tenant, spec)
        spec, where = self._admit(spec, self._shapes(self._workers()))
        with _dependencies_conflict():
            record = self._repo.insert_job(tenant.id, spec, where, now=utcnow(),
                                           max_queued=limits.max_queued)
        log.info("job_submitted job=%s tenant=%s queue=%s", record.id, tenant.name, record.queue)
        self._wake(record.id)
        return record

    def _submit_fanout(self, tenant: TenantRecord, spec: JobSpec,
                       limits: TenantLimits) -> JobRecord:
        """A footage `source`: its chunk jobs as one array and a merge job after it, planned
        here (the files listed, the videos' durations probed: `e31.ops.fanout.plan`) and stored
        in one transaction; the merge job's record is the answer (docs/workloads.md)."""
        items, merge = self._fanout_specs(tenant, spec, limits)
        name = _array_name(spec.name or "footage")

        def merge_spec(array_id: str) -> tuple[JobSpec, Route]:
            data = {**merge, "after": [array_id],
                    "inputs": {CHUNKS_INPUT: f"array:{array_id}/outputs"}}
            return self._admit(self._within_limits(JobSpec.parse(data), tenant, limits))

        with _dependencies_conflict():
            array, record = self._repo.insert_fanout(tenant.id, name, items, merge_spec,
                                                     now=utcnow(), max_queued=limits.max_queued)
        log.info("fanout_submitted job=%s array=%s tenant=%s items=%d", record.id, array.id,
                 tenant.name, array.size)
        self._wake(record.id)
        return record

    def _fanout_specs(self, tenant: TenantRecord, spec: JobSpec, limits: TenantLimits
                      ) -> tuple[list[tuple[JobSpec, Route]], dict[str, Any]]:
        """The chunk jobs (validated, checked, routed, within the caps on one request) and the
        merge job's spec fields, but for its `after` and input (the array's id)."""
        if spec.after:
            raise SpecError.one("after", "a footage source's fan-out takes no after: submit "
                                         "it once what it needs has succeeded")
        planned = plan_fanout(spec.params, roots=self._settings.input_file_roots,
                              allowed=self._settings.input_allowed_networks)
        most = min(MAX_ARRAY_ITEMS, limits.max_array_items)
        if len(planned.items) > most:
            raise SpecError.one("params.chunk_s", f"{len(planned.items)} chunks; at most {most} "
                                                  "in one array: a longer chunk_s")
        base = spec.model_dump(mode="json", exclude_defaults=True)
        name = spec.name or "footage"
        tally = RequestTally(self._limits, field="params.source")
        nodes = self._shapes(self._workers())
        items: list[tuple[JobSpec, Route]] = []
        memo: Memo = {}
        for i, item in enumerate(planned.items):
            data = {**base, "name": f"{name[:NAME_MAX - 8]}[{i}]", "params": item["params"],
                    "inputs": {**spec.inputs, **item["inputs"]}}
            chunk = self._within_limits(JobSpec.parse(data), tenant, limits)
            self.bundles.check_spec(tenant.id, chunk)
            self._requirements.check(tenant.id, chunk, memo=memo)
            self._check_secrets(tenant, chunk)
            tally.add(chunk)
            items.append(self._admit(chunk, nodes))
        merge = {**{k: v for k, v in base.items() if k not in ("params", "inputs", "after")},
                 "name": name, "entrypoint": MERGE_ENTRYPOINT, "params": planned.merge["params"],
                 "resources": {"gpus": 0}}
        return items, merge

    def _check_array_inputs(self, tenant: TenantRecord, spec: JobSpec) -> None:
        """An `array:<id>/outputs` input names an array of the tenant (409 otherwise)."""
        for name, source in spec.inputs.items():
            if ARRAY_INPUT.fullmatch(source):
                try:
                    self._repo.get_array(tenant.id, parse_array_input(source), items=False)
                except NotFound:
                    raise SpecConflict.one(f"inputs.{name}", "names no array of this "
                                                             "tenant") from None

    def retry_array(self, tenant: TenantRecord, array_id: str) -> RetryRecord:
        """Queue the array's failed and cancelled items again, and what they had stopped."""
        record = self._repo.retry_array(tenant.id, array_id, now=utcnow())
        log.info("array_retried array=%s items=%d rearmed=%d", array_id,
                 len(record.resubmitted), len(record.rearmed))
        if record.resubmitted:
            self._wake(array_id)
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
        limits = self._tenant_limits(tenant, body_bytes=body_bytes, rate=False)
        if is_fanout(spec.entrypoint, spec.params):
            items, merge = self._fanout_specs(tenant, spec, limits)
            return {"dry_run": True, "name": merge["name"], "fanout": {
                "items": len(items), "files": merge["params"]["files"],
                "total_frames": merge["params"]["total_frames"]}}
        RequestTally(self._limits).add(self._within_limits(spec, tenant, limits))
        missing = self.bundles.check_spec(tenant.id, spec, dry_run=True)
        self._requirements.check(tenant.id, spec)
        workers = self._workers()
        nodes = self._shapes(workers)
        spec, where = self._admit(spec, nodes)
        return {"dry_run": True, "name": spec.display_name, "size_class": where.size_class,
                "queue": where.queue, "gpus": where.gpus, "code": spec.code,
                "missing_bundles": missing,
                "missing_secrets": self._repo.missing_secrets(tenant.id, spec.secrets),
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
        load = self._queue_load(where.queue, now)
        own = sum(n for (t, band), n in load.backlog.items()
                  if t == tenant.id and band == spec.priority)
        pos = QueuePosition(tenant_id=tenant.id, older_own=own,
                            first_dependency=spec.after[0] if spec.after else None,
                            published=False, stored_reason=None, stored_detail=None)
        pending = explain.pending(
            draft, pos, load, self._tenant_views(self._view(now)), now=now,
            half_life_s=self._settings.fair_share_half_life_s,
            owns=lambda other: self._owns(tenant, other), workers=workers, nodes=nodes)
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

    def submit_many(self, tenant: TenantRecord, items: Sequence[Any], *, name: str | None = None,
                    defaults: Mapping[str, Any] | None = None,
                    body_bytes: int = 0) -> ArrayRecord:
        """Validate and route every item (`defaults` merged under each), then store them all as
        one array in one transaction and wake the scheduler once. One bad item refuses the
        whole array with a `SpecError` naming it (`items[3].resources.gpus`); nothing is stored.

        The items are untrusted mappings: each is validated here, once, by `JobSpec.parse`, and
        checked against the caps on one job; the caps on the request's jobs together refuse
        the whole array as soon as a total passes one. Each field of `defaults` must be valid
        on its own, even where every item sets it over. The answer is the strongest refusal of any
        item: an invalid one (422) before a forbidden input (403) before a missing bundle,
        secret or dependency (409). The tenant's limits apply as in `submit`; an array is one
        request of its submit rate, and each item one of its queued jobs."""
        limits = self._tenant_limits(tenant, body_bytes=body_bytes, rate=True)
        array_name = _array_name(name)
        if not items:
            raise SpecError.one("items", "must be a non-empty list of job specs")
        if len(items) > MAX_ARRAY_ITEMS:
            raise SpecError.one("items", f"{len(items)} items; at most {MAX_ARRAY_ITEMS} per array "
                                         "(submit several arrays)")
        if len(items) > limits.max_array_items:
            raise SpecError.one("items", f"{len(items)} items; at most {limits.max_array_items} "
                                         f"per array for tenant {tenant.name} "
                                         "(limits.max_array_items): submit several arrays, or "
                                         "ask an admin")
        admitted: list[tuple[JobSpec, Route]] = []
        errors: list[dict[str, str]] = []
        kinds: set[type[SpecError]] = set()
        bad, named = 0, 0
        tally = RequestTally(self._limits, field="items")
        nodes = self._shapes(self._workers())
        memo: Memo = {}
        for i, item in enumerate(items):
            data = merge_item(defaults or {}, _named(item, array_name, i, given=name is not None))
            try:
                spec = self._within_limits(JobSpec.parse(data), tenant, limits)
                self.bundles.check_spec(tenant.id, spec)
                self._requirements.check(tenant.id, spec, memo=memo)
                self._check_secrets(tenant, spec)
                admitted.append(self._admit(spec, nodes))
            except SpecError as exc:
                bad += 1
                kinds.add(type(exc))
                if named < ITEM_ERRORS_MAX:
                    named += 1
                    errors.extend({"field": _item_field(i, e["field"]), "reason": e["reason"]}
                                  for e in exc.errors)
                continue
            tally.add(spec)
        if bad > named:
            errors.append({"field": "items", "reason": f"{bad} of {len(items)} items are "
                                                       f"invalid; the first {named} are named"})
        if SpecError in kinds:
            raise SpecError(errors)
        _check_defaults(defaults or {})     # a bad default that every item set over
        if errors:
            raise (SpecForbidden if SpecForbidden in kinds else SpecConflict)(errors)
        with _dependencies_conflict():
            record = self._repo.insert_array(tenant.id, array_name, admitted, now=utcnow(),
                                             max_queued=limits.max_queued)
        log.info("array_submitted array=%s tenant=%s size=%d", record.id, tenant.name, record.size)
        self._wake(record.id)
        return record

    def _within_limits(self, spec: JobSpec, tenant: TenantRecord,
                       limits: TenantLimits) -> JobSpec:
        """`spec`, or `SpecError` naming each cap on one job that it passes (`max_env_vars` …)
        and the tenant's highest priority (`limits.max_priority`)."""
        errors = self._limits.check(spec)
        if spec.priority > limits.max_priority:
            errors.append({"field": "priority", "reason": (
                f"at most {limits.max_priority} for tenant {tenant.name} "
                "(limits.max_priority); ask an admin")})
        if errors:
            raise SpecError(errors)
        return spec

    def _tenant_limits(self, tenant: TenantRecord, *, body_bytes: int,
                       rate: bool) -> TenantLimits:
        """The tenant's limits (the pool's defaults under its own); refuses a body over its
        `max_request_bytes` (413) and, with `rate`, a submit past its rate (429)."""
        limits = TenantLimits.of(self._settings.tenant_limits, tenant.limits)
        if rate:
            self._rate.take(tenant.id, tenant.name, limits)
        if body_bytes > limits.max_request_bytes:
            raise TooLarge(f"the request body is larger than {limits.max_request_bytes} bytes, "
                           f"the most for tenant {tenant.name} (limits.max_request_bytes)",
                           limit_bytes=limits.max_request_bytes)
        return limits

    def _check_secrets(self, tenant: TenantRecord, spec: JobSpec) -> None:
        """`SpecConflict` (409) naming each secret of `spec` that the tenant has not set (as a
        bundle or dependency it lacks): another tenant's of the same name does not count."""
        missing = self._repo.missing_secrets(tenant.id, spec.secrets)
        if missing:
            raise SpecConflict([{"field": f"secrets[{spec.secrets.index(n)}]", "reason": (
                f"{n}: tenant {tenant.name} has no secret of that name (e31 secret set {n})")}
                for n in missing])

    def _admit(self, spec: JobSpec,
               nodes: placement.Shapes | None = None) -> tuple[JobSpec, Route]:
        """The spec as this pool runs it (the pool's `[retries]` under the spec's own) and its
        size class and queue; `SpecError` naming the field when no class takes it, or when no
        registered node (`nodes`, `placement.shapes`) has the GPUs it asks for and the spec
        does not say `allow_pending`."""
        spec = spec.with_retry_defaults(self._settings.retries)
        where = route(spec, self._settings.size_classes)
        if not spec.allow_pending and (
                why := placement.missing(where.size_class, where.gpus, nodes or {})):
            raise SpecError.one("resources.gpus", f"{why}; set allow_pending "
                                                  "(e31 submit --allow-pending) to hold the "
                                                  "job until such a node joins")
        return spec, where

    def _shapes(self, workers: builtins.list[WorkerInfo] | None) -> placement.Shapes | None:
        """The registered node shapes (`placement.registered`: the live `workers` and those
        seen in the last day); None when Redis cannot be read, and then nothing is refused."""
        if workers is None:
            return None
        remember = bool(workers) and \
            time.monotonic() - self._nodes_written >= NODES_REMEMBER_S
        try:
            nodes = placement.registered(self._redis, workers, remember=remember)
            if remember:
                self._nodes_written = time.monotonic()
            return placement.shapes(nodes)
        except redis.RedisError as exc:
            log.warning("pool_unreadable: %s", exc)
            return None

    def get_array(self, tenant: TenantRecord, array_id: str, *, items: bool = True) -> ArrayRecord:
        return self._repo.get_array(tenant.id, array_id, items=items)

    def cancel_array(self, tenant: TenantRecord, array_id: str) -> ArrayRecord:
        record = self._repo.cancel_array(tenant.id, array_id, now=utcnow())
        log.info("array_cancel_requested array=%s cancelled=%d running=%d", array_id,
                 record.counts.get("cancelled", 0), record.counts.get("running", 0))
        return record

    def array_manifest(self, tenant: TenantRecord, array_id: str) -> ArrayManifest:
        return self._repo.array_manifest(tenant.id, array_id)

    def _wake(self, what: str) -> None:
        try:
            wake(self._redis)
        except redis.RedisError as exc:  # the work is stored; the next tick publishes it
            log.warning("scheduler_wake_failed for=%s: %s", what, exc)

    def get(self, tenant: TenantRecord, job_id: str) -> JobRecord:
        """A job; a queued one with its `pending` reason, position and estimated start."""
        record = self._with_fanout_progress(tenant, self._repo.get_job(tenant.id, job_id))
        if record.state != "queued":
            return record
        now = utcnow()
        pos = self._repo.queue_position(tenant.id, job_id)
        tenants = self._tenant_views(self._view(now))
        workers = self._workers()
        return dataclasses.replace(record, pending=explain.pending(
            record, pos, self._queue_load(record.queue, now), tenants, now=now,
            half_life_s=self._settings.fair_share_half_life_s,
            owns=lambda other: self._owns(tenant, other), workers=workers,
            nodes=self._shapes(workers)))

    def _workers(self, *, expand: bool = True) -> builtins.list[WorkerInfo] | None:
        """The live workers from their heartbeats, a gang host's as its GPU sets
        (`heartbeat.expand_gangs`) unless `expand` is False (one per GPU, as the queue view
        counts them); None when Redis cannot be read (which is not the same as no workers: a
        pending reason and the queue view say which)."""
        try:
            workers = read_workers(self._redis)
            return expand_gangs(workers) if expand else workers
        except redis.RedisError as exc:
            log.warning("pool_unreadable: %s", exc)
            return None

    def _with_fanout_progress(self, tenant: TenantRecord, record: JobRecord) -> JobRecord:
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
        done = sum(self._repo.array_progress(tenant.id, a) for a in arrays)
        return dataclasses.replace(record, progress_done=min(done, total), progress_total=total)

    def _owns(self, tenant: TenantRecord, job_id: str) -> bool:
        """Whether `job_id` is a job of `tenant` (what a pending reason may name)."""
        try:
            self._repo.get_job(tenant.id, job_id)
        except NotFound:
            return False
        return True

    def _queue_load(self, queue: str, now: datetime) -> QueueLoad:
        """The queue's backlog and recent starts, reused for LOAD_CACHE_S: every waiting
        client polls its job's status, and the backlog read grows with the queue."""
        cached = self._loads.get(queue)
        if cached is not None and time.monotonic() - cached[0] < LOAD_CACHE_S:
            return cached[1]
        fresh = self._repo.queue_load(queue, now=now)
        self._loads[queue] = (time.monotonic(), fresh)
        return fresh

    def queue(self, tenant: TenantRecord) -> dict[str, Any]:
        """Per size class: GPUs, busy GPUs, queued jobs and running GPUs per tenant, share used
        against weight. Only an admin token sees other tenants by name."""
        view = self._view(utcnow())
        overview = explain.queue_overview(
            classes=self._settings.size_classes, workers=self._workers(expand=False), view=view,
            tenants=self._tenant_views(view), queued=self._repo.queued_by_tenant(),
            viewer=None if tenant.admin else tenant.id)
        # Nodes out of service until their worker starts again: an operator's drain, or a
        # node's own for a GPU's XID error, with the reason.
        overview["drained"] = [d.to_dict() for d in self._repo.drained_nodes()]
        return overview

    def _view(self, now: datetime) -> SchedulingView:
        return self._repo.scheduling_view(now=now, queues=all_queues(self._settings.size_classes))

    def _tenant_views(self, view: SchedulingView) -> dict[str, Tenant]:
        return policy.tenant_views(view.tenants, running_gpus(view.running, view.outstanding),
                                   now=utcnow(), half_life_s=self._settings.fair_share_half_life_s)

    def list(self, tenant: TenantRecord, *, state: str | None,
             limit: int) -> builtins.list[JobRecord]:
        limit = min(max(limit, 1), LIST_LIMIT_MAX)
        return self._repo.list_jobs(tenant.id, state=state, limit=limit)

    def cancel(self, tenant: TenantRecord, job_id: str) -> JobRecord:
        record = self._repo.request_cancel(tenant.id, job_id, now=utcnow())
        log.info("job_cancel_requested job=%s state=%s", job_id, record.state)
        return record

    def logs(self, tenant: TenantRecord, job_id: str, *, attempt: int | None, offset: int,
             limit: int | None = None) -> LogChunk:
        """At most `log_chunk_max_bytes` (or `limit`, if smaller) of one attempt's log, or of
        every attempt's log with a header each, from `offset`; streamed from the store."""
        record = self._repo.get_job(tenant.id, job_id)  # 404 for another tenant's job
        view = self._artifacts.log_view(tenant.id, record.id, attempt)
        size = view.size_bytes
        bound = self._settings.log_chunk_max_bytes
        length = max(0, min(bound if limit is None else min(limit, bound), size - offset))
        return LogChunk(size_bytes=size, next_offset=offset + length,
                        body=view.read(offset, length))

    def outputs(self, tenant: TenantRecord, job_id: str) -> builtins.list[dict[str, Any]]:
        record = self._repo.get_job(tenant.id, job_id)
        return self._artifacts.list_outputs(tenant.id, record.id)

    def open_output(self, tenant: TenantRecord, job_id: str, path: str) -> IO[bytes]:
        record = self._repo.get_job(tenant.id, job_id)
        return self._artifacts.open_output(tenant.id, record.id, path)

    def usage(self, tenant: TenantRecord, *, all_tenants: bool) -> builtins.list[dict[str, Any]]:
        if all_tenants and not tenant.admin:
            raise Forbidden("usage of all tenants needs an admin token")
        rows = self._repo.usage(None if all_tenants else tenant.id, now=utcnow())
        return [r.to_dict() for r in rows]


@contextlib.contextmanager
def _dependencies_conflict() -> Iterator[None]:
    """The store refuses a valid spec only for its dependencies (one the tenant lacks, one that
    failed): a conflict with what it holds (409), not an invalid request."""
    try:
        yield
    except SpecError as exc:
        raise SpecConflict(exc.errors) from None


def _check_defaults(defaults: Mapping[str, Any]) -> None:
    """`SpecError` naming each field of an array's `defaults` that is invalid on its own (the
    rules between fields apply to each item with its defaults, in `submit_many`)."""
    if not isinstance(defaults, Mapping):
        raise SpecError.one("defaults", "must be a mapping of spec fields")
    try:
        JobSpec.model_validate(dict(defaults))
    except ValidationError as exc:
        errors = [describe_error(e) for e in exc.errors() if e.get("loc")]
        if errors:
            raise SpecError([{"field": f"defaults.{e['field']}", "reason": e["reason"]}
                             for e in errors]) from None


def _array_name(name: str | None) -> str:
    if name is None:
        return DEFAULT_ARRAY_NAME
    if not name or len(name) > NAME_MAX or "\x00" in name:
        raise SpecError.one("name", f"must be text of 1 to {NAME_MAX} characters, without NUL")
    try:
        return check_name(name)
    except ValueError as exc:
        raise SpecError.one("name", str(exc)) from None


def _named(item: Any, array_name: str, index: int, *, given: bool) -> Any:
    """An item without a name of its own is called `<array name>[<index>]` when the array has
    one."""
    if not given or not isinstance(item, Mapping) or item.get("name") is not None:
        return item
    suffix = f"[{index}]"
    return {**item, "name": array_name[:NAME_MAX - len(suffix)] + suffix}


def _item_field(index: int, field: str) -> str:
    return f"items[{index}]" if field == "spec" else f"items[{index}].{field}"
