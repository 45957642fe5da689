"""A tenant's named tokens through the real API over a real store (SQLite and PostgreSQL) and
Redis: create, list, revoke, expiry, last use, an admin managing another tenant's, and the
audit lines every change writes.

Each refusal is paired with the same request while the token is live, which is served: the
test would catch a check that refused everything as well as one that refused nothing.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from fastapi.testclient import TestClient

from e31.api.services import tokens as tokens_service
from e31.core.clock import utcnow
from e31.store import Repo
from e31.store.tokens import LAST_USED_RESOLUTION_S, PREFIX_CHARS
from tests.integration.conftest import bearer


def test_a_revoked_token_is_refused_on_the_very_next_request(repo: Repo,
                                                             api: TestClient) -> None:
    # Given a tenant with its first token and a second one, made over the API
    _, first = repo.create_tenant("team-a", now=utcnow())
    made = api.post("/v1/tokens", json={"name": "ci"}, headers=bearer(first))
    assert made.status_code == 201, made.text
    ci = made.json()["token"]

    # While it is live, the second token is served
    assert api.get("/v1/jobs", headers=bearer(ci)).status_code == 200

    # When the first token revokes it
    revoked = api.delete("/v1/tokens/ci", headers=bearer(first))
    assert revoked.status_code == 200, revoked.text
    assert revoked.json()["revoked_at"] is not None

    # Then the very next request with it is refused, and the first token still works
    refused = api.get("/v1/jobs", headers=bearer(ci))
    assert refused.status_code == 401 and refused.json()["error"] == "unauthorized"
    assert api.get("/v1/jobs", headers=bearer(first)).status_code == 200
    # and it is gone from the list; its name may be used again
    names = [t["name"] for t in api.get("/v1/tokens", headers=bearer(first)).json()["tokens"]]
    assert names == ["default"]
    assert api.post("/v1/tokens", json={"name": "ci"}, headers=bearer(first)).status_code == 201


def test_an_expired_token_is_refused_and_served_before_its_expiry(
        repo: Repo, api: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a token that expires in a minute
    _, first = repo.create_tenant("team-a", now=utcnow())
    made = api.post("/v1/tokens", json={"name": "short", "expires_in_s": 60},
                    headers=bearer(first))
    assert made.status_code == 201, made.text
    short = made.json()["token"]

    # Before then it is served
    assert api.get("/v1/jobs", headers=bearer(short)).status_code == 200

    # When the clock passes its expiry, the next request with it is refused (the other stays)
    real = utcnow
    monkeypatch.setattr(tokens_service, "utcnow", lambda: real() + timedelta(seconds=61))
    assert api.get("/v1/jobs", headers=bearer(short)).status_code == 401
    assert api.get("/v1/jobs", headers=bearer(first)).status_code == 200


def test_list_shows_names_prefixes_and_dates_but_never_a_token(repo: Repo,
                                                               api: TestClient) -> None:
    # Given a tenant with its first token and a second one that expires
    _, first = repo.create_tenant("team-a", now=utcnow())
    second = api.post("/v1/tokens", json={"name": "nightly", "expires_in_s": 3600},
                      headers=bearer(first)).json()["token"]
    api.get("/v1/jobs", headers=bearer(second))

    # When it lists its tokens
    listed = api.get("/v1/tokens", headers=bearer(first))

    # Then each shows its name, prefix, dates; the answer holds neither token
    assert listed.status_code == 200, listed.text
    tokens = {t["name"]: t for t in listed.json()["tokens"]}
    assert set(tokens) == {"default", "nightly"}
    assert tokens["default"]["prefix"] == first[:PREFIX_CHARS]
    assert tokens["nightly"]["prefix"] == second[:PREFIX_CHARS]
    assert tokens["nightly"]["expires_at"] is not None and not tokens["nightly"]["expired"]
    assert tokens["default"]["expires_at"] is None
    assert tokens["nightly"]["last_used_at"] is not None
    assert first not in listed.text and second not in listed.text
    assert first[PREFIX_CHARS:PREFIX_CHARS + 8] not in listed.text


def test_last_use_is_noted_at_most_once_a_minute(repo: Repo) -> None:
    # Given a fresh token, never used
    _, token = repo.create_tenant("team-a", now=utcnow())
    assert repo.list_tokens("team-a")[0].last_used_at is None
    t0 = utcnow()

    # When it is used now, 30 s later, and past the resolution
    repo.tenant_for_token(token, now=t0)
    repo.tenant_for_token(token, now=t0 + timedelta(seconds=30))
    noted = repo.list_tokens("team-a")[0].last_used_at
    repo.tenant_for_token(token, now=t0 + timedelta(seconds=LAST_USED_RESOLUTION_S + 1))

    # Then the first use was noted and the second not (within the minute); the third was
    assert noted == t0
    later = repo.list_tokens("team-a")[0].last_used_at
    assert later == t0 + timedelta(seconds=LAST_USED_RESOLUTION_S + 1)


def test_a_tenant_manages_only_its_own_tokens_and_an_admin_any_tenants(
        repo: Repo, api: TestClient) -> None:
    # Given two tenants and an admin
    _, a = repo.create_tenant("team-a", now=utcnow())
    _, b = repo.create_tenant("team-b", now=utcnow())
    _, root = repo.create_tenant("ops", admin=True, now=utcnow())

    # A tenant asking about another's tokens is refused, each way
    for call in (lambda h: api.get("/v1/tokens?tenant=team-b", headers=h),
                 lambda h: api.post("/v1/tokens?tenant=team-b", json={"name": "x"}, headers=h),
                 lambda h: api.delete("/v1/tokens/default?tenant=team-b", headers=h)):
        assert call(bearer(a)).status_code == 403
    assert api.get("/v1/tokens?tenant=team-a", headers=bearer(a)).status_code == 200  # its own

    # An admin makes, lists and revokes another tenant's token
    made = api.post("/v1/tokens?tenant=team-b", json={"name": "ops-made"}, headers=bearer(root))
    assert made.status_code == 201 and made.json()["tenant"] == "team-b"
    assert api.get("/v1/jobs", headers=bearer(made.json()["token"])).status_code == 200
    assert api.delete("/v1/tokens/default?tenant=team-b", headers=bearer(root)).status_code == 200
    assert api.get("/v1/jobs", headers=bearer(b)).status_code == 401
    assert api.get("/v1/tokens?tenant=nobody", headers=bearer(root)).status_code == 404

    # A taken name, an unknown one and a bad one are refused with what is wrong
    taken = api.post("/v1/tokens", json={"name": "default"}, headers=bearer(a))
    assert taken.status_code == 409 and "default" in taken.json()["message"]
    assert api.delete("/v1/tokens/nope", headers=bearer(a)).status_code == 404
    bad = api.post("/v1/tokens", json={"name": "no spaces"}, headers=bearer(a))
    assert bad.status_code == 422 and bad.json()["errors"][0]["field"] == "name"


def test_every_token_change_is_audited_with_who_what_and_where(repo: Repo,
                                                               api: TestClient) -> None:
    # Given a tenant that makes and revokes a token over the API
    tenant, a = repo.create_tenant("team-a", now=utcnow())
    key_id = repo.tenant_for_token(a).key_id
    api.post("/v1/tokens", json={"name": "ci", "expires_in_s": 600}, headers=bearer(a))
    api.delete("/v1/tokens/ci", headers=bearer(a))

    # Then the audit log holds both, after the local creation of the tenant
    lines = [(e.actor, e.action, e.target) for e in repo.audit_log()]
    assert lines == [("local", "tenant.create", "team-a"), ("team-a", "token.create", "team-a/ci"),
                     ("team-a", "token.revoke", "team-a/ci")]
    last = repo.audit_log()[-1]
    assert last.actor_key == key_id and last.source == "testclient"


