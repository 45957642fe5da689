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
from e31.api.limits import spec_limits
from e31.artifacts import ArtifactStore
from e31.blobs import BundleStore
from e31.clock import utcnow
from e31.errors import AuthError, Forbidden, NotFound, SpecConflict, SpecError, SpecForbidden
from e31.heartbeat import read_workers, wake
from e31.scheduling import explain
from e31.scheduling import inputs as policy
from e31.scheduling.fairshare import Tenant
from e31.settings import Settings
from e31.sizeclasses import Route, all_queues, route
from e31.spec import NAME_MAX, JobSpec, RequestTally, check_name, describe_error
from e31.store import Repo
from e31.store.records import (
    ArrayManifest,
    ArrayRecord,
    JobRecord,
    QueueLoad,
    SchedulingView,
    TenantRecord,
)
from e31.store.scheduling import running_gpus
from e31.sweep import MAX_ARRAY_ITEMS, merge_item

log = logging.getLogger(__name__)

LIST_LIMIT_MAX = 1000
LOAD_CACHE_S = 5.0        # a queue's backlog counts behind `pending`, reused this long
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
        self.bundles = BundleChecks(settings=settings, store=BundleStore(artifacts.url))
        self._loads: dict[str, tuple[float, QueueLoad]] = {}   # queue -> (monotonic s, load)

    @property
    def repo(self) -> Repo:
        """The store it works on (the metrics and `/v1/top` read the pool through it)."""
        return self._repo

    @property
    def redis(self) -> redis.Redis:
        return self._redis

    def authenticate(self, token: str | None) -> TenantRecord:
        if not token:
            raise AuthError("missing API token: send 'Authorization: Bearer <token>'")
        tenant = self._repo.tenant_for_token(token)
        if tenant is None:
            raise AuthError("invalid API token")
        return tenant

    def submit(self, tenant: TenantRecord, spec: JobSpec) -> JobRecord:
        """Check a validated spec against the installation's caps, route it, store the job as
        queued, then wake the scheduler."""
        RequestTally(self._limits).add(self._within_limits(spec))
        self.bundles.check_spec(tenant.id, spec)
        spec, where = self._admit(spec)
        with _dependencies_conflict():
            record = self._repo.insert_job(tenant.id, spec, where, now=utcnow())
        log.info("job_submitted job=%s tenant=%s queue=%s", record.id, tenant.name, record.queue)
        self._wake(record.id)
        return record

    def dry_run(self, tenant: TenantRecord, spec: JobSpec) -> dict[str, Any]:
        """What `submit` would store for `spec` (the spec as the pool runs it, its class and
        queue, its code bundle), after the same checks; nothing is stored. A bundle the tenant
        has not uploaded yet is listed in `missing_bundles` instead of refused."""
        RequestTally(self._limits).add(self._within_limits(spec))
        missing = self.bundles.check_spec(tenant.id, spec, dry_run=True)
        spec, where = self._admit(spec)
        return {"dry_run": True, "name": spec.display_name, "size_class": where.size_class,
                "queue": where.queue, "gpus": where.gpus, "code": spec.code,
                "missing_bundles": missing, "spec": spec.model_dump(mode="json")}

    def submit_many(self, tenant: TenantRecord, items: Sequence[Any], *, name: str | None = None,
                    defaults: Mapping[str, Any] | None = None) -> ArrayRecord:
        """Validate and route every item (`defaults` merged under each), then store them all as
        one array in one transaction and wake the scheduler once. One bad item refuses the
        whole array with a `SpecError` naming it (`items[3].resources.gpus`); nothing is stored.

        The items are untrusted mappings: each is validated here, once, by `JobSpec.parse`, and
        checked against the caps on one job; the caps on the request's jobs together refuse
        the whole array as soon as a total passes one. Each field of `defaults` must be valid
        on its own, even where every item sets it over. The answer is the strongest refusal of any
        item: an invalid one (422) before a forbidden input (403) before a missing bundle or
        dependency (409)."""
        array_name = _array_name(name)
        if not items:
            raise SpecError.one("items", "must be a non-empty list of job specs")
        if len(items) > MAX_ARRAY_ITEMS:
            raise SpecError.one("items", f"{len(items)} items; at most {MAX_ARRAY_ITEMS} per array "
                                         "(submit several arrays)")
        admitted: list[tuple[JobSpec, Route]] = []
        errors: list[dict[str, str]] = []
        kinds: set[type[SpecError]] = set()
        bad, named = 0, 0
        tally = RequestTally(self._limits, field="items")
        for i, item in enumerate(items):
            data = merge_item(defaults or {}, _named(item, array_name, i, given=name is not None))
            try:
                spec = self._within_limits(JobSpec.parse(data))
                self.bundles.check_spec(tenant.id, spec)
                admitted.append(self._admit(spec))
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
            record = self._repo.insert_array(tenant.id, array_name, admitted, now=utcnow())
        log.info("array_submitted array=%s tenant=%s size=%d", record.id, tenant.name, record.size)
        self._wake(record.id)
        return record

    def _within_limits(self, spec: JobSpec) -> JobSpec:
        """`spec`, or `SpecError` naming each cap on one job that it passes (`max_env_vars` …)."""
        errors = self._limits.check(spec)
        if errors:
            raise SpecError(errors)
        return spec

    def _admit(self, spec: JobSpec) -> tuple[JobSpec, Route]:
        """The spec as this pool runs it (the pool's `[retries]` under the spec's own) and its
        size class and queue; `SpecError` naming the field when no class takes it."""
        spec = spec.with_retry_defaults(self._settings.retries)
        return spec, route(spec, self._settings.size_classes)

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
        record = self._repo.get_job(tenant.id, job_id)
        if record.state != "queued":
            return record
        now = utcnow()
        pos = self._repo.queue_position(tenant.id, job_id)
        tenants = self._tenant_views(self._view(now))
        return dataclasses.replace(record, pending=explain.pending(
            record, pos, self._queue_load(record.queue, now), tenants, now=now,
            half_life_s=self._settings.fair_share_half_life_s,
            owns=lambda other: self._owns(tenant, other)))

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
        try:
            workers = read_workers(self._redis)
        except redis.RedisError as exc:
            log.warning("queue_workers_unknown: %s", exc)
            workers = []
        overview = explain.queue_overview(
            classes=self._settings.size_classes, workers=workers, view=view,
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
