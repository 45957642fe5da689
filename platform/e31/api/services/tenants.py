"""The tenants and the audit log, for admin tokens only (the admin API,
`e31.api.routes.tenants`).

Every check is made here, before the store is asked: a token that is not an admin's is refused
(`Forbidden`, 403), and an admin may not disable its own tenant (`Conflict`, 409: it would lock
itself out). What only the store knows answers from there: no such tenant (404), a name taken
(409). Every change is written to the audit log with who asked (`Actor`), in the transaction
that makes the change.
"""

from __future__ import annotations

import builtins
from datetime import datetime
from typing import Any

from e31.core.clock import utcnow
from e31.core.errors import Conflict, Forbidden
from e31.core.records import Actor, AuditRecord, TenantRecord
from e31.store import Repo


def admin_only(caller: TenantRecord) -> None:
    """`Forbidden` unless `caller` holds an admin's token."""
    if not caller.admin:
        raise Forbidden("this needs an admin token")


class TenantService:
    """The tenants of the pool and its audit log, over one store."""

    def __init__(self, *, repo: Repo) -> None:
        self._repo = repo

    def list(self, caller: TenantRecord) -> builtins.list[TenantRecord]:
        admin_only(caller)
        return self._repo.list_tenants()

    def create(self, caller: TenantRecord, name: str, *, admin: bool, weight: float,
               quotas: dict[str, int], limits: dict[str, Any],
               actor: Actor) -> tuple[TenantRecord, str]:
        """A new tenant and its first token (named default), shown this once."""
        admin_only(caller)
        return self._repo.create_tenant(name, admin=admin, now=utcnow(), weight=weight,
                                        quotas=quotas, limits=limits, actor=actor)

    def get(self, caller: TenantRecord, name: str) -> TenantRecord:
        admin_only(caller)
        return self._repo.get_tenant(name)

    def update(self, caller: TenantRecord, name: str, *, weight: float | None,
               quotas: dict[str, int], drop_quotas: builtins.list[str],
               limits: dict[str, Any] | None, actor: Actor) -> TenantRecord:
        """Change the weight, quotas (`drop_quotas` drops some) and limits (None: unchanged);
        what is not given stays."""
        admin_only(caller)
        return self._repo.update_tenant(name, weight=weight, quotas=quotas,
                                        drop_quotas=drop_quotas, limits=limits, now=utcnow(),
                                        actor=actor)

    def set_disabled(self, caller: TenantRecord, name: str, *, disabled: bool,
                     actor: Actor) -> TenantRecord:
        """Disable the tenant (its tokens refused, its queued jobs held) or enable it again;
        an admin cannot disable its own tenant."""
        admin_only(caller)
        if disabled and name == caller.name:
            raise Conflict("an admin cannot disable its own tenant (it would lock itself out)")
        return self._repo.set_tenant_disabled(name, disabled=disabled, now=utcnow(),
                                              actor=actor)

    def audit(self, caller: TenantRecord, *, since: datetime | None,
              limit: int) -> builtins.list[AuditRecord]:
        """The newest `limit` lines of the audit log at or after `since`, oldest first."""
        admin_only(caller)
        return self._repo.audit_log(since=since, limit=limit)
