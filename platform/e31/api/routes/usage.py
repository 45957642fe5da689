"""`GET /v1/usage`: GPU-seconds per tenant and size class, and per batch of requests to a
language model its requests, tokens in and out and GPU-seconds (`e31.api.services.usage`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from e31.api import errors
from e31.api.auth import Caller
from e31.api.requestlimits import DIGITS, QueryBool
from e31.api.services.usage import DAYS_MAX, UsageService


def router(svc: UsageService) -> APIRouter:
    """The `/v1/usage` routes: totals, and per day."""
    r = APIRouter()

    @r.get("/v1/usage", tags=["usage"], responses=errors.responses(401, 403, 422, 503))
    def usage(t: Caller, all_tenants: Annotated[QueryBool, Query(
            description="every tenant's usage: an admin's token only (403 otherwise)")] = False,
              ) -> dict[str, Any]:
        return {"usage": svc.usage(t, all_tenants=all_tenants),
                "batches": svc.batches(t, all_tenants=all_tenants)}

    @r.get("/v1/usage/daily", tags=["usage"], responses=errors.responses(401, 403, 422, 503))
    def usage_daily(t: Caller, all_tenants: Annotated[QueryBool, Query(
            description="every tenant's usage: an admin's token only (403 otherwise)")] = False,
                    days: Annotated[int, Query(ge=1, le=DAYS_MAX, description=(
                        "UTC days back, today included")), DIGITS] = 7) -> dict[str, Any]:
        """Per day, tenant and size class: the jobs that ended, their GPU-seconds and the
        time they spent queued."""
        return {"days": svc.by_day(t, all_tenants=all_tenants, days=days)}

    return r
