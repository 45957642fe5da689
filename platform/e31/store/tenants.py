"""Tenants' fair-share settings (weight, quotas) and decayed usage, on a session `Repo` opens.

Usage is billed per attempt, in the transaction that ends it (`Repo._end_attempt`): the
tenant's `UsageState` (two columns) is brought to now with the half-life and the attempt's
GPU-seconds are added, so no tick ever scans jobs to account for usage.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from e31.errors import NotFound, SpecError
from e31.store.models import Tenant
from e31.store.records import TenantRecord
from e31.usage import UsageState

MAX_QUOTA_GPUS = 1_000_000   # a typo guard, far above any pool


def record(t: Tenant) -> TenantRecord:
    return TenantRecord(id=t.id, name=t.name, admin=bool(t.admin), weight=t.weight,
                        quotas=dict(t.quotas or {}))


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
           drop: Sequence[str]) -> TenantRecord:
    """Change a tenant's weight, set quotas and drop others; the rest stays."""
    tenant = s.scalar(select(Tenant).where(Tenant.name == name).with_for_update())
    if tenant is None:
        raise NotFound(f"no tenant named {name!r}")
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
    tenant = s.scalar(select(Tenant).where(Tenant.id == tenant_id).with_for_update())
    if tenant is None:
        return
    state = UsageState(tenant.usage_gpu_s, tenant.usage_at.timestamp() if tenant.usage_at else 0.0)
    new = state.plus(gpu_s, now.timestamp(), half_life_s)
    tenant.usage_gpu_s = new.value_gpu_s
    tenant.usage_at = max(now, tenant.usage_at) if tenant.usage_at else now

