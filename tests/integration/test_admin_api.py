"""Tenants managed over the real admin API (SQLite and PostgreSQL, real Redis): create, read,
update weight, quotas and limits, disable and enable; a tenant's token refused there; a
disabled tenant's tokens refused and its queued jobs held by a real scheduler tick until it is
enabled; every admin action in the audit log, readable over the API and with `e31 audit`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import select

from e31.api.services.jobs import JobService
from e31.core.clock import utcnow
from e31.store import Repo
from e31.store.models import Job
from tests.integration.conftest import bearer
from tests.integration.test_scheduler import heartbeat, make, published, submit

ADMIN_ROUTES = [("GET", "/v1/admin/tenants", None), ("POST", "/v1/admin/tenants", {"name": "x"}),
                ("GET", "/v1/admin/tenants/team-a", None),
                ("PATCH", "/v1/admin/tenants/team-a", {"weight": 2.0}),
                ("POST", "/v1/admin/tenants/team-a/disable", None),
                ("POST", "/v1/admin/tenants/team-a/enable", None),
                ("GET", "/v1/admin/audit", None)]


def test_a_tenant_token_gets_403_where_an_admin_token_is_served(repo: Repo,
                                                                api: TestClient) -> None:
    # Given a tenant and an admin
    _, a = repo.create_tenant("team-a", now=utcnow())
    _, root = repo.create_tenant("ops", admin=True, now=utcnow())

    # Then every admin route refuses the tenant's token, and serves the admin's
    for method, path, body in ADMIN_ROUTES:
        refused = api.request(method, path, json=body, headers=bearer(a))
        assert refused.status_code == 403, (method, path, refused.text)
        assert refused.json()["error"] == "forbidden"
    for method, path, body in ADMIN_ROUTES:
        served = api.request(method, path, json=body, headers=bearer(root))
        assert served.status_code in (200, 201), (method, path, served.text)


def test_an_admin_creates_updates_and_reads_a_tenant_over_the_api(repo: Repo,
                                                                  api: TestClient) -> None:
    # Given an admin
    _, root = repo.create_tenant("ops", admin=True, now=utcnow())

    # When it creates a tenant with a weight, a quota and a limit
    made = api.post("/v1/admin/tenants", headers=bearer(root), json={
        "name": "vision", "weight": 2.0, "quotas": {"gpu80": 4},
        "limits": {"max_priority": 7}})

    # Then the answer holds its first token once, and the token works
    assert made.status_code == 201, made.text
    body = made.json()
    assert (body["tenant"], body["weight"], body["quotas"], body["limits"]) == (
        "vision", 2.0, {"gpu80": 4}, {"max_priority": 7})
    assert api.get("/v1/jobs", headers=bearer(body["token"])).status_code == 200
    assert [t["name"] for t in api.get("/v1/tokens", headers=bearer(body["token"]))
            .json()["tokens"]] == ["default"]

    # When it changes the weight, drops the quota, sets one limit and returns another
    changed = api.patch("/v1/admin/tenants/vision", headers=bearer(root), json={
        "weight": 3.5, "quotas": {"gpu80": None, "gpu24": 2},
        "limits": {"max_priority": None, "max_queued": 100}})
    assert changed.status_code == 200, changed.text
    shown = api.get("/v1/admin/tenants/vision", headers=bearer(root)).json()
    assert (shown["weight"], shown["quotas"], shown["limits"]) == (
        3.5, {"gpu24": 2}, {"max_queued": 100})
    assert [t["tenant"] for t in api.get("/v1/admin/tenants", headers=bearer(root))
            .json()["tenants"]] == ["ops", "vision"]

    # And what is wrong is named: a wrong type, an unknown class, a taken name, no tenant
    wrong = api.patch("/v1/admin/tenants/vision", headers=bearer(root),
                      json={"limits": {"max_queued": "lots"}})
    assert wrong.status_code == 422 and wrong.json()["errors"][0]["field"] == "limits.max_queued"
    unknown = api.patch("/v1/admin/tenants/vision", headers=bearer(root),
                        json={"quotas": {"gpu999": 1}})
    assert unknown.status_code == 422 and "quotas" in unknown.json()["errors"][0]["field"]
    again = api.post("/v1/admin/tenants", headers=bearer(root), json={"name": "vision"})
    assert again.status_code == 409
    assert api.get("/v1/admin/tenants/nobody", headers=bearer(root)).status_code == 404


def test_a_disabled_tenant_is_refused_its_jobs_wait_and_enabling_resumes_them(
        repo: Repo, api: TestClient, redis_url: str, redis_client: redis.Redis) -> None:
    # Given two tenants with a queued job each, an admin, and one idle cpu worker
    team_a, a = repo.create_tenant("team-a", now=utcnow())
    team_b, _ = repo.create_tenant("team-b", now=utcnow())
    _, root = repo.create_tenant("ops", admin=True, now=utcnow())
    job_a = submit(repo, team_a.id, resources={"gpus": 0})
    job_b = submit(repo, team_b.id, resources={"gpus": 0})
    heartbeat(redis_client, "cpu0@n", ["e31.cpu"], gpus="")
    heartbeat(redis_client, "cpu1@n", ["e31.cpu"], gpus="")
    scheduler = make(repo, redis_url, dispatch_headroom=0)

    # When the admin disables team-a
    disabled = api.post("/v1/admin/tenants/team-a/disable", headers=bearer(root))
    assert disabled.status_code == 200 and disabled.json()["disabled"] is True

    # Then its token is refused with a clear 403 (it was served before: see the end), the
    # scheduler publishes only the other tenant's job, and team-a's waits as tenant_disabled
    refused = api.get("/v1/jobs", headers=bearer(a))
    assert refused.status_code == 403 and "disabled" in refused.json()["message"]
    assert scheduler.tick() == 1
    assert published(redis_client, "e31.cpu") == [job_b]
    with repo.engine.connect() as c:
        stored = c.execute(select(Job.state, Job.pending_reason).where(Job.id == job_a)).one()
    assert tuple(stored) == ("queued", "tenant_disabled")
    service: JobService = api.app.state.services.jobs   # the status its tenant would read
    assert service.get(team_a, job_a).pending["reason"] == "tenant_disabled"
    assert api.post("/v1/admin/tenants/ops/disable", headers=bearer(root)).status_code == 409

    # When the admin enables it again, its token is served and the next tick publishes its job
    assert api.post("/v1/admin/tenants/team-a/enable", headers=bearer(root)).status_code == 200
    assert api.get("/v1/jobs", headers=bearer(a)).status_code == 200
    status = api.get(f"/v1/jobs/{job_a}", headers=bearer(a)).json()
    assert status["pending"]["reason"] != "tenant_disabled"
    assert scheduler.tick() == 1
    assert sorted(published(redis_client, "e31.cpu")) == sorted([job_a, job_b])


def test_every_admin_action_is_audited_and_read_over_the_api_and_the_cli(
        repo: Repo, api: TestClient, database_url: str, tmp_path: Path) -> None:
    # Given an admin that creates, changes, disables and enables a tenant over the API
    _, root = repo.create_tenant("ops", admin=True, now=utcnow())
    root_key = repo.tenant_for_token(root).key_id
    api.post("/v1/admin/tenants", headers=bearer(root), json={"name": "team-a"})
    api.patch("/v1/admin/tenants/team-a", headers=bearer(root), json={"weight": 2.0})
    api.post("/v1/admin/tenants/team-a/disable", headers=bearer(root))
    api.post("/v1/admin/tenants/team-a/enable", headers=bearer(root))

    # Then the audit log over the API names each, with who and from where
    events = api.get("/v1/admin/audit", headers=bearer(root)).json()["events"]
    assert [(e["actor"], e["action"], e["target"]) for e in events] == [
        ("local", "tenant.create", "ops"), ("ops", "tenant.create", "team-a"),
        ("ops", "tenant.update", "team-a"), ("ops", "tenant.disable", "team-a"),
        ("ops", "tenant.enable", "team-a")]
    assert {(e["actor_key"], e["source"]) for e in events[1:]} == {(root_key, "testclient")}
    assert events[2]["detail"] == {"weight": 2.0}
    since = events[3]["at"]
    assert [e["action"] for e in api.get("/v1/admin/audit", params={"since": since},
                                         headers=bearer(root)).json()["events"]] == [
        "tenant.disable", "tenant.enable"]

    # And `e31 audit --json` on the store reads the same lines
    env = {k: v for k, v in os.environ.items() if k not in ("E31_URL", "E31_TOKEN")}
    env.update(E31_HOME=str(tmp_path), E31_DATABASE_URL=database_url)
    run = subprocess.run([sys.executable, "-m", "e31.cli", "audit", "--json"], env=env,
                         capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    assert [e["action"] for e in json.loads(run.stdout)["events"]] == [e["action"]
                                                                       for e in events]


def test_the_tenant_commands_work_on_the_store_and_through_the_api_alike(
        repo: Repo, api: TestClient, database_url: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given the CLI on this machine's store, and an admin's token of the API over it
    from typer.testing import CliRunner

    from e31.cli import app
    from tests.integration.test_api_limits import serving
    for var in ("E31_URL", "E31_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("E31_HOME", str(tmp_path))
    monkeypatch.setenv("E31_DATABASE_URL", database_url)
    _, root = repo.create_tenant("ops", admin=True, now=utcnow())
    cli = CliRunner()

    def e31(*args: str) -> Any:
        done = cli.invoke(app, list(args))
        assert done.exit_code == 0, (args, done.output)
        return json.loads(done.output) if "--json" in args else done.output

    # When a tenant is made, changed, disabled and enabled on the store
    assert e31("tenant", "create", "team-a", "--limit", "max_priority=7", "--json")[
        "limits"] == {"max_priority": 7}
    assert e31("tenant", "update", "team-a", "--no-limit", "max_priority", "--limit",
               "max_queued=50", "--json")["limits"] == {"max_queued": 50}
    assert e31("tenant", "disable", "team-a", "--json")["disabled"] is True
    assert [t["tenant"] for t in e31("tenant", "list", "--json")["tenants"]] == ["ops", "team-a"]
    assert e31("tenant", "enable", "team-a", "--json")["disabled"] is False
    bad = cli.invoke(app, ["tenant", "create", "no spaces"])   # a name the API could not address
    assert bad.exit_code == 2 and "name" in bad.output

    # Then through the API with --url and the admin's token, the same commands read the same
    with serving(api.app) as port:       # type: ignore[arg-type]
        remote = ("--url", f"http://127.0.0.1:{port}", "--token", root)
        assert e31("tenant", "show", "team-a", *remote, "--json") == e31(
            "tenant", "show", "team-a", "--json")
        made = e31("tenant", "create", "team-b", "--quota", "gpu24=2", *remote, "--json")
        assert made["quotas"] == {"gpu24": 2} and made["token"].startswith("e31_")
        assert e31("tenant", "disable", "team-b", *remote, "--json")["disabled"] is True
        assert "team-b (admin)" not in e31("tenant", "list", *remote)
        # and a tenant's token is refused there: exit 2 with the API's message
        refused = cli.invoke(app, ["tenant", "list", "--url", f"http://127.0.0.1:{port}",
                                   "--token", made["token"]])
        assert refused.exit_code == 2 and "disabled" in refused.output
    actions = [(e.actor, e.action, e.target) for e in repo.audit_log()][1:]
    assert actions == [("local", "tenant.create", "team-a"), ("local", "tenant.update", "team-a"),
                       ("local", "tenant.disable", "team-a"), ("local", "tenant.enable", "team-a"),
                       ("ops", "tenant.create", "team-b"), ("ops", "tenant.disable", "team-b")]
