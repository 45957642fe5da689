"""`/v1/tokens`: a tenant's own API tokens (an admin's token reaches any tenant's with
`?tenant=`; `e31.api.services.tokens`).

Bodies are typed strictly; what only the store knows answers 404 (no such tenant or token) or
409 (a name taken). A token is shown once, in the answer that makes it.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from e31.api import errors
from e31.api.auth import Caller, actor
from e31.api.routes.fields import NAME_PATTERN, WHOLE, Name, TenantName
from e31.api.services.tokens import TokenService
from e31.core.errors import SpecError
from e31.store.tokens import EXPIRY_MAX

ExpiresIn = Annotated[int, Field(ge=1, le=int(EXPIRY_MAX.total_seconds())), WHOLE]
# RFC 3339's date-time, the grammar of the document's `format: date-time` (its T and Z in either
# case): the API takes what the document says it takes, no more (datetime.fromisoformat alone
# also reads a date without a time, or minutes without seconds)
RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})", re.ASCII)
TenantQuery = Annotated[str | None, Query(
    pattern=NAME_PATTERN, description="another tenant's tokens (an admin's token only)")]


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
    # one expiry or the other, as the document states it: not both given (null is not given)
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"not": {
        "required": ["expires_in_s", "expires_at"],
        "properties": {"expires_in_s": {"type": "integer"}, "expires_at": {"type": "string"}}}})
    name: Name = Field(description="unique among the tenant's live tokens")
    expires_in_s: ExpiresIn | None = Field(
        default=None,
        description="the token is refused (401) this many seconds from now; none: never. "
                    "Made with an expiring token, never later than that one: longer is "
                    "refused (422) and none means when that one expires")
    expires_at: str | None = Field(
        default=None, max_length=64, examples=["2027-01-31T00:00:00Z"],
        json_schema_extra={"format": "date-time"},
        description="the token is refused (401) from this instant (RFC 3339, ISO 8601 with "
                    "seconds and its zone), which must be in the future and within ten years "
                    "(422 otherwise); stored exactly as given. "
                    "Not with expires_in_s (422); bounded by the asking token as expires_in_s is")


def instant(text: str | None) -> datetime | None:
    """An RFC 3339 `expires_at` as an aware datetime (422 naming `expires_at` when it is none;
    the store refuses one past or too far)."""
    if text is None:
        return None
    upper = text.upper()
    try:
        if not RFC3339.fullmatch(upper):
            raise ValueError(text)
        return datetime.fromisoformat(upper)
    except ValueError:
        raise SpecError.one("expires_at", f"{text!r} is no RFC 3339 time (ISO 8601 with seconds "
                                          "and its zone); e.g. 2027-01-31T00:00:00Z") from None


def router(svc: TokenService) -> APIRouter:
    """`/v1/tokens`: list, create, revoke (DELETE)."""
    r = APIRouter()

    @r.get("/v1/tokens", tags=["tokens"], response_model=TokenList,
           responses=errors.responses(401, 403, 404, 422, 503))
    def list_tokens(t: Caller, tenant: TenantQuery = None) -> dict[str, Any]:
        """The live tokens of the tenant: names, prefixes, dates; never a token."""
        return {"tokens": svc.list(t, tenant)}

    @r.post("/v1/tokens", status_code=201, tags=["tokens"], response_model=TokenCreated,
            responses=errors.responses(401, 403, 404, 409, 413, 422, 503))
    def create_token(body: NewToken, t: Caller, request: Request,
                     tenant: TenantQuery = None) -> dict[str, Any]:
        """A new named token, with the rights of its tenant and expiring no later than the
        token that asks (422 naming the field asked with otherwise); the answer holds the
        token, shown this once."""
        return svc.create(t, tenant, name=body.name, expires_in_s=body.expires_in_s,
                          expires_at=instant(body.expires_at), actor=actor(request, t))

    @r.delete("/v1/tokens/{name}", tags=["tokens"], response_model=TokenOut,
              responses=errors.responses(401, 403, 404, 422, 503))
    def revoke_token(name: TenantName, t: Caller, request: Request,
                     tenant: TenantQuery = None) -> dict[str, Any]:
        """Revoke a token: refused (401) from the next request on. Jobs hold no token, so
        running and queued jobs are not affected."""
        return svc.revoke(t, tenant, name, actor=actor(request, t))

    return r
