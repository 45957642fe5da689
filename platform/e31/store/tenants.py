"""Tenants' fair-share settings (weight, quotas), limits, whether they are enabled, and decayed
usage, on a session `Repo` opens.

Usage is billed per attempt, in the transaction that ends it (`Repo._end_attempt`): the
tenant's `UsageState` (two columns) is brought to now with the half-life and the attempt's
GPU-seconds are added, so no tick ever scans jobs to account for usage.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy import update as sql_update
from sqlalchemy.orm import Session

from e31.core.errors import NotFound, SpecError
from e31.core.limits import check_limits
from e31.core.records import TenantRecord
from e31.core.usage import UsageState
from e31.store.models import Job, Tenant

MAX_QUOTA_GPUS = 1_000_000   # a typo guard, far above any pool
TENANT_DISABLED = "tenant_disabled"   # the pending reason (e31.scheduling.fairshare.Reason)


def record(t: Tenant) -> TenantRecord:
    return TenantRecord(id=t.id, name=t.name, admin=bool(t.admin), weight=t.weight,
                        quotas=dict(t.quotas or {}), disabled_at=t.disabled_at,
                        limits=dict(t.limits or {}))


def find(s: Session, name: str, *, lock: bool = False) -> Tenant:
    """The tenant named `name` (NotFound otherwise), row-locked if asked."""
    q = select(Tenant).where(Tenant.name == name)
    tenant = s.scalar(q.with_for_update() if lock else q)
    if tenant is None:
        raise NotFound(f"no tenant named {name!r}")
    return tenant


def listed(s: Session) -> list[TenantRecord]:
    return [record(t) for t in s.scalars(select(Tenant).order_by(Tenant.name))]


def set_disabled(s: Session, name: str, *, disabled: bool, now: datetime) -> TenantRecord:
    """Disable (its tokens refused, its queued jobs held) or enable a tenant; doing it twice
    changes nothing (a disabled tenant keeps the time it was first disabled)."""
    tenant = find(s, name, lock=True)
    if disabled and tenant.disabled_at is None:
        tenant.disabled_at = now
    elif not disabled:
        tenant.disabled_at = None
        # The reason the scheduler stored while it was disabled is stale from now on (its
        # next tick writes the present one): cleared here, so no status says it meanwhile.
        s.execute(sql_update(Job).where(Job.tenant_id == tenant.id,
                                        Job.pending_reason == TENANT_DISABLED)
                  .values(pending_reason=None, pending_detail=None))
    s.flush()
    return record(tenant)


def check_weight(weight: float) -> float:
    if not (isinstance(weight, int | float) and math.isfinite(weight) and weight > 0):
        raise SpecError.one("weight", "must be a positive number")
    return float(weight)


def check_quotas(quotas: Mapping[str, int], classes: Sequence[str] | None) -> dict[str, int]:
    """Quotas by size class: whole GPUs >= 0 of a known class (0 holds the class back)."""
    out: dict[str, int] = {}
    for cls, gpus in quotas.items():
        if classes is not None and cls not in classes:
            raise SpecError.one(f"quota.{cls}", f"unknown size class; known: {', '.join(classes)}")
        if isinstance(gpus, bool) or not isinstance(gpus, int) or not 0 <= gpus <= MAX_QUOTA_GPUS:
            raise SpecError.one(f"quota.{cls}", "must be a whole number of GPUs >= 0")
        out[cls] = gpus
    return out


def update(s: Session, name: str, *, weight: float | None, quotas: Mapping[str, int],
           drop: Sequence[str], limits: Mapping[str, Any] | None = None) -> TenantRecord:
    """Change a tenant's weight, set quotas and drop others, and set limits (a limit given as
    None returns to the pool's default); the rest stays."""
    tenant = find(s, name, lock=True)
    if limits is not None:
        checked = check_limits(limits)
        merged_limits = {k: v for k, v in {**(tenant.limits or {}), **checked}.items()
                         if k not in limits or limits[k] is not None}
        tenant.limits = dict(sorted(merged_limits.items())) or None
    if weight is not None:
        tenant.weight = check_weight(weight)
    merged = {**(tenant.quotas or {}), **quotas}
    for cls in drop:
        merged.pop(cls, None)
    tenant.quotas = dict(sorted(merged.items())) or None
    s.flush()
    return record(tenant)


def bill(s: Session, tenant_id: str, gpu_s: float, *, now: datetime, half_life_s: float) -> None:
    """Add an attempt's GPU-seconds to the tenant's decayed usage (row-locked: concurrent
    ends of the same tenant's attempts add up, none is lost)."""
    if gpu_s <= 0:
        return
    # FOR NO KEY UPDATE, the lock the UPDATE below takes anyway. FOR UPDATE would also wait on
    # KEY SHARE locks: an outcome updates its job row twice, and PostgreSQL re-checks the
    # foreign keys of a row its own transaction updated, share-locking the tenant's row; two
    # ends of one tenant's attempts then deadlocked (tests/integration/test_concurrent_outcomes.py).
    tenant = s.scalar(select(Tenant).where(Tenant.id == tenant_id)
                      .with_for_update(key_share=True))
    if tenant is None:
        return
    state = UsageState(tenant.usage_gpu_s, tenant.usage_at.timestamp() if tenant.usage_at else 0.0)
    new = state.plus(gpu_s, now.timestamp(), half_life_s)
    tenant.usage_gpu_s = new.value_gpu_s
    tenant.usage_at = max(now, tenant.usage_at) if tenant.usage_at else now

