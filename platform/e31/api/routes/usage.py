"""`GET /v1/usage`: GPU-seconds per tenant and size class, and per batch of requests to a
language model its requests, tokens in and out and GPU-seconds (`e31.api.services.usage`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from e31.api import errors
from e31.api.auth import Caller
from e31.api.requestlimits import QueryBool
from e31.api.services.usage import UsageService


def router(svc: UsageService) -> APIRouter:
    """The `/v1/usage` route."""
    r = APIRouter()

    @r.get("/v1/usage", tags=["usage"], responses=errors.responses(401, 403, 422, 503))
    def usage(t: Caller, all_tenants: Annotated[QueryBool, Query(
            description="every tenant's usage: an admin's token only (403 otherwise)")] = False,
              ) -> dict[str, Any]:
        return {"usage": svc.usage(t, all_tenants=all_tenants),
                "batches": svc.batches(t, all_tenants=all_tenants)}

    return r
