"""A token never outlives, and never holds more than, the token that made it: through the real
API over a real store (SQLite and PostgreSQL), reading each new token's expiry as stored
(issue 25).

Each refusal is paired with a request the same token may make, which is served.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from fastapi.testclient import TestClient
from sqlalchemy import select

from e31.core.clock import utcnow
from e31.store import Repo
from e31.store.models import ApiKey
from tests.integration.conftest import bearer


def stored_expiry(repo: Repo, tenant: str, name: str) -> datetime | None:
    """The expiry the store holds for the tenant's live token `name` (read from its row)."""
    [token] = [t for t in repo.list_tokens(tenant) if t.name == name]
    with repo.engine.connect() as conn:
        expires: datetime | None = conn.scalar(select(ApiKey.expires_at)
                                               .where(ApiKey.id == token.id))
    assert token.expires_at == expires   # the record shows what the row holds
    return expires


def short_token(repo: Repo, api: TestClient, *, admin: bool = False,
                seconds: int = 60) -> tuple[str, datetime]:
    """A tenant's token made over the API to expire in `seconds`, and its stored expiry."""
    _, first = repo.create_tenant("team-a", admin=admin, now=utcnow())
    made = api.post("/v1/tokens", json={"name": "short", "expires_in_s": seconds},
                    headers=bearer(first))
    assert made.status_code == 201, made.text
    expires = stored_expiry(repo, "team-a", "short")
    assert expires is not None
    return made.json()["token"], expires


def test_a_token_cannot_make_one_that_expires_later_than_itself(repo: Repo,
                                                                api: TestClient) -> None:
    # Given a token that expires in 60 s
    short, expires = short_token(repo, api)

    # When it asks for a token that expires in an hour
    longer = api.post("/v1/tokens", json={"name": "longer", "expires_in_s": 3600},
                      headers=bearer(short))

    # Then it is refused naming expires_in_s, and no such token exists
    assert longer.status_code == 422, longer.text
    assert longer.json()["errors"][0]["field"] == "expires_in_s"
    assert "cannot outlive the token that makes it" in longer.json()["message"]
    assert "longer" not in [t.name for t in repo.list_tokens("team-a")]

    # while one that expires sooner is made, with the expiry it asked for
    sooner = api.post("/v1/tokens", json={"name": "sooner", "expires_in_s": 30},
                      headers=bearer(short))
    assert sooner.status_code == 201, sooner.text
    stored = stored_expiry(repo, "team-a", "sooner")
    assert stored is not None and stored < expires
    assert stored - utcnow() <= timedelta(seconds=30)
    assert sooner.json()["expires_at"] == stored.isoformat()


def test_a_token_cannot_make_one_that_expires_at_an_instant_after_itself(
        repo: Repo, api: TestClient) -> None:
    # Given a token that expires in 60 s
    short, expires = short_token(repo, api)

    # When it asks for a token that expires at an instant an hour away
    later = (expires + timedelta(hours=1)).isoformat()
    longer = api.post("/v1/tokens", json={"name": "longer", "expires_at": later},
                      headers=bearer(short))

    # Then it is refused naming expires_at, the field it asked with, and saying until when
    assert longer.status_code == 422, longer.text
    assert longer.json()["errors"][0]["field"] == "expires_at"
    assert f"ask for {expires.isoformat()} at the latest" in longer.json()["message"]
    # while its own expiry, to the microsecond, is served and kept
    same = api.post("/v1/tokens", json={"name": "same", "expires_at": expires.isoformat()},
                    headers=bearer(short))
    assert same.status_code == 201, same.text
    assert stored_expiry(repo, "team-a", "same") == expires


def test_a_token_asked_to_never_expire_expires_with_its_maker(repo: Repo,
                                                              api: TestClient) -> None:
    # Given a token that expires in 60 s
    short, expires = short_token(repo, api)

    # When it asks for a token with no expiry
    made = api.post("/v1/tokens", json={"name": "forever"}, headers=bearer(short))

    # Then the new token expires exactly when its maker does, and the answer says so
    assert made.status_code == 201, made.text
    assert stored_expiry(repo, "team-a", "forever") == expires
    assert made.json()["expires_at"] == expires.isoformat()


def test_a_token_that_never_expires_still_makes_one_that_never_expires(
        repo: Repo, api: TestClient) -> None:
    # Given a tenant's first token, which never expires
    _, first = repo.create_tenant("team-a", now=utcnow())
    assert stored_expiry(repo, "team-a", "default") is None

    # When it asks for a token with no expiry, and one for ten years
    made = api.post("/v1/tokens", json={"name": "forever"}, headers=bearer(first))
    later = api.post("/v1/tokens", json={"name": "decade", "expires_in_s": 315_000_000},
                     headers=bearer(first))

    # Then both are made as asked
    assert made.status_code == 201 and later.status_code == 201, made.text + later.text
    assert stored_expiry(repo, "team-a", "forever") is None
    assert stored_expiry(repo, "team-a", "decade") is not None


def test_an_expiring_admin_token_makes_no_longer_lived_token_for_any_tenant(
        repo: Repo, api: TestClient) -> None:
    # Given an admin's token that expires in 60 s, and another tenant
    short, expires = short_token(repo, api, admin=True)
    repo.create_tenant("team-b", now=utcnow())

    # When it makes a token of the other tenant with no expiry, and asks for a longer one
    made = api.post("/v1/tokens?tenant=team-b", json={"name": "ci"}, headers=bearer(short))
    longer = api.post("/v1/tokens?tenant=team-b", json={"name": "ci2", "expires_in_s": 3600},
                      headers=bearer(short))

    # Then the first expires with the admin's token and the second is refused
    assert made.status_code == 201, made.text
    assert stored_expiry(repo, "team-b", "ci") == expires
    assert longer.status_code == 422 and longer.json()["errors"][0]["field"] == "expires_in_s"

    # When it creates a tenant (an admin one, the most it may give)
    tenant = api.post("/v1/admin/tenants", json={"name": "team-c", "admin": True},
                      headers=bearer(short))

    # Then that tenant's first token also expires with the admin's token
    assert tenant.status_code == 201, tenant.text
    assert stored_expiry(repo, "team-c", "default") == expires


def test_a_token_has_its_tenants_rights_and_cannot_make_one_with_more(
        repo: Repo, api: TestClient) -> None:
    # Given a tenant that is not an admin, and a token it made
    _, first = repo.create_tenant("team-a", now=utcnow())
    repo.create_tenant("root", admin=True, now=utcnow())
    made = api.post("/v1/tokens", json={"name": "ci"}, headers=bearer(first))
    assert made.status_code == 201, made.text
    ci = made.json()["token"]

    # Then the new token is as unprivileged as its maker: no admin routes
    assert api.get("/v1/admin/tenants", headers=bearer(ci)).status_code == 403
    # it cannot make a token of the admin tenant, nor a tenant at all (let alone an admin one)
    assert api.post("/v1/tokens?tenant=root", json={"name": "x"},
                    headers=bearer(ci)).status_code == 403
    assert api.post("/v1/admin/tenants", json={"name": "mine", "admin": True},
                    headers=bearer(ci)).status_code == 403
    assert [t.name for t in repo.list_tokens("root")] == ["default"]
    # and a token body cannot name rights: scopes or an admin flag are unknown fields
    for extra in ({"admin": True}, {"scopes": ["admin"]}, {"tenant": "root"}):
        asked = api.post("/v1/tokens", json={"name": "y", **extra}, headers=bearer(ci))
        assert asked.status_code == 422, asked.text
    # while what it may do, it does
    assert api.get("/v1/tokens", headers=bearer(ci)).status_code == 200
