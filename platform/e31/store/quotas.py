"""Tenants' outputs quota and running total: its statements, on a session a store opens
(docs/security.md, "Limits and quotas").

A tenant's `outputs_bytes` is a running total: the worker charges the bytes it is about to
store and refunds what it could not store (`charge`, through `AttemptStore.charge_outputs`),
`e31 gc` refunds what it removed (`refund`, through `JobStore.mark_artifacts_removed`), an
admin sets the cap (`set_cap`, through `TenantStore.set_outputs_quota`). So a quota check
reads one row, never sums a tenant's files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from e31.core.errors import NotFound, SpecError
from e31.store.models import Tenant

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


def charge(s: Session, tenant_id: str, deltas_bytes: Sequence[int], *,
           default_max_bytes: int, force: bool) -> OutputsCharge:
    """Add each delta to the tenant's outputs total, in order, if the total stays within its
    cap (the tenant's own, else `default_max_bytes`); a delta <= 0 is always taken, and every
    delta with `force`. The tenant's row is locked, so the concurrent charges of one tenant's
    jobs add up and none is lost."""
    tenant = s.scalar(select(Tenant).where(Tenant.id == tenant_id).with_for_update())
    if tenant is None:
        raise NotFound(f"no tenant {tenant_id!r}")
    cap = default_max_bytes if tenant.outputs_max_bytes is None else tenant.outputs_max_bytes
    total = tenant.outputs_bytes or 0
    accepted = []
    for delta in deltas_bytes:
        ok = force or delta <= 0 or total + delta <= cap
        if ok:
            total = max(0, total + delta)
        accepted.append(ok)
    tenant.outputs_bytes = total
    return OutputsCharge(accepted=accepted, max_bytes=cap, used_bytes=total)


def check_cap(max_bytes: int | None) -> None:
    """Refuse a cap no store could mean (checked before the transaction opens)."""
    if max_bytes is not None and not 0 <= max_bytes <= MAX_OUTPUTS_BYTES:
        raise SpecError.one("outputs_max_bytes", "must be a whole number of bytes >= 0")


def set_cap(s: Session, name: str, max_bytes: int | None) -> OutputsQuota:
    """Give the tenant named `name` its own outputs cap in bytes (0: no outputs), or None for
    the pool's (`check_cap` first)."""
    tenant = s.scalar(select(Tenant).where(Tenant.name == name).with_for_update())
    if tenant is None:
        raise NotFound(f"no tenant named {name!r}")
    tenant.outputs_max_bytes = max_bytes
    return OutputsQuota(tenant.name, max_bytes, tenant.outputs_bytes or 0)


def refund(s: Session, tenant_id: str, freed_bytes: int) -> None:
    """Give `freed_bytes` back to the tenant's total (never below 0; row-locked)."""
    if freed_bytes <= 0:
        return
    tenant = s.scalar(select(Tenant).where(Tenant.id == tenant_id).with_for_update())
    if tenant is not None:
        tenant.outputs_bytes = max(0, (tenant.outputs_bytes or 0) - freed_bytes)
