"""A tenant's API keys: named, optionally expiring, revocable; on a session `TenantStore` opens.

Only a key's sha256 is stored; the token itself is returned once, when it is made. A key's
`prefix` (its first `PREFIX_CHARS` characters) tells keys apart in `e31 token list` without
revealing them. A key authenticates while it is neither revoked nor expired, checked in the
query that finds it, so a revoked or expired key is refused on the very next request.
A key never outlives the key that made it (`bounded_expiry`): one made with an expiring key
expires no later, and when none is asked, exactly then. Keys carry no scopes of their own: a
key has its tenant's rights (admin or not) and nothing else, so no key can make a key with
more rights than itself.
`last_used_at` is written at most once per `LAST_USED_RESOLUTION_S` per key: a conditional
UPDATE that matches nothing inside the window, so a busy key costs one write a minute.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import uuid
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Row, and_, bindparam, or_, select, update
from sqlalchemy.orm import Session

from e31.core.errors import Conflict, NotFound, SpecError
from e31.core.records import TokenRecord
from e31.store.models import TENANTS, ApiKey, Tenant

TOKEN_PREFIX = "e31_"
TOKEN_BYTES = 32               # 256 random bits
PREFIX_CHARS = 12              # "e31_" and 8 random characters: enough to tell keys apart
DEFAULT_NAME = "default"       # the first key of a tenant, made with it
LAST_USED_RESOLUTION_S = 60.0  # last_used_at is written at most this often per key
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
EXPIRY_MAX = timedelta(days=3650)   # a typo guard: ten years
# the reasons an expiry is refused for when it falls, which depends on now (the API fuzz test
# knows them: its document cannot state them)
EXPIRY_PAST = "must be in the future"
EXPIRY_TOO_FAR = "must be within ten years"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def check_name(name: object) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise SpecError.one("name", "must be 1 to 100 letters, digits, '.', '_' or '-', "
                                    "starting with a letter or digit")
    return name


def check_expiry(expires_at: datetime | None, *, now: datetime) -> datetime | None:
    if expires_at is None:
        return None
    if expires_at.tzinfo is None:
        raise SpecError.one("expires_at", "must name its time zone (e.g. 2027-01-31T00:00:00Z)")
    if expires_at <= now:
        raise SpecError.one("expires_at", EXPIRY_PAST)
    if expires_at - now > EXPIRY_MAX:
        raise SpecError.one("expires_at", EXPIRY_TOO_FAR)
    return expires_at


def creator_expiry(s: Session, key_id: str | None) -> datetime | None:
    """When the key `key_id` that asks for a new key expires (None: never, or no key asks:
    the CLI on the store)."""
    if key_id is None:
        return None
    return s.scalar(select(ApiKey.expires_at).where(ApiKey.id == key_id))


def bounded_expiry(expires_at: datetime | None, creator_expires_at: datetime | None, *,
                   now: datetime, field: str = "expires_in_s") -> datetime | None:
    """The expiry of a new key made by a key that expires at `creator_expires_at`: the one
    asked if it comes no later, the creator's when none is asked; asking for later is refused
    (`SpecError` naming `field`, the API's field the caller asked with: `expires_in_s` or
    `expires_at`)."""
    if creator_expires_at is None:
        return expires_at
    if expires_at is None:
        return creator_expires_at
    if expires_at > creator_expires_at:
        left_s = max(0, int((creator_expires_at - now).total_seconds()))
        ask = (f"ask for {creator_expires_at.isoformat()} at the latest" if field == "expires_at"
               else f"ask for at most {left_s} s")
        raise SpecError.one(field, f"a token cannot outlive the token that makes it, "
                            f"which expires at {creator_expires_at.isoformat()} (in {left_s} "
                            f"s); {ask}, or none to expire with it")
    return expires_at


def shown_name(key: ApiKey) -> str:
    """A key's name; a key made before names existed is called by its id."""
    return key.name or key.id


def record(key: ApiKey, tenant: str) -> TokenRecord:
    return TokenRecord(id=key.id, tenant=tenant, name=shown_name(key), prefix=key.prefix,
                       created_at=key.created_at, expires_at=key.expires_at,
                       last_used_at=key.last_used_at, revoked_at=key.revoked_at)


def add(s: Session, tenant: Tenant, *, name: str, now: datetime,
        expires_at: datetime | None = None) -> tuple[TokenRecord, str]:
    """A new key of `tenant` named `name` (unique among its unrevoked keys: the tenant's row
    is locked while it is checked); the token is returned once."""
    check_name(name)
    expires_at = check_expiry(expires_at, now=now)
    s.scalar(select(Tenant.id).where(Tenant.id == tenant.id).with_for_update())
    if _live(s, tenant.id, name) is not None:
        raise Conflict(f"tenant {tenant.name!r} has a token named {name!r} already; revoke it "
                       "or choose another name")
    token = TOKEN_PREFIX + secrets.token_urlsafe(TOKEN_BYTES)
    key = ApiKey(id="k-" + uuid.uuid4().hex[:12], tenant_id=tenant.id,
                 token_hash=hash_token(token), created_at=now, name=name,
                 prefix=token[:PREFIX_CHARS], expires_at=expires_at)
    s.add(key)
    s.flush()
    return record(key, tenant.name), token


def listed(s: Session, tenant: Tenant) -> list[TokenRecord]:
    """The tenant's unrevoked keys (expired ones too, marked so), oldest first."""
    keys = s.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant.id,
                                          ApiKey.revoked_at.is_(None))
                     .order_by(ApiKey.created_at, ApiKey.id))
    return [record(k, tenant.name) for k in keys]


def revoke(s: Session, tenant: Tenant, name: str, *, now: datetime) -> TokenRecord:
    """Revoke the tenant's unrevoked key `name`: refused from the next request on."""
    key = _live(s, tenant.id, name, lock=True)
    if key is None:
        raise NotFound(f"tenant {tenant.name!r} has no token named {name!r}")
    key.revoked_at = now
    s.flush()
    return record(key, tenant.name)


def authenticate(c: Connection, token: str, *, now: datetime) -> Row[*tuple[Any, ...]] | None:
    """The row of a live token (not revoked, not expired), or None: its tenant's columns by
    their names (what `tenants.tenant_record` reads), with the key's `key_id` and
    `key_last_used_at`. A Core read: every request makes it (issue 31)."""
    return c.execute(_LIVE_KEY, {"token_hash": hash_token(token), "now": now}).first()


# The read of every request's token, built once (issue 31); the hash and the time are bound
_LIVE_KEY = (select(*TENANTS.c, ApiKey.id.label("key_id"),
                    ApiKey.last_used_at.label("key_last_used_at"))
             .join(ApiKey, ApiKey.tenant_id == Tenant.id)
             .where(ApiKey.token_hash == bindparam("token_hash"), ApiKey.revoked_at.is_(None),
                    or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > bindparam("now"))))


def is_stale(last_used_at: datetime | None, now: datetime) -> bool:
    """Whether a key's last use is older than the resolution (so worth a write)."""
    return (last_used_at is None
            or now - last_used_at >= timedelta(seconds=LAST_USED_RESOLUTION_S))


def touch(s: Session, key_id: str, *, now: datetime) -> None:
    """Note a use of the key, unless one was noted within the resolution (by any process)."""
    s.execute(update(ApiKey).where(
        ApiKey.id == key_id, or_(ApiKey.last_used_at.is_(None), ApiKey.last_used_at
                                 <= now - timedelta(seconds=LAST_USED_RESOLUTION_S)))
              .values(last_used_at=now))


def _live(s: Session, tenant_id: str, name: str, *, lock: bool = False) -> ApiKey | None:
    named = or_(ApiKey.name == name, and_(ApiKey.name.is_(None), ApiKey.id == name))
    q = select(ApiKey).where(ApiKey.tenant_id == tenant_id, ApiKey.revoked_at.is_(None), named)
    if lock:
        q = q.with_for_update()
    return s.scalars(q.order_by(ApiKey.created_at)).first()
