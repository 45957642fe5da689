"""Tenants, their API keys and the audit log: the tenancy part of `Repo` (a mixin; `Repo`
supplies `_session`), delegating to `tenants`, `tokens` and `audit`.

Every change made on behalf of someone (`actor`: a tenant's key over the API, or `local` for the
CLI on the store) writes its audit line in the same transaction (docs/security.md).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from datetime import datetime
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from e31.core.clock import utcnow
from e31.core.errors import Conflict, StoreError
from e31.core.limits import check_limits
from e31.core.records import LOCAL_ACTOR, Actor, AuditRecord, TenantRecord, TokenRecord
from e31.store import audit, tenants, tokens
from e31.store.models import Tenant


class TenancyQueries:
    """Tenants, tokens and the audit log."""

    def _session(self, *, write: bool = False) -> AbstractContextManager[Session]:
        raise NotImplementedError

    # -- tenants ---------------------------------------------------------------------------

    def create_tenant(self, name: str, *, admin: bool = False, now: datetime, weight: float = 1.0,
                      quotas: Mapping[str, int] | None = None,
                      limits: Mapping[str, Any] | None = None,
                      actor: Actor = LOCAL_ACTOR) -> tuple[TenantRecord, str]:
        """Create a tenant and its first token (named `default`); the token is returned once,
        only its hash kept. A tenant's name is a token's (`tokens.NAME`), so that every
        tenant can be named in the admin API's paths. Made with an expiring key (an admin's
        over the API), the first token expires with that key."""
        tokens.check_name(name)
        tenant = Tenant(id="t-" + uuid.uuid4().hex[:12], name=name, admin=admin,
                        weight=tenants.check_weight(weight), created_at=now,
                        quotas=dict(sorted((quotas or {}).items())) or None, usage_gpu_s=0.0,
                        limits=dict(sorted(check_limits(limits or {}).items())) or None)
        try:
            with self._session(write=True) as s:
                s.add(tenant)
                s.flush()
                # an expiring admin key makes no tenant whose first key outlives it
                _, token = tokens.add(s, tenant, name=tokens.DEFAULT_NAME, now=now,
                                      expires_at=tokens.creator_expiry(s, actor.key_id))
                audit.write(s, actor, "tenant.create", name, now=now, detail={
                    "admin": admin, "weight": tenant.weight, "quotas": tenant.quotas,
                    "limits": tenant.limits})
        except IntegrityError as exc:
            raise Conflict(f"tenant {name!r} exists already") from exc
        return tenants.record(tenant), token

    def update_tenant(self, name: str, *, weight: float | None = None,
                      quotas: Mapping[str, int] | None = None, drop_quotas: Sequence[str] = (),
                      limits: Mapping[str, Any] | None = None, now: datetime | None = None,
                      actor: Actor = LOCAL_ACTOR) -> TenantRecord:
        """Change a tenant's weight, quotas and limits (`e31 tenant update`, PATCH
        /v1/admin/tenants/NAME); the scheduler's next tick and the next submit use them."""
        with self._session(write=True) as s:
            record = tenants.update(s, name, weight=weight, quotas=quotas or {},
                                    drop=drop_quotas, limits=limits)
            detail: dict[str, Any] = {"weight": weight, "quotas": dict(quotas or {}) or None,
                                      "drop_quotas": list(drop_quotas) or None,
                                      "limits": dict(limits) if limits is not None else None}
            audit.write(s, actor, "tenant.update", name, now=now or utcnow(),
                        detail={k: v for k, v in detail.items() if v is not None})
            return record

    def set_tenant_disabled(self, name: str, *, disabled: bool, now: datetime,
                            actor: Actor = LOCAL_ACTOR) -> TenantRecord:
        """Disable a tenant (its tokens refused, its queued jobs held) or enable it again."""
        with self._session(write=True) as s:
            record = tenants.set_disabled(s, name, disabled=disabled, now=now)
            audit.write(s, actor, "tenant.disable" if disabled else "tenant.enable", name,
                        now=now)
            return record

    def get_tenant(self, name: str) -> TenantRecord:
        with self._session() as s:
            return tenants.record(tenants.find(s, name))

    def list_tenants(self) -> list[TenantRecord]:
        with self._session() as s:
            return tenants.listed(s)

    # -- tokens ----------------------------------------------------------------------------

    def create_token(self, tenant_name: str, *, now: datetime, name: str | None = None,
                     expires_at: datetime | None = None,
                     actor: Actor = LOCAL_ACTOR) -> str:
        """A new token of an existing tenant, returned once (`add_token` also gives its record)."""
        return self.add_token(tenant_name, now=now, name=name, expires_at=expires_at,
                              actor=actor)[1]

    def add_token(self, tenant_name: str, *, now: datetime, name: str | None = None,
                  expires_at: datetime | None = None,
                  actor: Actor = LOCAL_ACTOR) -> tuple[TokenRecord, str]:
        """A new named token of `tenant_name` (default name: `token-<8 hex>`), optionally
        expiring, and never after the `actor`'s own key (`tokens.bounded_expiry`); the record
        and the token, which is returned only here."""
        with self._session(write=True) as s:
            tenant = tenants.find(s, tenant_name)
            expires_at = tokens.bounded_expiry(
                expires_at, tokens.creator_expiry(s, actor.key_id), now=now)
            record, token = tokens.add(s, tenant, name=name or f"token-{uuid.uuid4().hex[:8]}",
                                       now=now, expires_at=expires_at)
            audit.write(s, actor, "token.create", f"{tenant_name}/{record.name}", now=now,
                        detail={"prefix": record.prefix,
                                "expires_at": expires_at.isoformat() if expires_at else None})
            return record, token

    def list_tokens(self, tenant_name: str) -> list[TokenRecord]:
        with self._session() as s:
            return tokens.listed(s, tenants.find(s, tenant_name))

    def revoke_token(self, tenant_name: str, name: str, *, now: datetime,
                     actor: Actor = LOCAL_ACTOR) -> TokenRecord:
        """Revoke a token by name: every request with it from now on is refused (401)."""
        with self._session(write=True) as s:
            record = tokens.revoke(s, tenants.find(s, tenant_name), name, now=now)
            audit.write(s, actor, "token.revoke", f"{tenant_name}/{record.name}", now=now,
                        detail={"prefix": record.prefix})
            return record

    def tenant_for_token(self, token: str, *, now: datetime | None = None) -> TenantRecord | None:
        """The tenant of a live token (not revoked, not expired), with the key's id; None
        otherwise. A disabled tenant is returned (with `disabled_at`): the caller refuses it
        with its own answer. The key's last use is noted, at most once a minute."""
        now = now or utcnow()
        with self._session() as s:
            found = tokens.authenticate(s, token, now=now)
            if found is None:
                return None
            tenant, key = found
            stale, key_id = tokens.is_stale(key, now), key.id
            record = tenants.record(tenant)
        if stale:
            try:
                with self._session(write=True) as s:
                    tokens.touch(s, key_id, now=now)
            except StoreError:   # a note of use is not worth refusing the request for
                pass
        return _with_key(record, key_id)

    # -- audit -----------------------------------------------------------------------------

    def audit_log(self, *, since: datetime | None = None, limit: int = 1000) -> list[AuditRecord]:
        """The newest `limit` lines of the audit log at or after `since`, oldest first."""
        with self._session() as s:
            return audit.read(s, since=since, limit=limit)


def _with_key(record: TenantRecord, key_id: str) -> TenantRecord:
    return replace(record, key_id=key_id)
