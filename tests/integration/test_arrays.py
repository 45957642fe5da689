"""Arrays (sweeps) on a real store and Redis: one transaction, counts, cancel, manifest, scoping."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from e31.api import create_app
from e31.api.services import Services
from e31.core import keys
from e31.core.clock import utcnow
from e31.core.errors import NotFound, SpecError
from e31.core.records import Outcome, TenantRecord
from e31.core.sizeclasses import route
from e31.core.spec import JobSpec
from e31.core.states import AttemptReason
from e31.edge.artifacts import ArtifactStore
from e31.edge.settings import Settings
from e31.ops.sweep import MAX_ARRAY_ITEMS
from e31.store import Repo
from tests.integration.test_store import publish

CLASSES = Settings().size_classes
CPU = {"entrypoint": "pkg.mod:main", "resources": {"gpus": 0}}


@pytest.fixture
def service(repo: Repo, redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> Services:
    return Services(settings=Settings(redis_url=redis_url, home=tmp_path), repo=repo,
                   artifacts=ArtifactStore(f"file://{tmp_path / 'artifacts'}"),
                   redis_client=redis_client)


@pytest.fixture
def tenant(repo: Repo) -> TenantRecord:
    return repo.create_tenant("team-a", now=utcnow())[0]


def items(n: int, **fields: object) -> list[dict[str, object]]:
    return [{"params": {"i": i}, **fields} for i in range(n)]


def count(repo: Repo, table: str) -> int:
    with repo.engine.connect() as conn:
        return int(conn.exec_driver_sql(f"SELECT count(*) FROM {table}").scalar_one())


def claim(repo: Repo, job_id: str):  # type: ignore[no-untyped-def]
    return repo.claim(job_id, dispatch_token=publish(repo, job_id), worker="cpu0@test", gpus="",
                      gpu_count=0, now=utcnow(), lease_ttl_s=30)


def test_an_array_stores_every_item_queued_in_index_order_and_wakes_the_scheduler_once(
        service: Services, repo: Repo, tenant: TenantRecord, redis_client: redis.Redis) -> None:
    # Given five items over common defaults
    # When they are submitted as one array
    array = service.arrays.submit(tenant, items(5), name="lr-sweep", defaults=CPU)

    # Then the array and its five jobs are stored, queued, in index order
    assert array.id.startswith("a-") and array.size == 5
    status = service.arrays.get(tenant, array.id).to_status()
    assert (status["state"], status["total"], status["queued"], status["done"]) == \
        ("queued", 5, 5, 0)
    assert [i["index"] for i in status["items"]] == [0, 1, 2, 3, 4]
    job = repo.get_job(tenant.id, status["items"][3]["id"])
    assert (job.array_id, job.array_index, job.name) == (array.id, 3, "lr-sweep[3]")
    assert job.spec["params"] == {"i": 3} and job.queue == "e31.cpu"
    assert job.to_status()["array_id"] == array.id
    # and the scheduler was woken once, not five times
    assert redis_client.llen(keys.WAKE) == 1


def test_one_bad_item_refuses_the_whole_array_naming_the_item_and_stores_nothing(
        service: Services, repo: Repo, tenant: TenantRecord) -> None:
    # Given ten items of which the fourth asks for 64 GPUs and the seventh an unknown class
    batch = items(10)
    batch[3]["resources"] = {"gpus": 64}
    batch[6]["resources"] = {"size_class": "gpu9000"}

    # When they are submitted as one array
    with pytest.raises(SpecError) as exc:
        service.arrays.submit(tenant, batch, defaults=CPU)

    # Then one error names both items and their fields, and nothing was stored
    fields = [e["field"] for e in exc.value.errors]
    assert fields == ["items[3].resources.gpus", "items[6].resources.size_class"]
    assert all(e["reason"] for e in exc.value.errors)
    assert count(repo, "jobs") == 0 and count(repo, "arrays") == 0


def test_too_many_or_no_items_are_refused_with_a_clear_error(
        service: Services, tenant: TenantRecord) -> None:
    with pytest.raises(SpecError) as exc:
        service.arrays.submit(tenant, [{}] * (MAX_ARRAY_ITEMS + 1), defaults=CPU)
    assert exc.value.errors[0]["field"] == "items"
    assert f"at most {MAX_ARRAY_ITEMS}" in exc.value.errors[0]["reason"]
    with pytest.raises(SpecError):
        service.arrays.submit(tenant, [], defaults=CPU)


def test_ten_thousand_items_are_inserted_by_one_insert_array_call(
        repo: Repo, tenant: TenantRecord, database_url: str) -> None:
    # Given 10,000 validated and routed specs
    specs = [JobSpec.parse({**CPU, "params": {"lr": 0.1, "i": i}}) for i in range(10_000)]
    routed = [(spec, route(spec, CLASSES)) for spec in specs]

    # When they are inserted with one call
    started = time.perf_counter()
    array = repo.insert_array(tenant.id, "big", routed, now=utcnow())
    elapsed = time.perf_counter() - started

    # Then every item is stored (the time is printed, not asserted: it depends on the machine)
    print(f"\n10,000 items on {database_url.split(':')[0]}: insert_array {elapsed:.2f} s")
    assert count(repo, "jobs") == 10_000
    got = repo.get_array(tenant.id, array.id, items=False)
    assert got.counts == {"queued": 10_000} and got.items is None
    started = time.perf_counter()
    cancelled = repo.cancel_array(tenant.id, array.id, now=utcnow())
    print(f"cancel_array {time.perf_counter() - started:.2f} s")
    assert cancelled.counts == {"cancelled": 10_000}


def test_the_counts_follow_the_items_through_success_failure_and_cancel(
        service: Services, repo: Repo, tenant: TenantRecord) -> None:
    # Given a four-item array: one succeeds, one fails, one runs, one waits
    array = service.arrays.submit(tenant, items(4), defaults=CPU)
    ids = [i.id for i in array.items or []]
    ok = claim(repo, ids[0])
    succeeded = Outcome(AttemptReason.SUCCEEDED, result={"loss": 0.5},
                        outputs=[{"path": "m.pt", "size": 3}])
    repo.record_outcome(ids[0], ok.token, succeeded, now=utcnow())
    bad = claim(repo, ids[1])
    repo.record_outcome(ids[1], bad.token, Outcome(AttemptReason.ERROR, error="boom"), now=utcnow())
    claim(repo, ids[2])

    # When the array is read
    status = service.arrays.get(tenant, array.id).to_status()

    # Then the whole and each item say where they are
    counted = ("total", "done", "succeeded", "failed", "running", "queued")
    assert {k: status[k] for k in counted} == \
        {"total": 4, "done": 2, "succeeded": 1, "failed": 1, "running": 1, "queued": 1}
    assert status["state"] == "running"
    assert [i["state"] for i in status["items"]] == ["succeeded", "failed", "running", "queued"]
    assert status["items"][1]["reason"] == "error"

    # And the manifest gives each item's params, result, outputs and error in index order
    manifest = service.arrays.manifest(tenant, array.id).to_dict()
    assert [m["index"] for m in manifest["items"]] == [0, 1, 2, 3]
    first, second = manifest["items"][0], manifest["items"][1]
    assert (first["params"], first["result"], first["outputs"]) == \
        ({"i": 0}, {"loss": 0.5}, [{"path": "m.pt", "size": 3}])
    assert (second["state"], second["error"], second["result"]) == ("failed", "boom", None)


def test_cancelling_an_array_cancels_queued_items_at_once_and_asks_running_ones_to_stop(
        service: Services, repo: Repo, tenant: TenantRecord) -> None:
    # Given a three-item array: one succeeded, one running, one queued
    array = service.arrays.submit(tenant, items(3), defaults=CPU)
    ids = [i.id for i in array.items or []]
    done = claim(repo, ids[0])
    repo.record_outcome(ids[0], done.token, Outcome(AttemptReason.SUCCEEDED, result=1),
                        now=utcnow())
    running = claim(repo, ids[1])

    # When the whole array is cancelled
    status = service.arrays.cancel(tenant, array.id).to_status()

    # Then the queued item is cancelled and can never be claimed, the running one is asked
    # to stop through its lease, and the finished one stays
    assert [i["state"] for i in status["items"]] == ["succeeded", "running", "cancelled"]
    assert claim(repo, ids[2]) is None
    assert repo.get_job(tenant.id, ids[2]).reason == "cancelled"
    assert repo.renew(ids[1], running.token, now=utcnow(), lease_ttl_s=30) == (True, True, False)
    repo.record_outcome(ids[1], running.token, Outcome(AttemptReason.CANCELLED), now=utcnow())
    final = service.arrays.get(tenant, array.id).to_status()
    assert (final["state"], final["done"], final["cancelled"]) == ("cancelled", 3, 2)
    # and cancelling again changes nothing
    assert service.arrays.cancel(tenant, array.id).to_status()["items"] == final["items"]


def test_a_tenant_cannot_read_cancel_or_fetch_the_manifest_of_another_tenants_array(
        service: Services, repo: Repo, tenant: TenantRecord) -> None:
    # Given an array of tenant A
    other, _ = repo.create_tenant("team-b", now=utcnow())
    array = service.arrays.submit(tenant, items(2), defaults=CPU)

    # When tenant B asks for it
    # Then it does not exist for B, and A's array is untouched
    with pytest.raises(NotFound):
        repo.get_array(other.id, array.id)
    with pytest.raises(NotFound):
        repo.cancel_array(other.id, array.id, now=utcnow())
    with pytest.raises(NotFound):
        repo.array_manifest(other.id, array.id)
    assert repo.get_array(tenant.id, array.id).counts == {"queued": 2}


# -- through the HTTP API -----------------------------------------------------------------

@pytest.fixture
def api(service: Services, repo: Repo,
        tmp_path: Path) -> tuple[TestClient, dict[str, dict[str, str]]]:
    _, token_a = repo.create_tenant("api-a", now=utcnow())
    _, token_b = repo.create_tenant("api-b", now=utcnow())
    client = TestClient(create_app(Settings(home=tmp_path), services=service))
    return client, {"a": {"Authorization": f"Bearer {token_a}"},
                    "b": {"Authorization": f"Bearer {token_b}"}}


def test_an_array_is_submitted_read_cancelled_and_listed_over_http(api) -> None:  # type: ignore[no-untyped-def]
    client, h = api
    # Given a two-item array submitted with defaults
    two = [{"params": {"lr": 0.1}}, {"params": {"lr": 0.2}}]
    created = client.post("/v1/arrays", json={"name": "sweep", "defaults": CPU, "items": two},
                          headers=h["a"])
    assert created.status_code == 201, created.text
    body = created.json()
    assert body["id"].startswith("a-") and body["total"] == 2 and len(body["jobs"]) == 2

    # When it is read, its manifest fetched and then it is cancelled
    status = client.get(f"/v1/arrays/{body['id']}", headers=h["a"]).json()
    counts_only = client.get(f"/v1/arrays/{body['id']}", params={"items": "false"},
                             headers=h["a"]).json()
    manifest = client.get(f"/v1/arrays/{body['id']}/manifest", headers=h["a"]).json()
    cancelled = client.post(f"/v1/arrays/{body['id']}/cancel", headers=h["a"]).json()

    # Then each answer is about the same two items
    assert [i["id"] for i in status["items"]] == body["jobs"]
    assert "items" not in counts_only and counts_only["queued"] == 2
    assert [m["params"] for m in manifest["items"]] == [{"lr": 0.1}, {"lr": 0.2}]
    assert (cancelled["state"], cancelled["cancelled"]) == ("cancelled", 2)
    job = client.get(f"/v1/jobs/{body['jobs'][1]}", headers=h["a"]).json()
    assert (job["array_id"], job["array_index"], job["name"]) == (body["id"], 1, "sweep[1]")


@pytest.mark.parametrize("body, field", [
    ({"items": [{"entrypoint": "m:f"}, {"entrypoint": "m:f", "resources": {"gpus": 64}}]},
     "items[1].resources.gpus"),
    ({"items": [{"entrypoint": "m:f"}, 5]}, "items[1]"),
    ({"items": [{"colour": "red"}], "defaults": {"entrypoint": "m:f"}}, "items[0].colour"),
    ({"items": [{}], "defaults": {"entrypoint": "m:f", "priority": 42}}, "items[0].priority"),
    ({"items": []}, "items"),
    ({"items": {"entrypoint": "m:f"}}, "items"),
    ({"items": [{}] * (MAX_ARRAY_ITEMS + 1), "defaults": CPU}, "items"),
    ({"entrypoint": "m:f"}, "items"),
    ({"items": [{}], "defaults": [1]}, "defaults"),
    ({"items": [{}], "defaults": CPU, "name": "x" * 201}, "name"),
    ({"items": [{}], "defaults": CPU, "name": "a\u0000b"}, "name"),
    ({"items": [{}], "defaults": CPU, "colour": "red"}, "colour"),
])
def test_a_bad_array_gets_422_naming_the_item_and_field_and_stores_nothing(  # type: ignore[no-untyped-def]
        api, repo: Repo, body, field) -> None:
    client, h = api
    response = client.post("/v1/arrays", json=body, headers=h["a"])
    assert response.status_code == 422, response.text
    payload = response.json()
    assert payload["error"] == "spec_invalid"
    assert field in [e["field"] for e in payload["errors"]], payload
    assert all(e["reason"] for e in payload["errors"])
    assert count(repo, "jobs") == 0 and count(repo, "arrays") == 0


def test_many_bad_items_are_named_up_to_a_limit_and_then_counted(api) -> None:  # type: ignore[no-untyped-def]
    client, h = api
    response = client.post("/v1/arrays", json={"items": [{"priority": 42}] * 100, "defaults": CPU},
                           headers=h["a"])
    assert response.status_code == 422
    errors = response.json()["errors"]
    assert len(errors) <= 21 and errors[-1]["field"] == "items"
    assert "100 of 100 items are invalid" in errors[-1]["reason"]


def test_another_tenants_array_and_odd_ids_get_404_never_a_500(api) -> None:  # type: ignore[no-untyped-def]
    client, h = api
    array = client.post("/v1/arrays", json={"items": [CPU]}, headers=h["a"]).json()
    for method, path in [("GET", ""), ("GET", "/manifest"), ("POST", "/cancel")]:
        response = client.request(method, f"/v1/arrays/{array['id']}{path}", headers=h["b"])
        assert response.status_code == 404, (method, path)
    for odd in ("a-%00", "a" * 500, "j-" + "0" * 20, array["jobs"][0]):
        assert client.get(f"/v1/arrays/{odd}", headers=h["a"]).status_code == 404
    assert client.get(f"/v1/arrays/{array['id']}", headers=h["a"]).json()["queued"] == 1
    assert client.post("/v1/arrays", json={"items": [CPU]}).status_code == 401


def test_the_openapi_document_describes_the_array_routes(api) -> None:  # type: ignore[no-untyped-def]
    client, _ = api
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/arrays", "/v1/arrays/{array_id}", "/v1/arrays/{array_id}/cancel",
            "/v1/arrays/{array_id}/manifest"} <= set(paths)
