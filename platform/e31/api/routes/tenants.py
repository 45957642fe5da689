"""`/v1/admin/...`: the admin API, tenants and the audit log, for admin tokens only (403
otherwise; `e31.api.services.tenants`).

Every change is written to the audit log with who asked (the tenant and key of the token), what,
when and from where (the client's address), in the transaction that makes the change.
Bodies are typed strictly and their models carry this pool's size classes and the limits'
ranges (`e31.core.tenantlimits`), so the OpenAPI document says exactly what is taken; what only the
store knows answers 404 (no such tenant) or 409 (a name taken; an admin disabling itself).
"""

# No `from __future__ import annotations`: the routes' annotations name models made inside
# `_tenant_routes` (they carry the pool's size classes), which FastAPI must see as objects.
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from e31.api import errors
from e31.api.auth import Caller, actor
from e31.api.requestlimits import DIGITS
from e31.api.routes.fields import ISO_TIME, WHOLE, Name, TenantName
from e31.api.services.tenants import TenantService
from e31.core.tenantlimits import (
    MAX_ARRAY_ITEMS_CAP,
    MAX_PRIORITY,
    MAX_QUEUED_CAP,
    MAX_RATE_PER_S,
    MAX_REQUEST_BYTES_CAP,
)
from e31.edge.settings import Settings
from e31.store.tenants import MAX_QUOTA_GPUS

AUDIT_LIMIT_MAX = 10_000
AUDIT_LIMIT_DEFAULT = 1000
# The smallest max_request_bytes an admin may set (e31.core.tenantlimits).
REQUEST_MIN_BYTES = 1024

# Whole numbers in their ranges (the bounds inside the Annotated, so the document states them).
Priority = Annotated[int, Field(ge=0, le=MAX_PRIORITY), WHOLE]
Queued = Annotated[int, Field(ge=0, le=MAX_QUEUED_CAP), WHOLE]
ArrayItems = Annotated[int, Field(ge=1, le=MAX_ARRAY_ITEMS_CAP), WHOLE]
RequestBytes = Annotated[int, Field(ge=REQUEST_MIN_BYTES, le=MAX_REQUEST_BYTES_CAP), WHOLE]
Burst = Annotated[int, Field(ge=1, le=int(MAX_RATE_PER_S)), WHOLE]
Rate = Annotated[float, Field(gt=0, le=MAX_RATE_PER_S)]
Quota = Annotated[int, Field(ge=0, le=MAX_QUOTA_GPUS), WHOLE]


class Limits(BaseModel):
    """A tenant's own limits over the pool's defaults (docs/configuration.md); null returns a
    limit to the default."""

    model_config = ConfigDict(extra="forbid", strict=True)
    max_priority: Priority | None = None
    max_queued: Queued | None = None
    max_array_items: ArrayItems | None = None
    max_request_bytes: RequestBytes | None = None
    submit_rate_per_s: Rate | None = None
    submit_burst: Burst | None = None


class TenantOut(BaseModel):
    tenant: str
    admin: bool
    weight: float
    quotas: dict[str, int]
    disabled: bool
    disabled_at: str | None
    limits: dict[str, Any]


class TenantCreated(TenantOut):
    token: str = Field(description="the first token (named default): shown this once")


class TenantList(BaseModel):
    tenants: list[TenantOut]


class AuditOut(BaseModel):
    id: int
    at: str
    actor: str = Field(description="the tenant whose token asked, or local (the CLI on the store)")
    actor_key: str | None
    action: str
    target: str
    source: str | None = Field(description="the client's address")
    detail: dict[str, Any] | None


class AuditList(BaseModel):
    events: list[AuditOut]


def router(settings: Settings, svc: TenantService) -> APIRouter:
    """`/v1/admin/tenants` and `/v1/admin/audit`, with the size classes of `settings`."""
    r = APIRouter()
    _tenant_routes(r, settings, svc)
    _state_routes(r, svc)
    return r


def _tenant_routes(r: APIRouter, settings: Settings, svc: TenantService) -> None:
    """List, create, read and change tenants; the bodies' quotas name this pool's size
    classes."""
    size_class = Literal[tuple(c.name for c in settings.size_classes)]  # type: ignore[valid-type]

    class NewTenant(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        name: Name
        admin: bool = Field(default=False, description="may manage tenants and read the audit")
        weight: float = Field(default=1.0, gt=0, description="fair-share weight")
        quotas: dict[size_class, Quota] = Field(  # type: ignore[valid-type]
            default_factory=dict, description="size class -> most GPUs at once")
        limits: Limits = Field(default_factory=Limits)

    class TenantChange(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        weight: float | None = Field(default=None, gt=0)
        quotas: dict[size_class, Quota | None] | None = Field(  # type: ignore[valid-type]
            default=None, description="size class -> most GPUs at once; null drops the quota")
        limits: Limits | None = None

    @r.get("/v1/admin/tenants", tags=["admin"], response_model=TenantList,
           responses=errors.responses(401, 403, 503))
    def list_tenants(t: Caller) -> dict[str, Any]:
        return {"tenants": [x.to_dict() for x in svc.list(t)]}

    @r.post("/v1/admin/tenants", status_code=201, tags=["admin"], response_model=TenantCreated,
            responses=errors.responses(401, 403, 409, 413, 422, 503))
    def create_tenant(body: NewTenant, t: Caller, request: Request) -> dict[str, Any]:
        """A new tenant and its first token (named default), shown this once; it expires
        when the admin token that asks does, if that one expires."""
        record, token = svc.create(
            t, body.name, admin=body.admin, weight=body.weight, quotas=dict(body.quotas),
            limits=body.limits.model_dump(exclude_none=True), actor=actor(request, t))
        return {**record.to_dict(), "token": token}

    @r.get("/v1/admin/tenants/{name}", tags=["admin"], response_model=TenantOut,
           responses=errors.responses(401, 403, 404, 422, 503))
    def get_tenant(name: TenantName, t: Caller) -> dict[str, Any]:
        return svc.get(t, name).to_dict()

    @r.patch("/v1/admin/tenants/{name}", tags=["admin"], response_model=TenantOut,
             responses=errors.responses(401, 403, 404, 413, 422, 503))
    def update_tenant(name: TenantName, body: TenantChange, t: Caller,
                      request: Request) -> dict[str, Any]:
        """Change the weight, quotas (null drops one) and limits (null returns one to the
        pool's default); what is not given stays."""
        quotas = body.quotas or {}
        limits = body.limits.model_dump(exclude_unset=True) if body.limits is not None else None
        return svc.update(
            t, name, weight=body.weight, quotas={c: n for c, n in quotas.items() if n is not None},
            drop_quotas=[c for c, n in quotas.items() if n is None], limits=limits,
            actor=actor(request, t)).to_dict()


def _state_routes(r: APIRouter, svc: TenantService) -> None:
    """Disable and enable a tenant; read the audit log."""

    @r.post("/v1/admin/tenants/{name}/disable", tags=["admin"], response_model=TenantOut,
            responses=errors.responses(401, 403, 404, 409, 422, 503))
    def disable_tenant(name: TenantName, t: Caller, request: Request) -> dict[str, Any]:
        """Refuse the tenant's tokens (403) and hold its queued jobs (pending reason
        tenant_disabled); running jobs run on."""
        return svc.set_disabled(t, name, disabled=True, actor=actor(request, t)).to_dict()

    @r.post("/v1/admin/tenants/{name}/enable", tags=["admin"], response_model=TenantOut,
            responses=errors.responses(401, 403, 404, 422, 503))
    def enable_tenant(name: TenantName, t: Caller, request: Request) -> dict[str, Any]:
        """Accept the tenant's tokens again; its queued jobs are scheduled from the next tick."""
        return svc.set_disabled(t, name, disabled=False, actor=actor(request, t)).to_dict()

    @r.get("/v1/admin/audit", tags=["admin"], response_model=AuditList,
           responses=errors.responses(401, 403, 422, 503))
    def audit(t: Caller, since: Annotated[datetime | None, Query(
                  description="only lines at or after this time (ISO 8601; UTC if no zone)"),
                  ISO_TIME] = None,
              limit: Annotated[int, Query(ge=1, le=AUDIT_LIMIT_MAX), DIGITS]
              = AUDIT_LIMIT_DEFAULT) -> dict[str, Any]:
        """The newest `limit` lines of the audit log, oldest first."""
        if since is not None and since.tzinfo is None:
            since = since.replace(tzinfo=UTC)
        return {"events": [e.to_dict() for e in svc.audit(t, since=since, limit=limit)]}
