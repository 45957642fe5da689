"""Limits per tenant (e31.core.tenantlimits) through the real API over a real store (SQLite and
PostgreSQL) and the private Redis: each limit refused with its status and a message naming it,
storing nothing; the same request under the limit, or with an admin's override in
`tenants.limits`, taken (so no test passes for want of a request that works). The submit rate
is one bucket for every API process; two submits racing at the queue's limit do not both pass.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import func, select, update

from e31.api.services import Services
from e31.core.clock import utcnow
from e31.core.errors import LimitExceeded, SpecError
from e31.core.spec import JobSpec
from e31.core.tenantlimits import TenantLimits, check_limits
from e31.edge.artifacts import ArtifactStore
from e31.edge.settings import Settings
from e31.store import Repo
from e31.store import jobs as jobs_module
from e31.store.models import Job, Tenant
from e31.store.tenantlimits import hold_queued
from tests.integration.conftest import MakeApp

CPU = {"command": ["true"], "resources": {"gpus": 0}}
RACERS = 8
RACE_WINDOW_S = 0.2    # between a queue check and its insert: what a slow store would take


@pytest.fixture
def head(repo: Repo) -> dict[str, str]:
    _, token = repo.create_tenant("alpha", now=utcnow())
    return {"Authorization": f"Bearer {token}"}


def grant(repo: Repo, tenant: str, **limits: Any) -> None:
    """An admin's override, as the admin API stores it (validated by `check_limits`)."""
    with repo.engine.begin() as conn:
        conn.execute(update(Tenant).where(Tenant.name == tenant)
                     .values(limits=check_limits(limits)))


def jobs_of(repo: Repo, tenant: str = "alpha") -> int:
    with repo.engine.connect() as conn:
        tenant_id = conn.execute(select(Tenant.id).where(Tenant.name == tenant)).scalar_one()
    return len(repo.list_jobs(tenant_id, limit=100_000))


def test_a_priority_above_the_tenants_highest_is_refused_until_an_admin_grants_it(
        make_app: MakeApp, repo: Repo, head: dict[str, str]) -> None:
    client = TestClient(make_app())
    urgent = {**CPU, "priority": 9}

    job = client.post("/v1/jobs", json=urgent, headers=head)
    dry = client.post("/v1/jobs?dry_run=true", json=urgent, headers=head)
    array = client.post("/v1/arrays", json={"items": [CPU, urgent]}, headers=head)

    assert job.status_code == dry.status_code == array.status_code == 422
    assert job.json()["message"] == ("priority: at most 5 for tenant alpha "
                                     "(limits.max_priority); ask an admin")
    assert [e["field"] for e in array.json()["errors"]] == ["items[1].priority"]
    assert jobs_of(repo) == 0
    assert client.post("/v1/jobs", json={**CPU, "priority": 5}, headers=head).status_code == 201
    grant(repo, "alpha", max_priority=9)
    assert client.post("/v1/jobs", json=urgent, headers=head).json()["priority"] == 9
    assert jobs_of(repo) == 2


def test_an_array_larger_than_the_tenants_limit_is_refused(
        make_app: MakeApp, repo: Repo, head: dict[str, str]) -> None:
    client = TestClient(make_app(tenant_max_array_items=3))
    four = {"items": [{"params": {}} for _ in range(4)], "defaults": CPU}

    refused = client.post("/v1/arrays", json=four, headers=head)

    assert refused.status_code == 422
    assert refused.json()["errors"] == [{"field": "items", "reason": (
        "4 items; at most 3 per array for tenant alpha (limits.max_array_items): submit "
        "several arrays, or ask an admin")}]
    assert jobs_of(repo) == 0
    three = {"items": four["items"][:3], "defaults": CPU}
    assert client.post("/v1/arrays", json=three, headers=head).status_code == 201
    grant(repo, "alpha", max_array_items=4)
    assert client.post("/v1/arrays", json=four, headers=head).status_code == 201
    assert jobs_of(repo) == 7


def test_a_body_over_the_tenants_limit_is_refused_413(
        make_app: MakeApp, repo: Repo, head: dict[str, str]) -> None:
    client = TestClient(make_app(tenant_max_request_bytes=2048))
    big = {**CPU, "command": ["echo", "x" * 3000]}

    refused = [client.post("/v1/jobs", json=big, headers=head),
               client.post("/v1/jobs?dry_run=true", json=big, headers=head),
               client.post("/v1/arrays", json={"items": [big]}, headers=head)]

    assert [r.status_code for r in refused] == [413, 413, 413]
    assert {r.json()["limit_bytes"] for r in refused} == {2048}
    assert "limits.max_request_bytes" in refused[0].json()["message"]
    assert jobs_of(repo) == 0
    assert client.post("/v1/jobs", json=CPU, headers=head).status_code == 201
    grant(repo, "alpha", max_request_bytes=1 << 20)
    assert client.post("/v1/jobs", json=big, headers=head).status_code == 201
    assert jobs_of(repo) == 2


def test_a_tenant_at_its_most_queued_jobs_gets_429_and_stores_nothing(
        make_app: MakeApp, repo: Repo, head: dict[str, str]) -> None:
    client = TestClient(make_app(tenant_max_queued=2))
    assert client.post("/v1/jobs", json=CPU, headers=head).status_code == 201

    pair = client.post("/v1/arrays", json={"items": [CPU, CPU]}, headers=head)   # 1 + 2 > 2
    assert client.post("/v1/jobs", json=CPU, headers=head).status_code == 201    # 2 of 2
    full = client.post("/v1/jobs", json=CPU, headers=head)

    for refused in (pair, full):
        assert refused.status_code == 429
        assert refused.json()["error"] == "limit_exceeded"
        assert "limits.max_queued" in refused.json()["message"]
        assert int(refused.headers["Retry-After"]) >= 1
    assert jobs_of(repo) == 2
    grant(repo, "alpha", max_queued=3)
    assert client.post("/v1/jobs", json=CPU, headers=head).status_code == 201
    assert jobs_of(repo) == 3
    # a job that leaves the queue makes room again
    [job, *_] = client.get("/v1/jobs", headers=head).json()["jobs"]
    assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=head).status_code == 200
    assert client.post("/v1/jobs", json=CPU, headers=head).status_code == 201


def test_the_submit_rate_is_one_bucket_for_every_api_process(
        make_app: MakeApp, repo: Repo, head: dict[str, str]) -> None:
    # Two API processes (two apps, each its own Services) sharing Redis: three at once, then
    # one a hundred seconds, whichever process a request reaches.
    one, two = (TestClient(make_app(tenant_submit_rate_per_s=0.01, tenant_submit_burst=3))
                for _ in range(2))
    taken = [c.post("/v1/jobs", json=CPU, headers=head).status_code for c in (one, two, one)]

    refused = [c.post("/v1/jobs", json=CPU, headers=head) for c in (two, one)]
    array = two.post("/v1/arrays", json={"items": [CPU]}, headers=head)

    assert taken == [201, 201, 201]
    for answer in (*refused, array):
        assert answer.status_code == 429
        assert "limits.submit_rate_per_s" in answer.json()["message"]
        assert 1 <= int(answer.headers["Retry-After"]) <= 100
    assert jobs_of(repo) == 3
    # another tenant has its own bucket; an admin's higher rate refills this one at once
    _, token = repo.create_tenant("beta", now=utcnow())
    assert one.post("/v1/jobs", json=CPU,
                    headers={"Authorization": f"Bearer {token}"}).status_code == 201
    grant(repo, "alpha", submit_rate_per_s=1_000_000)
    assert two.post("/v1/jobs", json=CPU, headers=head).status_code == 201
    assert jobs_of(repo) == 4


def unlocked_count(s: Any, tenant_id: str, *, adding: int, max_queued: int) -> None:
    """The queue check without the tenant's row lock: the hole `hold_queued` closes."""
    queued = s.scalar(select(func.count()).select_from(Job).where(
        Job.tenant_id == tenant_id, Job.state == "queued"))
    time.sleep(RACE_WINDOW_S)
    if queued + adding > max_queued:
        raise LimitExceeded("full")


def slowed(s: Any, tenant_id: str, *, adding: int, max_queued: int) -> None:
    """`hold_queued` as it is, with the same window after it."""
    hold_queued(s, tenant_id, adding=adding, max_queued=max_queued)
    time.sleep(RACE_WINDOW_S)


@pytest.mark.parametrize("check", [slowed, unlocked_count], ids=["locked", "unlocked"])
def test_submits_racing_at_the_queue_limit_do_not_all_pass(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path, check: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    if check is unlocked_count and repo.engine.dialect.name == "sqlite":
        pytest.skip("SQLite's BEGIN IMMEDIATE serialises every writer: no race to show there")
    # Given a tenant one job below its limit, a window between the check and the insert,
    # and eight submits released at once
    monkeypatch.setattr(jobs_module, "hold_queued", check)
    settings = Settings(redis_url="redis://unused", home=tmp_path, tenant_max_queued=4)
    service = Services(settings=settings, repo=repo,
                       artifacts=ArtifactStore(f"file://{tmp_path / 'a'}"),
                       redis_client=redis_client).jobs
    _, token = repo.create_tenant("alpha", now=utcnow())
    tenant = repo.tenant_for_token(token)
    assert tenant is not None
    spec = JobSpec.parse(CPU)
    for _ in range(3):
        service.submit(tenant, spec)
    start = threading.Barrier(RACERS)
    outcomes: list[str] = []

    def racer() -> None:
        start.wait()
        try:
            service.submit(tenant, spec)
            outcomes.append("taken")
        except LimitExceeded:
            outcomes.append("refused")

    threads = [threading.Thread(target=racer) for _ in range(RACERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    # Then exactly one gets the last place; without the row lock, several do
    if check is slowed:
        assert sorted(outcomes) == ["refused"] * (RACERS - 1) + ["taken"]
        assert jobs_of(repo) == 4
    else:
        assert outcomes.count("taken") > 1 and jobs_of(repo) > 4


def test_limits_overrides_are_validated_for_the_admin_api() -> None:
    assert check_limits({"max_priority": 7.0, "max_queued": None}) == {"max_priority": 7}
    for bad, field in [({"max_priority": 10}, "limits.max_priority"),
                       ({"max_queued": True}, "limits.max_queued"),
                       ({"submit_rate_per_s": float("nan")}, "limits.submit_rate_per_s"),
                       ({"max_request_bytes": 10}, "limits.max_request_bytes"),
                       ({"colour": 1}, "limits.colour")]:
        with pytest.raises(SpecError) as refused:
            check_limits(bad)
        assert refused.value.errors[0]["field"] == field
    defaults = Settings().tenant_limits
    assert TenantLimits.of(defaults, {"max_priority": 9}).max_priority == 9
    assert TenantLimits.of(defaults, {"max_priority": "9"}) == defaults   # a hand-edited row
