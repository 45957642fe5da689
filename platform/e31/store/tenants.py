"""`TenantStore`: tenants, their API keys, their secrets, their outputs quota and the audit
log; and the tenant's own statements (fair-share settings, limits, enabled or not, decayed
usage), on a session a store opens.

Who uses it: the API (the admin, token and secret routes, and each request's
`tenant_for_token`), the CLI (`e31 tenant`, `e31 token`, `e31 secret`, `e31 audit`) and the
local stack. It delegates to the statements of `tokens`, `secrets`, `quotas` and `audit`; the
worker reads secrets' ciphertexts and charges outputs through `AttemptStore` instead, and
`bill` is called in the transaction that ends an attempt (`attempts.end_attempt`).

Usage is billed per attempt, in the transaction that ends it: the tenant's `UsageState` (two
columns) is brought to now with the half-life and the attempt's GPU-seconds are added, so no
tick ever scans jobs to account for usage. Every change made on behalf of someone (`actor`: a
tenant's key over the API, or `local` for the CLI on the store) writes its audit line in the
same transaction (docs/security.md).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Row, bindparam, select
from sqlalchemy import update as sql_update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from e31.core.clock import utcnow
from e31.core.errors import Conflict, NotFound, SpecError, StoreError
from e31.core.records import LOCAL_ACTOR, Actor, AuditRecord, TenantRecord, TokenRecord
from e31.core.tenantlimits import check_limits
from e31.core.usage import UsageState
from e31.store import audit, secrets, tokens
from e31.store.base import Store
from e31.store.db import core_of
from e31.store.models import Job, Tenant
from e31.store.quotas import OutputsQuota, check_cap, set_cap
from e31.store.secrets import SecretInfo

MAX_QUOTA_GPUS = 1_000_000   # a typo guard, far above any pool
TENANT_DISABLED = "tenant_disabled"   # the pending reason (e31.scheduling.fairshare.Reason)


def tenant_record(t: Tenant | Row[*tuple[Any, ...]]) -> TenantRecord:
    """A tenant's record, from its model or a row of its columns."""
    return TenantRecord(id=t.id, name=t.name, admin=bool(t.admin), weight=t.weight,
                        quotas=dict(t.quotas or {}), disabled_at=t.disabled_at,
                        limits=dict(t.limits or {}))


def find(s: Session, name: str, *, lock: bool = False) -> Tenant:
    """The tenant named `name` (NotFound otherwise), row-locked if asked."""
    q = select(Tenant).where(Tenant.name == name)
    tenant = s.scalar(q.with_for_update() if lock else q)
    if tenant is None:
        raise NotFound(f"no tenant named {name!r}")
    return tenant


def listed(s: Session) -> list[TenantRecord]:
    return [tenant_record(t) for t in s.scalars(select(Tenant).order_by(Tenant.name))]


def set_disabled(s: Session, name: str, *, disabled: bool, now: datetime) -> TenantRecord:
    """Disable (its tokens refused, its queued jobs held) or enable a tenant; doing it twice
    changes nothing (a disabled tenant keeps the time it was first disabled)."""
    tenant = find(s, name, lock=True)
    if disabled and tenant.disabled_at is None:
        tenant.disabled_at = now
    elif not disabled:
        tenant.disabled_at = None
        # The reason the scheduler stored while it was disabled is stale from now on (its
        # next tick writes the present one): cleared here, so no status says it meanwhile.
        s.execute(sql_update(Job).where(Job.tenant_id == tenant.id,
                                        Job.pending_reason == TENANT_DISABLED)
                  .values(pending_reason=None, pending_detail=None))
    s.flush()
    return tenant_record(tenant)


def check_weight(weight: float) -> float:
    if not (isinstance(weight, int | float) and math.isfinite(weight) and weight > 0):
        raise SpecError.one("weight", "must be a positive number")
    return float(weight)


def check_quotas(quotas: Mapping[str, int], classes: Sequence[str] | None) -> dict[str, int]:
    """Quotas by size class: whole GPUs >= 0 of a known class (0 holds the class back)."""
    out: dict[str, int] = {}
    for cls, gpus in quotas.items():
        if classes is not None and cls not in classes:
            raise SpecError.one(f"quota.{cls}", f"unknown size class; known: {', '.join(classes)}")
        if isinstance(gpus, bool) or not isinstance(gpus, int) or not 0 <= gpus <= MAX_QUOTA_GPUS:
            raise SpecError.one(f"quota.{cls}", "must be a whole number of GPUs >= 0")
        out[cls] = gpus
    return out


def update(s: Session, name: str, *, weight: float | None, quotas: Mapping[str, int],
           drop: Sequence[str], limits: Mapping[str, Any] | None = None) -> TenantRecord:
    """Change a tenant's weight, set quotas and drop others, and set limits (a limit given as
    None returns to the pool's default); the rest stays."""
    tenant = find(s, name, lock=True)
    if limits is not None:
        checked = check_limits(limits)
        merged_limits = {k: v for k, v in {**(tenant.limits or {}), **checked}.items()
                         if k not in limits or limits[k] is not None}
        tenant.limits = dict(sorted(merged_limits.items())) or None
    if weight is not None:
        tenant.weight = check_weight(weight)
    merged = {**(tenant.quotas or {}), **quotas}
    for cls in drop:
        merged.pop(cls, None)
    tenant.quotas = dict(sorted(merged.items())) or None
    s.flush()
    return tenant_record(tenant)


def bill(s: Session | Connection, tenant_id: str, gpu_s: float, *, now: datetime,
         half_life_s: float) -> None:
    """Add an attempt's GPU-seconds to the tenant's decayed usage (row-locked: concurrent
    ends of the same tenant's attempts add up, none is lost)."""
    if gpu_s <= 0:
        return
    # FOR NO KEY UPDATE, the lock the UPDATE below takes anyway. FOR UPDATE would also wait on
    # KEY SHARE locks: an outcome updates its job row twice, and PostgreSQL re-checks the
    # foreign keys of a row its own transaction updated, share-locking the tenant's row; two
    # ends of one tenant's attempts then deadlocked (tests/integration/test_concurrent_outcomes.py).
    c = core_of(s)
    usage = c.execute(_TENANT_USAGE, {"tenant": tenant_id}).first()
    if usage is None:
        return
    value, at = usage
    new = UsageState(value, at.timestamp() if at else 0.0).plus(gpu_s, now.timestamp(),
                                                                 half_life_s)
    c.execute(_SET_USAGE, {"tenant": tenant_id, "value": new.value_gpu_s,
                           "at": max(now, at) if at else now})


# An outcome's bill, built once and run as Core (issue 31): the tenant's decayed usage,
# row-locked, then its new value
_TENANT_USAGE = (select(Tenant.usage_gpu_s, Tenant.usage_at)
                 .where(Tenant.id == bindparam("tenant")).with_for_update(key_share=True))
_SET_USAGE = (sql_update(Tenant).where(Tenant.id == bindparam("tenant"))
              .values(usage_gpu_s=bindparam("value"), usage_at=bindparam("at")))


class TenantStore(Store):
    """Tenants, tokens, secrets, outputs quotas and the audit log."""

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
                        weight=check_weight(weight), created_at=now,
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
        return tenant_record(tenant), token

    def update_tenant(self, name: str, *, weight: float | None = None,
                      quotas: Mapping[str, int] | None = None, drop_quotas: Sequence[str] = (),
                      limits: Mapping[str, Any] | None = None, now: datetime | None = None,
                      actor: Actor = LOCAL_ACTOR) -> TenantRecord:
        """Change a tenant's weight, quotas and limits (`e31 tenant update`, PATCH
        /v1/admin/tenants/NAME); the scheduler's next tick and the next submit use them."""
        with self._session(write=True) as s:
            changed = update(s, name, weight=weight, quotas=quotas or {}, drop=drop_quotas,
                             limits=limits)
            detail: dict[str, Any] = {"weight": weight, "quotas": dict(quotas or {}) or None,
                                      "drop_quotas": list(drop_quotas) or None,
                                      "limits": dict(limits) if limits is not None else None}
            audit.write(s, actor, "tenant.update", name, now=now or utcnow(),
                        detail={k: v for k, v in detail.items() if v is not None})
            return changed

    def set_tenant_disabled(self, name: str, *, disabled: bool, now: datetime,
                            actor: Actor = LOCAL_ACTOR) -> TenantRecord:
        """Disable a tenant (its tokens refused, its queued jobs held) or enable it again."""
        with self._session(write=True) as s:
            changed = set_disabled(s, name, disabled=disabled, now=now)
            audit.write(s, actor, "tenant.disable" if disabled else "tenant.enable", name,
                        now=now)
            return changed

    def get_tenant(self, name: str) -> TenantRecord:
        with self._session() as s:
            return tenant_record(find(s, name))

    def list_tenants(self) -> list[TenantRecord]:
        with self._session() as s:
            return listed(s)

    # -- tokens ----------------------------------------------------------------------------

    def create_token(self, tenant_name: str, *, now: datetime, name: str | None = None,
                     expires_at: datetime | None = None,
                     actor: Actor = LOCAL_ACTOR) -> str:
        """A new token of an existing tenant, returned once (`add_token` also gives its record)."""
        return self.add_token(tenant_name, now=now, name=name, expires_at=expires_at,
                              actor=actor)[1]

    def add_token(self, tenant_name: str, *, now: datetime, name: str | None = None,
                  expires_at: datetime | None = None, expiry_field: str = "expires_in_s",
                  actor: Actor = LOCAL_ACTOR) -> tuple[TokenRecord, str]:
        """A new named token of `tenant_name` (default name: `token-<8 hex>`), optionally
        expiring, and never after the `actor`'s own key (`tokens.bounded_expiry`, a refusal
        naming `expiry_field`: the field the API was asked with); the record and the token,
        which is returned only here."""
        with self._session(write=True) as s:
            tenant = find(s, tenant_name)
            expires_at = tokens.bounded_expiry(
                expires_at, tokens.creator_expiry(s, actor.key_id), now=now, field=expiry_field)
            record, token = tokens.add(s, tenant, name=name or f"token-{uuid.uuid4().hex[:8]}",
                                       now=now, expires_at=expires_at)
            audit.write(s, actor, "token.create", f"{tenant_name}/{record.name}", now=now,
                        detail={"prefix": record.prefix,
                                "expires_at": expires_at.isoformat() if expires_at else None})
            return record, token

    def list_tokens(self, tenant_name: str) -> list[TokenRecord]:
        with self._session() as s:
            return tokens.listed(s, find(s, tenant_name))

    def revoke_token(self, tenant_name: str, name: str, *, now: datetime,
                     actor: Actor = LOCAL_ACTOR) -> TokenRecord:
        """Revoke a token by name: every request with it from now on is refused (401)."""
        with self._session(write=True) as s:
            record = tokens.revoke(s, find(s, tenant_name), name, now=now)
            audit.write(s, actor, "token.revoke", f"{tenant_name}/{record.name}", now=now,
                        detail={"prefix": record.prefix})
            return record

    def tenant_for_token(self, token: str, *, now: datetime | None = None) -> TenantRecord | None:
        """The tenant of a live token (not revoked, not expired), with the key's id; None
        otherwise. A disabled tenant is returned (with `disabled_at`): the caller refuses it
        with its own answer. The key's last use is noted, at most once a minute."""
        now = now or utcnow()
        with self._core() as c:
            found = tokens.authenticate(c, token, now=now)
        if found is None:
            return None
        key_id, found_tenant = found.key_id, tenant_record(found)
        if tokens.is_stale(found.key_last_used_at, now):
            try:
                with self._session(write=True) as s:
                    tokens.touch(s, key_id, now=now)
            except StoreError:   # a note of use is not worth refusing the request for
                pass
        return _with_key(found_tenant, key_id)

    # -- secrets (their values are never here: `e31.edge.secrets` encrypts them) ---------

    def put_secret(self, tenant_id: str, name: str, ciphertext: str, *, now: datetime,
                   actor: Actor = LOCAL_ACTOR) -> tuple[SecretInfo, bool]:
        """Store (or replace) a tenant's secret; returns it and whether it is new. The audit
        log gets `secret.set` with the name, never the value."""
        with self._session(write=True) as s:
            return secrets.put(s, tenant_id, name, ciphertext, now=now, actor=actor)

    def list_secrets(self, tenant_id: str) -> list[SecretInfo]:
        with self._session() as s:
            return secrets.listed(s, tenant_id)

    def delete_secret(self, tenant_id: str, name: str, *, now: datetime,
                      actor: Actor = LOCAL_ACTOR) -> None:
        """Remove a tenant's secret (`NotFound` when it has none of that name); the audit log
        gets `secret.delete`."""
        with self._session(write=True) as s:
            secrets.remove(s, tenant_id, name, now=now, actor=actor)

    def missing_secrets(self, tenant_id: str, names: Sequence[str]) -> list[str]:
        """Those of `names` the tenant has not set, in their order."""
        if not names:
            return []
        with self._session() as s:
            have = secrets.present(s, tenant_id, names)
        return [n for n in names if n not in have]

    # -- outputs quota -------------------------------------------------------------------

    def set_outputs_quota(self, name: str, max_bytes: int | None) -> OutputsQuota:
        """Give a tenant its own outputs cap in bytes (0: no outputs), or None for the pool's."""
        check_cap(max_bytes)
        with self._session(write=True) as s:
            return set_cap(s, name, max_bytes)

    # -- audit -----------------------------------------------------------------------------

    def audit_log(self, *, since: datetime | None = None, limit: int = 1000) -> list[AuditRecord]:
        """The newest `limit` lines of the audit log at or after `since`, oldest first."""
        with self._session() as s:
            return audit.read(s, since=since, limit=limit)


def _with_key(tenant: TenantRecord, key_id: str) -> TenantRecord:
    return replace(tenant, key_id=key_id)
