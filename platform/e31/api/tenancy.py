"""`/v1/tokens` (a tenant's own API tokens; an admin's for any tenant) and `/v1/admin/...`
(tenants and the audit log, for admin tokens only: 403 otherwise).

Every change is written to the audit log with who asked (the tenant and key of the token), what,
when and from where (the client's address), in the transaction that makes the change.
Bodies are typed strictly and their models carry this pool's size classes and the limits'
ranges (`e31.core.limits`), so the OpenAPI document says exactly what is taken; what only the store
knows answers 404 (no such tenant or token) or 409 (a name taken; an admin disabling itself).
"""

# No `from __future__ import annotations`: the routes' annotations name models and a token
# dependency made inside the router functions, which FastAPI must see as objects.
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Query, Request
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from e31.api import errors
from e31.api.limits import DIGITS
from e31.core.clock import utcnow
from e31.core.errors import Conflict, Forbidden
from e31.core.limits import (
    MAX_ARRAY_ITEMS_CAP,
    MAX_PRIORITY,
    MAX_QUEUED_CAP,
    MAX_RATE_PER_S,
    MAX_REQUEST_BYTES_CAP,
)
from e31.core.records import Actor, TenantRecord, TokenRecord
from e31.edge.settings import Settings
from e31.store import Repo
from e31.store.tenants import MAX_QUOTA_GPUS
from e31.store.tokens import EXPIRY_MAX

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
AUDIT_LIMIT_MAX = 10_000
AUDIT_LIMIT_DEFAULT = 1000
REQUEST_MIN_BYTES = 1024     # the smallest max_request_bytes an admin may set (e31.core.limits)
_Name = Annotated[str, Field(pattern=NAME_PATTERN, description="letters, digits, '.', '_', '-'")]


def _whole(value: Any) -> Any:
    """JSON Schema's integer: 2.0 is 2 (strict models would refuse it); 2.5 and "2" stay
    refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _iso_time(value: Any) -> Any:
    """A time in a query is ISO 8601 (`2026-12-01T00:00:00Z`); pydantic would also take a
    number of seconds since 1970 (`?since=0.5`), which the document does not offer."""
    if isinstance(value, str) and not _ISO_DATE.match(value):
        raise ValueError("must be an ISO 8601 time, e.g. 2026-12-01T00:00:00Z")
    return value


_ISO_DATE = re.compile(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}")
ISO_TIME = BeforeValidator(_iso_time)

# Whole numbers in their ranges (the bounds inside the Annotated, so the document states them).
ExpiresIn = Annotated[int, Field(ge=1, le=int(EXPIRY_MAX.total_seconds())), BeforeValidator(_whole)]
Priority = Annotated[int, Field(ge=0, le=MAX_PRIORITY), BeforeValidator(_whole)]
Queued = Annotated[int, Field(ge=0, le=MAX_QUEUED_CAP), BeforeValidator(_whole)]
ArrayItems = Annotated[int, Field(ge=1, le=MAX_ARRAY_ITEMS_CAP), BeforeValidator(_whole)]
RequestBytes = Annotated[int, Field(ge=REQUEST_MIN_BYTES, le=MAX_REQUEST_BYTES_CAP),
                         BeforeValidator(_whole)]
Burst = Annotated[int, Field(ge=1, le=int(MAX_RATE_PER_S)), BeforeValidator(_whole)]
Rate = Annotated[float, Field(gt=0, le=MAX_RATE_PER_S)]
Quota = Annotated[int, Field(ge=0, le=MAX_QUOTA_GPUS), BeforeValidator(_whole)]


class TokenOut(BaseModel):
    """A token as `list` shows it: never the token, only its name and first characters."""

    name: str
    tenant: str
    prefix: str | None = Field(description="the token's first characters, to tell it apart")
    created_at: str
    last_used_at: str | None = Field(description="noted at most once a minute")
    expires_at: str | None
    expired: bool
    revoked_at: str | None


class TokenCreated(TokenOut):
    token: str = Field(description="the token itself: shown this once, only its hash is kept")


class TokenList(BaseModel):
    tokens: list[TokenOut]


class NewToken(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: _Name = Field(description="unique among the tenant's live tokens")
    expires_in_s: ExpiresIn | None = Field(
        default=None,
        description="the token is refused (401) this many seconds from now; none: never. "
                    "Made with an expiring token, never later than that one: longer is "
                    "refused (422) and none means when that one expires")


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


def router(settings: Settings, repo: Repo, caller: Callable[..., TenantRecord]) -> APIRouter:
    """The routes, over `repo`; `caller` is the API's token dependency."""
    r = APIRouter()
    _token_routes(r, repo, caller)
    _admin_routes(r, settings, repo, caller)
    return r


def _actor(request: Request, t: TenantRecord) -> Actor:
    return Actor(t.name, t.key_id, request.client.host if request.client else None)


def _admin(t: TenantRecord) -> None:
    if not t.admin:
        raise Forbidden("this needs an admin token")


def _whose(t: TenantRecord, tenant: str | None) -> str:
    """The tenant whose tokens are asked about: the caller's own, or (admin) any."""
    if tenant is None or tenant == t.name:
        return t.name
    _admin(t)
    return tenant


TenantQuery = Annotated[str | None, Query(
    pattern=NAME_PATTERN, description="another tenant's tokens (an admin's token only)")]
TenantName = Annotated[str, Path(pattern=NAME_PATTERN)]


def _token_routes(r: APIRouter, repo: Repo, caller: Callable[..., TenantRecord]) -> None:
    """`/v1/tokens`: list, create, revoke (DELETE)."""
    Caller = Annotated[TenantRecord, Depends(caller)]

    @r.get("/v1/tokens", tags=["tokens"], response_model=TokenList,
           responses=errors.responses(401, 403, 404, 422, 503))
    def list_tokens(t: Caller, tenant: TenantQuery = None) -> dict[str, Any]:
        """The live tokens of the tenant: names, prefixes, dates; never a token."""
        now = utcnow()
        return {"tokens": [k.to_dict(now=now) for k in repo.list_tokens(_whose(t, tenant))]}

    @r.post("/v1/tokens", status_code=201, tags=["tokens"], response_model=TokenCreated,
            responses=errors.responses(401, 403, 404, 409, 413, 422, 503))
    def create_token(body: NewToken, t: Caller, request: Request,
                     tenant: TenantQuery = None) -> dict[str, Any]:
        """A new named token, with the rights of its tenant and expiring no later than the
        token that asks (422 naming expires_in_s otherwise); the answer holds the token,
        shown this once."""
        now = utcnow()
        expires = now + timedelta(seconds=body.expires_in_s) if body.expires_in_s else None
        record, token = repo.add_token(_whose(t, tenant), now=now, name=body.name,
                                       expires_at=expires, actor=_actor(request, t))
        return {**record.to_dict(now=now), "token": token}

    @r.delete("/v1/tokens/{name}", tags=["tokens"], response_model=TokenOut,
              responses=errors.responses(401, 403, 404, 422, 503))
    def revoke_token(name: TenantName, t: Caller, request: Request,
                     tenant: TenantQuery = None) -> dict[str, Any]:
        """Revoke a token: refused (401) from the next request on. Jobs hold no token, so
        running and queued jobs are not affected."""
        now = utcnow()
        record: TokenRecord = repo.revoke_token(_whose(t, tenant), name, now=now,
                                                actor=_actor(request, t))
        return record.to_dict(now=now)


def _admin_routes(r: APIRouter, settings: Settings, repo: Repo,
                  caller: Callable[..., TenantRecord]) -> None:
    """`/v1/admin/tenants` and `/v1/admin/audit`: admin tokens only."""
    Caller = Annotated[TenantRecord, Depends(caller)]
    size_class = Literal[tuple(c.name for c in settings.size_classes)]  # type: ignore[valid-type]

    class NewTenant(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        name: _Name
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
        _admin(t)
        return {"tenants": [x.to_dict() for x in repo.list_tenants()]}

    @r.post("/v1/admin/tenants", status_code=201, tags=["admin"], response_model=TenantCreated,
            responses=errors.responses(401, 403, 409, 413, 422, 503))
    def create_tenant(body: NewTenant, t: Caller, request: Request) -> dict[str, Any]:
        """A new tenant and its first token (named default), shown this once; it expires
        when the admin token that asks does, if that one expires."""
        _admin(t)
        record, token = repo.create_tenant(
            body.name, admin=body.admin, now=utcnow(), weight=body.weight,
            quotas=dict(body.quotas), limits=body.limits.model_dump(exclude_none=True),
            actor=_actor(request, t))
        return {**record.to_dict(), "token": token}

    @r.get("/v1/admin/tenants/{name}", tags=["admin"], response_model=TenantOut,
           responses=errors.responses(401, 403, 404, 422, 503))
    def get_tenant(name: TenantName, t: Caller) -> dict[str, Any]:
        _admin(t)
        return repo.get_tenant(name).to_dict()

    @r.patch("/v1/admin/tenants/{name}", tags=["admin"], response_model=TenantOut,
             responses=errors.responses(401, 403, 404, 413, 422, 503))
    def update_tenant(name: TenantName, body: TenantChange, t: Caller,
                      request: Request) -> dict[str, Any]:
        """Change the weight, quotas (null drops one) and limits (null returns one to the
        pool's default); what is not given stays."""
        _admin(t)
        quotas = body.quotas or {}
        limits = body.limits.model_dump(exclude_unset=True) if body.limits is not None else None
        return repo.update_tenant(
            name, weight=body.weight, quotas={c: n for c, n in quotas.items() if n is not None},
            drop_quotas=[c for c, n in quotas.items() if n is None], limits=limits,
            now=utcnow(), actor=_actor(request, t)).to_dict()

    @r.post("/v1/admin/tenants/{name}/disable", tags=["admin"], response_model=TenantOut,
            responses=errors.responses(401, 403, 404, 409, 422, 503))
    def disable_tenant(name: TenantName, t: Caller, request: Request) -> dict[str, Any]:
        """Refuse the tenant's tokens (403) and hold its queued jobs (pending reason
        tenant_disabled); running jobs run on."""
        _admin(t)
        if name == t.name:
            raise Conflict("an admin cannot disable its own tenant (it would lock itself out)")
        return repo.set_tenant_disabled(name, disabled=True, now=utcnow(),
                                        actor=_actor(request, t)).to_dict()

    @r.post("/v1/admin/tenants/{name}/enable", tags=["admin"], response_model=TenantOut,
            responses=errors.responses(401, 403, 404, 422, 503))
    def enable_tenant(name: TenantName, t: Caller, request: Request) -> dict[str, Any]:
        """Accept the tenant's tokens again; its queued jobs are scheduled from the next tick."""
        _admin(t)
        return repo.set_tenant_disabled(name, disabled=False, now=utcnow(),
                                        actor=_actor(request, t)).to_dict()

    @r.get("/v1/admin/audit", tags=["admin"], response_model=AuditList,
           responses=errors.responses(401, 403, 422, 503))
    def audit(t: Caller, since: Annotated[datetime | None, Query(
                  description="only lines at or after this time (ISO 8601; UTC if no zone)"),
                  ISO_TIME] = None,
              limit: Annotated[int, Query(ge=1, le=AUDIT_LIMIT_MAX), DIGITS]
              = AUDIT_LIMIT_DEFAULT) -> dict[str, Any]:
        """The newest `limit` lines of the audit log, oldest first."""
        _admin(t)
        if since is not None and since.tzinfo is None:
            since = since.replace(tzinfo=UTC)
        return {"events": [e.to_dict() for e in repo.audit_log(since=since, limit=limit)]}
