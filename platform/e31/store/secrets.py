"""Tenants' secrets in the store: names, dates and Fernet ciphertexts (`e31.edge.secrets`
encrypts and decrypts; the store never sees a value). Every statement on secrets, on a session
a store opens: `TenantStore` sets, lists, deletes and checks them for the API and the CLI;
`AttemptStore.secret_ciphertexts` reads the ciphertexts, for the worker alone.

Every query is scoped by the tenant: another tenant's secret of the same name is a different
row, and one the tenant lacks is missing, whoever else has it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from e31.core.errors import NotFound
from e31.core.records import Actor
from e31.store import audit
from e31.store.models import Secret, Tenant


@dataclass(frozen=True)
class SecretInfo:
    """What a tenant may read back of its secret: its name and dates, never its value."""

    name: str
    created_at: datetime
    updated_at: datetime

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "created_at": self.created_at.isoformat(),
                "updated_at": self.updated_at.isoformat()}


def put(s: Session, tenant_id: str, name: str, ciphertext: str, *, now: datetime,
        actor: Actor) -> tuple[SecretInfo, bool]:
    """Store (or replace) a tenant's secret; returns it and whether it is new. The audit log
    gets `secret.set` with the name, never the value."""
    row = s.scalar(select(Secret).where(Secret.tenant_id == tenant_id,
                                        Secret.name == name).with_for_update())
    created = row is None
    if row is None:
        row = Secret(tenant_id=tenant_id, name=name, ciphertext=ciphertext,
                     created_at=now, updated_at=now)
        s.add(row)
    else:
        row.ciphertext, row.updated_at = ciphertext, now
    s.flush()
    audit.write(s, actor, "secret.set", _target(s, tenant_id, name), now=now,
                detail={"created": created})
    return SecretInfo(row.name, row.created_at, row.updated_at), created


def listed(s: Session, tenant_id: str) -> list[SecretInfo]:
    rows = s.execute(select(Secret.name, Secret.created_at, Secret.updated_at)
                     .where(Secret.tenant_id == tenant_id).order_by(Secret.name)).all()
    return [SecretInfo(n, c, u) for n, c, u in rows]


def remove(s: Session, tenant_id: str, name: str, *, now: datetime, actor: Actor) -> None:
    """Remove a tenant's secret (`NotFound` when it has none of that name); the audit log gets
    `secret.delete`."""
    gone = s.execute(delete(Secret).where(Secret.tenant_id == tenant_id,
                                          Secret.name == name).returning(Secret.name))
    if gone.first() is None:
        raise NotFound(f"no secret named {name!r}")
    audit.write(s, actor, "secret.delete", _target(s, tenant_id, name), now=now)


def present(s: Session, tenant_id: str, names: Sequence[str]) -> set[str]:
    """Those of `names` the tenant has set."""
    return set(s.scalars(select(Secret.name).where(Secret.tenant_id == tenant_id,
                                                   Secret.name.in_(list(names)))))


def ciphertexts(s: Session, tenant_id: str, names: Sequence[str]) -> dict[str, str]:
    """The ciphertexts of the tenant's secrets among `names`; a name it lacks is absent."""
    return {n: c for n, c in s.execute(
        select(Secret.name, Secret.ciphertext).where(Secret.tenant_id == tenant_id,
                                                     Secret.name.in_(list(names))))}


def _target(s: Session, tenant_id: str, name: str) -> str:
    """An audit line's target, `tenant/NAME`, as the token lines name theirs."""
    return f"{s.scalar(select(Tenant.name).where(Tenant.id == tenant_id))}/{name}"
