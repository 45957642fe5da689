"""The operations of E31 Batch — submit, get, list, cancel, logs, outputs, usage.

The API is a thin HTTP layer over this; every call is scoped by the caller's tenant.
"""

from __future__ import annotations

import builtins
import logging
from collections.abc import Mapping
from typing import IO, Any

import redis

from e31.artifacts import ArtifactStore
from e31.clock import utcnow
from e31.errors import AuthError
from e31.scheduler import wake
from e31.settings import Settings
from e31.sizeclasses import route
from e31.spec import JobSpec
from e31.store import Repo
from e31.store.records import JobRecord, TenantRecord

log = logging.getLogger(__name__)

LIST_LIMIT_MAX = 1000


class Service:
    def __init__(self, *, settings: Settings, repo: Repo, artifacts: ArtifactStore,
                 redis_client: redis.Redis) -> None:
        self._settings = settings
        self._repo = repo
        self._artifacts = artifacts
        self._redis = redis_client

    def authenticate(self, token: str | None) -> TenantRecord:
        if not token:
            raise AuthError("missing API token: send 'Authorization: Bearer <token>'")
        tenant = self._repo.tenant_for_token(token)
        if tenant is None:
            raise AuthError("invalid API token")
        return tenant

    def submit(self, tenant: TenantRecord, data: Mapping[str, Any]) -> JobRecord:
        """Validate, route and store a job as queued, then wake the scheduler."""
        spec = JobSpec.parse(self._with_pool_defaults(data))
        where = route(spec, self._settings.size_classes)
        record = self._repo.insert_job(tenant.id, spec, where, now=utcnow())
        log.info("job_submitted job=%s tenant=%s queue=%s", record.id, tenant.name, record.queue)
        try:
            wake(self._redis)
        except redis.RedisError as exc:  # the job is stored; the next tick publishes it
            log.warning("scheduler_wake_failed job=%s: %s", record.id, exc)
        return record

    def _with_pool_defaults(self, data: Mapping[str, Any]) -> Mapping[str, Any]:
        """Fill what the spec leaves out of `retries` from the pool's `[retries]` setting."""
        given = data.get("retries")
        if given is not None and not isinstance(given, Mapping):
            return data  # let validation name the field
        return {**data, "retries": {**self._settings.retries.model_dump(), **(given or {})}}

    def get(self, tenant: TenantRecord, job_id: str) -> JobRecord:
        return self._repo.get_job(tenant.id, job_id)

    def list(self, tenant: TenantRecord, *, state: str | None, limit: int) -> builtins.list[JobRecord]:
        return self._repo.list_jobs(tenant.id, state=state, limit=min(max(limit, 1), LIST_LIMIT_MAX))

    def cancel(self, tenant: TenantRecord, job_id: str) -> JobRecord:
        record = self._repo.request_cancel(tenant.id, job_id, now=utcnow())
        log.info("job_cancel_requested job=%s state=%s", job_id, record.state)
        return record

    def logs(self, tenant: TenantRecord, job_id: str, *, attempt: int | None,
             offset: int) -> bytes:
        """One attempt's log from `offset`, or every attempt's log with a header each."""
        record = self._repo.get_job(tenant.id, job_id)  # 404 for another tenant's job
        if attempt is not None:
            return self._artifacts.read_log(tenant.id, record.id, attempt, offset)
        parts = []
        for n in self._artifacts.log_attempts(tenant.id, record.id):
            parts.append(f"=== attempt {n} ===\n".encode())
            parts.append(self._artifacts.read_log(tenant.id, record.id, n))
        return b"".join(parts)

    def outputs(self, tenant: TenantRecord, job_id: str) -> builtins.list[dict[str, Any]]:
        record = self._repo.get_job(tenant.id, job_id)
        return self._artifacts.list_outputs(tenant.id, record.id)

    def open_output(self, tenant: TenantRecord, job_id: str, path: str) -> IO[bytes]:
        record = self._repo.get_job(tenant.id, job_id)
        return self._artifacts.open_output(tenant.id, record.id, path)

    def usage(self, tenant: TenantRecord, *, all_tenants: bool) -> builtins.list[dict[str, Any]]:
        if all_tenants and not tenant.admin:
            raise AuthError("usage of all tenants needs an admin token")
        rows = self._repo.usage(None if all_tenants else tenant.id, now=utcnow())
        return [r.to_dict() for r in rows]
