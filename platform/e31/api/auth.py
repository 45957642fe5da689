"""Who is asking: the bearer scheme, the `Caller` dependency every tenant route names, and the
`Actor` an audit line records.

The token is read from the store at every request (`TokenService.authenticate`: nothing cached,
so a revoked or expired token is refused on the very next one); the services come from the
app's state (`create_app` puts them there).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from e31.api.services import Services
from e31.core.records import Actor, TenantRecord

_bearer = HTTPBearer(auto_error=False, description="a tenant's API token")
_Token = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _caller(request: Request, creds: _Token) -> TenantRecord:
    """The tenant whose token the request carries (401 without a valid one)."""
    services: Services = request.app.state.services
    return services.tokens.authenticate(creds.credentials if creds else None)


Caller = Annotated[TenantRecord, Depends(_caller)]


def actor(request: Request, t: TenantRecord) -> Actor:
    """Who asks, for the audit log: the tenant and key of the token, and the client's address."""
    return Actor(t.name, t.key_id, request.client.host if request.client else None)
