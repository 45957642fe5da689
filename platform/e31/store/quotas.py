"""What jobs leave behind: tenants' outputs quota and running total, and which ended jobs'
artifacts `e31 gc` may remove (docs/security.md, "Limits and quotas").

A mixin of `Repo` (which supplies `_session`), so there is one repository to pass around.
A tenant's `outputs_bytes` is a running total: the worker charges the bytes it is about to
store (and refunds what it could not store), `e31 gc` refunds what it removed. So a quota
check reads one row, never sums a tenant's files.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from e31.core.errors import NotFound, SpecError
from e31.store.models import Job, Tenant

MAX_OUTPUTS_BYTES = 1 << 62   # a typo guard: no store holds this much


@dataclass(frozen=True)
class OutputsCharge:
    """What `charge_outputs` granted: one flag per asked delta, the tenant's cap and total."""

    accepted: list[bool]
    max_bytes: int          # the tenant's own cap, else the pool's default
    used_bytes: int         # the tenant's total after the charge


@dataclass(frozen=True)
class OutputsQuota:
    """A tenant's outputs quota as `e31 tenant update` shows it."""

    tenant: str
    max_bytes: int | None   # None: the pool's `tenant_outputs_max_bytes`
    used_bytes: int


@dataclass(frozen=True)
class EndedJob:
    """A job that ended and whose artifacts are still kept."""

    id: str
    tenant_id: str
    ended_at: datetime


class QuotaQueries:
    """The outputs-quota and retention part of `Repo`."""

    def _session(self, *, write: bool = False) -> AbstractContextManager[Session]:
        raise NotImplementedError

    def charge_outputs(self, tenant_id: str, deltas_bytes: Sequence[int], *,
                       default_max_bytes: int, force: bool = False) -> OutputsCharge:
        """Add each delta to the tenant's outputs total, in order, if the total stays within
        its cap (the tenant's own, else `default_max_bytes`); a delta <= 0 (a refund, a file
        replaced by a smaller one) is always taken, and every delta with `force` (bytes that
        are stored already). One row-locked transaction, so the concurrent charges of one
        tenant's jobs add up and none is lost."""
        with self._session(write=True) as s:
            tenant = s.scalar(select(Tenant).where(Tenant.id == tenant_id).with_for_update())
            if tenant is None:
                raise NotFound(f"no tenant {tenant_id!r}")
            cap = default_max_bytes if tenant.outputs_max_bytes is None \
                else tenant.outputs_max_bytes
            total = tenant.outputs_bytes or 0
            accepted = []
            for delta in deltas_bytes:
                ok = force or delta <= 0 or total + delta <= cap
                if ok:
                    total = max(0, total + delta)
                accepted.append(ok)
            tenant.outputs_bytes = total
            return OutputsCharge(accepted=accepted, max_bytes=cap, used_bytes=total)

    def set_outputs_quota(self, name: str, max_bytes: int | None) -> OutputsQuota:
        """Give a tenant its own outputs cap in bytes (0: no outputs), or None for the pool's."""
        if max_bytes is not None and not 0 <= max_bytes <= MAX_OUTPUTS_BYTES:
            raise SpecError.one("outputs_max_bytes", "must be a whole number of bytes >= 0")
        with self._session(write=True) as s:
            tenant = s.scalar(select(Tenant).where(Tenant.name == name).with_for_update())
            if tenant is None:
                raise NotFound(f"no tenant named {name!r}")
            tenant.outputs_max_bytes = max_bytes
            return OutputsQuota(tenant.name, max_bytes, tenant.outputs_bytes or 0)

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
            if tenant_id is None or freed_outputs_bytes <= 0:
                return
            tenant = s.scalar(select(Tenant).where(Tenant.id == tenant_id).with_for_update())
            if tenant is not None:
                tenant.outputs_bytes = max(0, (tenant.outputs_bytes or 0) - freed_outputs_bytes)
