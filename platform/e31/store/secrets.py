"""Tenants' secrets in the store: names, dates and Fernet ciphertexts (`e31.edge.secrets` encrypts
and decrypts; the store never sees a value). A mixin of `Repo` (which supplies `_session`).

Every query is scoped by the tenant: another tenant's secret of the same name is a different
row, and one the tenant lacks is missing, whoever else has it.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from e31.core.errors import NotFound
from e31.core.records import LOCAL_ACTOR, Actor
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


class SecretQueries:
    """The secrets' part of `Repo`."""

    def _session(self, *, write: bool = False) -> AbstractContextManager[Session]:
        raise NotImplementedError

    def put_secret(self, tenant_id: str, name: str, ciphertext: str, *, now: datetime,
                   actor: Actor = LOCAL_ACTOR) -> tuple[SecretInfo, bool]:
        """Store (or replace) a tenant's secret; returns it and whether it is new. The audit
        log gets `secret.set` with the name, never the value."""
        with self._session(write=True) as s:
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

    def list_secrets(self, tenant_id: str) -> list[SecretInfo]:
        with self._session() as s:
            rows = s.execute(select(Secret.name, Secret.created_at, Secret.updated_at)
                             .where(Secret.tenant_id == tenant_id).order_by(Secret.name)).all()
            return [SecretInfo(n, c, u) for n, c, u in rows]

    def delete_secret(self, tenant_id: str, name: str, *, now: datetime,
                      actor: Actor = LOCAL_ACTOR) -> None:
        """Remove a tenant's secret (`NotFound` when it has none of that name); the audit log
        gets `secret.delete`."""
        with self._session(write=True) as s:
            gone = s.execute(delete(Secret).where(Secret.tenant_id == tenant_id,
                                                  Secret.name == name).returning(Secret.name))
            if gone.first() is None:
                raise NotFound(f"no secret named {name!r}")
            audit.write(s, actor, "secret.delete", _target(s, tenant_id, name), now=now)

    def missing_secrets(self, tenant_id: str, names: Sequence[str]) -> list[str]:
        """Those of `names` the tenant has not set, in their order."""
        if not names:
            return []
        with self._session() as s:
            have = set(s.scalars(select(Secret.name).where(Secret.tenant_id == tenant_id,
                                                           Secret.name.in_(list(names)))))
        return [n for n in names if n not in have]

    def secret_ciphertexts(self, tenant_id: str, names: Sequence[str]) -> dict[str, str]:
        """The ciphertexts of the tenant's secrets among `names` (a worker decrypts them for
        the attempt it starts); a name the tenant lacks is absent."""
        if not names:
            return {}
        with self._session() as s:
            return {n: c for n, c in s.execute(
                select(Secret.name, Secret.ciphertext).where(Secret.tenant_id == tenant_id,
                                                             Secret.name.in_(list(names))))}


def _target(s: Session, tenant_id: str, name: str) -> str:
    """An audit line's target, `tenant/NAME`, as the token lines name theirs."""
    return f"{s.scalar(select(Tenant.name).where(Tenant.id == tenant_id))}/{name}"
