"""GPU-seconds used, per tenant and size class (`GET /v1/usage`, `e31.api.routes.usage`): the
caller's own, or every tenant's for an admin's token. Queue time is never billed.
"""

from __future__ import annotations

from typing import Any

from e31.core.clock import utcnow
from e31.core.errors import Forbidden
from e31.core.records import TenantRecord
from e31.store import Repo

BATCHES_SHOWN = 20     # the newest batches a usage answer lists


class UsageService:
    """The usage of each tenant, over one store."""

    def __init__(self, *, repo: Repo) -> None:
        self._repo = repo

    def usage(self, tenant: TenantRecord, *, all_tenants: bool) -> list[dict[str, Any]]:
        """The tenant's usage rows, or (`all_tenants`, an admin's token only) everyone's."""
        if all_tenants and not tenant.admin:
            raise Forbidden("usage of all tenants needs an admin token")
        rows = self._repo.usage(None if all_tenants else tenant.id, now=utcnow())
        return [r.to_dict() for r in rows]

    def batches(self, tenant: TenantRecord, *, all_tenants: bool) -> list[dict[str, Any]]:
        """The latest batches' requests, tokens and GPU-seconds (as `usage` chooses whose)."""
        if all_tenants and not tenant.admin:
            raise Forbidden("usage of all tenants needs an admin token")
        return self._repo.batch_usage(None if all_tenants else tenant.id, limit=BATCHES_SHOWN)
