"""The store's part of the limits per tenant (e31.core.tenantlimits): its most queued jobs,
held under the same write transaction that inserts new ones.

`hold_queued` locks the tenant's row (PostgreSQL: `SELECT … FOR UPDATE`; SQLite's write
transactions are `BEGIN IMMEDIATE` already) and counts its queued jobs, so two submits racing
at `max_queued - 1` are serialised: the second sees the first's job and is refused.
"""

from __future__ import annotations

from sqlalchemy import Connection, bindparam, func, select
from sqlalchemy.orm import Session

from e31.core.errors import LimitExceeded, NotFound
from e31.core.states import JobState
from e31.store.db import core_of
from e31.store.models import Job, Tenant

QUEUED_RETRY_AFTER_S = 30   # what a refusal at max_queued suggests: jobs start in about that


def hold_queued(s: Session | Connection, tenant_id: str, *, adding: int, max_queued: int) -> str:
    """Lock the tenant's row and refuse (`LimitExceeded`, 429) when `adding` more queued jobs
    would take it past `max_queued`; returns the tenant's name. Call it inside the transaction
    that inserts them."""
    core = core_of(s)   # Core reads of bound statements: every submit makes them
    name = core.scalar(_LOCK_TENANT, {"tenant_id": tenant_id})
    if name is None:
        raise NotFound(f"no tenant {tenant_id!r}")
    queued = core.scalar(_QUEUED, {"tenant_id": tenant_id}) or 0
    if queued + adding > max_queued:
        raise LimitExceeded(
            f"tenant {name} has {queued} jobs queued and asks for {adding} more; at most "
            f"{max_queued} (limits.max_queued): wait for some to start, cancel some, or ask an "
            "admin", retry_after_s=QUEUED_RETRY_AFTER_S)
    return str(name)


# Every submit's two reads, built once (issue 31)
_LOCK_TENANT = (select(Tenant.name).where(Tenant.id == bindparam("tenant_id"))
                .with_for_update())
_QUEUED = select(func.count()).select_from(Job).where(
    Job.tenant_id == bindparam("tenant_id"), Job.state == JobState.QUEUED.value)
