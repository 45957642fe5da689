"""GPU-seconds used, per tenant and size class (`GET /v1/usage`, `e31.api.routes.usage`): the
caller's own, or every tenant's for an admin's token. Queue time is never billed.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from e31.core.clock import utcnow
from e31.core.errors import Forbidden
from e31.core.records import TenantRecord
from e31.store import Repo

BATCHES_SHOWN = 20     # the newest batches a usage answer lists
DAYS_MAX = 31          # the longest window of the usage per day


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

    def by_day(self, tenant: TenantRecord, *, all_tenants: bool,
               days: int) -> list[dict[str, Any]]:
        """Per UTC day of the last `days` (today included), tenant and class: the jobs that
        ended, their GPU-seconds and queued seconds (as `usage` chooses whose)."""
        if all_tenants and not tenant.admin:
            raise Forbidden("usage of all tenants needs an admin token")
        days = min(max(days, 1), DAYS_MAX)
        now = utcnow()
        since = now.replace(hour=0, minute=0, second=0, microsecond=0) - timedelta(days=days - 1)
        return self._repo.usage_by_day(None if all_tenants else tenant.id, since=since)

    def batches(self, tenant: TenantRecord, *, all_tenants: bool) -> list[dict[str, Any]]:
        """The latest batches' requests, tokens and GPU-seconds (as `usage` chooses whose)."""
        if all_tenants and not tenant.admin:
            raise Forbidden("usage of all tenants needs an admin token")
        return self._repo.batch_usage(None if all_tenants else tenant.id, limit=BATCHES_SHOWN)
