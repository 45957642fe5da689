"""The audit log: every admin action, token change and secret change (its name, never its
value), on a session a store opens (`TenantStore`'s, for a change and its line together).

Each change writes its line in the transaction that makes it, so a change and its line are
stored together or not at all. A line says who (the tenant and key over the API, `local` for
the CLI on the store), what (`action`, `target`, `detail`), when and from where (the client's
address). Lines are never updated or deleted by E31 itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from e31.core.records import Actor, AuditRecord
from e31.store.models import AuditEvent

READ_LIMIT_MAX = 10_000
SOURCE_MAX = 100       # a client address as the column holds it
TARGET_MAX = 200


def write(s: Session, actor: Actor, action: str, target: str, *, now: datetime,
          detail: Mapping[str, Any] | None = None) -> None:
    s.add(AuditEvent(at=now, actor=actor.name[:100], actor_key=actor.key_id, action=action,
                     target=target[:TARGET_MAX],
                     source=actor.source[:SOURCE_MAX] if actor.source else None,
                     detail=dict(detail) if detail else None))


def read(s: Session, *, since: datetime | None, limit: int) -> list[AuditRecord]:
    """The newest `limit` lines at or after `since`, oldest first."""
    q = select(AuditEvent)
    if since is not None:
        q = q.where(AuditEvent.at >= since)
    rows = list(s.scalars(q.order_by(AuditEvent.at.desc(), AuditEvent.id.desc())
                          .limit(min(max(limit, 1), READ_LIMIT_MAX))))
    return [AuditRecord(id=r.id, at=r.at, actor=r.actor, actor_key=r.actor_key, action=r.action,
                        target=r.target, source=r.source, detail=r.detail)
            for r in reversed(rows)]
