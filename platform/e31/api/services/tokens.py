"""API tokens: who a token names (`authenticate`, at every request), and a tenant's own tokens
(`e31.api.routes.tokens`; an admin's token reaches any tenant's).

A token is shown once, when it is made; only its hash is stored. A new token never outlives the
token that asks for it (the store bounds its expiry, 422 naming the field asked with otherwise).
An expiry is asked either as an instant (`expires_at`, kept exactly as given) or as seconds from
now (`expires_in_s`), never both.
Making and revoking one is written to the audit log with who asked (`Actor`), in the same
transaction.
"""

from __future__ import annotations

import builtins
from datetime import datetime, timedelta
from typing import Any

from e31.api.services.tenants import admin_only
from e31.core.clock import utcnow
from e31.core.errors import AuthError, Forbidden, SpecError
from e31.core.records import Actor, TenantRecord
from e31.store import Repo


class TokenService:
    """The tokens of each tenant, over one store."""

    def __init__(self, *, repo: Repo) -> None:
        self._repo = repo

    def authenticate(self, token: str | None) -> TenantRecord:
        """The tenant of a live token, read from the store at every request (nothing cached:
        a revoked or expired token is refused on the very next one). 401 for no, an unknown,
        a revoked or an expired token (one answer: it tells a guesser nothing); 403 for the
        token of a disabled tenant, which only its holder can learn."""
        if not token:
            raise AuthError("missing API token: send 'Authorization: Bearer <token>'")
        tenant = self._repo.tenant_for_token(token, now=utcnow())
        if tenant is None:
            raise AuthError("invalid API token (unknown, revoked or expired)")
        if tenant.disabled_at is not None:
            raise Forbidden(f"tenant {tenant.name} is disabled (since "
                            f"{tenant.disabled_at.isoformat()}); ask an admin to enable it")
        return tenant

    def list(self, caller: TenantRecord,
             tenant: str | None) -> builtins.list[dict[str, Any]]:
        """The live tokens of `tenant` (None: the caller's own): names, prefixes, dates; never
        a token."""
        now = utcnow()
        return [k.to_dict(now=now) for k in self._repo.list_tokens(_whose(caller, tenant))]

    def create(self, caller: TenantRecord, tenant: str | None, *, name: str,
               expires_in_s: int | None, expires_at: datetime | None = None,
               actor: Actor) -> dict[str, Any]:
        """A new named token of `tenant` (None: the caller's own), with the token itself. An
        `expires_at` is stored as that very instant (no round trip through seconds, which
        would add the time the request took)."""
        if expires_at is not None and expires_in_s is not None:
            raise SpecError.one("expires_at", "give expires_at or expires_in_s, not both")
        now = utcnow()
        if expires_in_s:
            expires_at = now + timedelta(seconds=expires_in_s)
        field = "expires_in_s" if expires_in_s is not None else "expires_at"
        record, token = self._repo.add_token(_whose(caller, tenant), now=now, name=name,
                                             expires_at=expires_at, expiry_field=field,
                                             actor=actor)
        return {**record.to_dict(now=now), "token": token}

    def revoke(self, caller: TenantRecord, tenant: str | None, name: str, *,
               actor: Actor) -> dict[str, Any]:
        """Revoke the token `name` of `tenant` (None: the caller's own)."""
        now = utcnow()
        return self._repo.revoke_token(_whose(caller, tenant), name, now=now,
                                       actor=actor).to_dict(now=now)


def _whose(caller: TenantRecord, tenant: str | None) -> str:
    """The tenant whose tokens are asked about: the caller's own, or (admin) any."""
    if tenant is None or tenant == caller.name:
        return caller.name
    admin_only(caller)
    return tenant
