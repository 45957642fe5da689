"""Setting and deleting a secret is in the audit log (issue 13's leftover, issue 17): who, which
secret (`tenant/NAME`), from where; never its value, in any column of any line."""

from __future__ import annotations

import json
from pathlib import Path

import redis
from fastapi.testclient import TestClient

from e31.api import create_app
from e31.api.services import Services
from e31.core.clock import utcnow
from e31.edge.artifacts import ArtifactStore
from e31.edge.secrets import generate_key
from e31.edge.settings import Settings
from e31.store import Repo
from tests.integration.conftest import bearer

VALUE = "hf_" + "s3cr3t-value-" * 4


def test_secret_set_and_delete_are_audited_by_name_never_by_value(
        repo: Repo, redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given a pool with a secrets key, an admin, and a tenant with a token
    settings = Settings(redis_url=redis_url, home=tmp_path, secrets_key=generate_key())
    service = Services(settings=settings, repo=repo, redis_client=redis_client,
                      artifacts=ArtifactStore(f"file://{tmp_path / 'artifacts'}"))
    api = TestClient(create_app(settings, services=service))
    _, root = repo.create_tenant("ops", admin=True, now=utcnow())
    _, token = repo.create_tenant("team-a", now=utcnow())
    key = repo.tenant_for_token(token).key_id   # type: ignore[union-attr]

    # When the tenant sets a secret, replaces it, deletes it, and deletes one it lacks
    assert api.put("/v1/secrets/HF_TOKEN", json={"value": VALUE},
                   headers=bearer(token)).status_code == 201
    assert api.put("/v1/secrets/HF_TOKEN", json={"value": VALUE + "2"},
                   headers=bearer(token)).status_code == 200
    assert api.delete("/v1/secrets/HF_TOKEN", headers=bearer(token)).status_code == 200
    assert api.delete("/v1/secrets/HF_TOKEN", headers=bearer(token)).status_code == 404

    # Then the audit log has a line for each change, naming the secret and who asked
    events = api.get("/v1/admin/audit", headers=bearer(root)).json()["events"]
    lines = [(e["actor"], e["actor_key"], e["source"], e["action"], e["target"], e["detail"])
             for e in events if e["action"].startswith("secret.")]
    assert lines == [
        ("team-a", key, "testclient", "secret.set", "team-a/HF_TOKEN", {"created": True}),
        ("team-a", key, "testclient", "secret.set", "team-a/HF_TOKEN", {"created": False}),
        ("team-a", key, "testclient", "secret.delete", "team-a/HF_TOKEN", None)]
    # and the value is in no line of the log (the search finds what the log does hold)
    log = json.dumps(events)
    assert "HF_TOKEN" in log
    assert "s3cr3t-value" not in log
    api.close()
