"""The impossible is refused or explained (issue 15, item 2): at submit, a job that no
registered node could ever run gets 422 naming what is missing, unless it says
`allow_pending`, and then its pending reason says it; a dry run says whether and where it
could start now. Real API in process, real Redis heartbeats, real SQLite/PostgreSQL."""

from __future__ import annotations

import redis
from fastapi.testclient import TestClient

from e31.core import keys
from e31.core.clock import utcnow
from e31.ops.heartbeat import withdraw
from e31.store import Repo
from tests.integration.conftest import bearer
from tests.integration.test_scheduler import a_scheduler_leads, heartbeat

BIG = {"entrypoint": "m:f", "resources": {"gpus": 4, "size_class": "gpu80"}}
MISSING = "no node with 4 × gpu80 is registered (largest: 2 × gpu80 on host-a)"


def two_gpu80_workers(r: redis.Redis) -> None:
    """Host a: two one-GPU gpu80 workers that spill to gpu48 (a default layout)."""
    for i in (0, 1):
        heartbeat(r, f"gpu{i}@host-a", ["e31.gpu80", "e31.gpu48"])


def test_a_job_bigger_than_every_registered_node_is_refused_naming_what_is_missing(
        api: TestClient, repo: Repo, redis_client: redis.Redis) -> None:
    _, token = repo.create_tenant("a", now=utcnow())
    # Given no worker at all (a pool not up yet): the job is taken, and waits for a worker
    first = api.post("/v1/jobs", json=BIG, headers=bearer(token))
    assert first.status_code == 201, first.text

    # When host-a with two gpu80 GPUs registers, the same job is refused, naming what is missing
    two_gpu80_workers(redis_client)
    refused = api.post("/v1/jobs", json=BIG, headers=bearer(token))
    assert refused.status_code == 422, refused.text
    [error] = refused.json()["errors"]
    assert error["field"] == "resources.gpus"
    assert error["reason"].startswith(MISSING)
    # and so is an array item, by its index; nothing of the array is stored
    array = api.post("/v1/arrays", json={"items": [{"entrypoint": "m:f"}, BIG]},
                     headers=bearer(token))
    assert array.status_code == 422
    assert array.json()["errors"][0]["field"] == "items[1].resources.gpus"
    # while what host-a has is taken: 2 × gpu80, and 2 × gpu48 by spill; gpu141 is not up
    for resources in ({"gpus": 2, "size_class": "gpu80"}, {"gpus": 2, "gpu_mem_gb": 40},
                      {"gpus": 8, "size_class": "gpu141"}):
        taken = api.post("/v1/jobs", json={**BIG, "resources": resources},
                         headers=bearer(token))
        assert taken.status_code == 201, (resources, taken.text)

    # And when host-a's workers restart (their heartbeats gone a moment), it is still refused:
    # the shape seen in the last day counts; once forgotten, the pool reads as not up again
    for i in (0, 1):
        withdraw(redis_client, f"gpu{i}@host-a")
    assert api.post("/v1/jobs", json=BIG, headers=bearer(token)).status_code == 422
    redis_client.delete(keys.NODES)
    assert api.post("/v1/jobs", json=BIG, headers=bearer(token)).status_code == 201


def test_a_held_impossible_job_is_stored_and_its_pending_reason_says_what_is_missing(
        api: TestClient, repo: Repo, redis_client: redis.Redis) -> None:
    # Given host-a with two gpu80 GPUs
    _, token = repo.create_tenant("a", now=utcnow())
    two_gpu80_workers(redis_client)

    # When a 4-GPU gpu80 job that says allow_pending is submitted
    held = api.post("/v1/jobs", json={**BIG, "allow_pending": True}, headers=bearer(token))

    # Then it is stored, and its status says exactly why it waits, with no estimate
    assert held.status_code == 201, held.text
    pending = api.get(f"/v1/jobs/{held.json()['id']}", headers=bearer(token)).json()["pending"]
    assert (pending["reason"], pending["detail"], pending["text"]) == \
        ("no_node", "4 × gpu80", MISSING)
    assert pending["estimated_start"] is None and "4 gpu80 GPUs" in pending["no_estimate"]


def test_a_dry_run_says_whether_and_where_the_job_could_start_now_and_stores_nothing(
        api: TestClient, repo: Repo, redis_client: redis.Redis) -> None:
    _, token = repo.create_tenant("a", now=utcnow())
    two_gpu80_workers(redis_client)
    heartbeat(redis_client, "gpu0@host-b", ["e31.gpu24"], busy_job="j-" + "0" * 20)
    a_scheduler_leads(redis_client)

    def dry(body: dict[str, object]) -> dict[str, object]:
        answer = api.post("/v1/jobs", params={"dry_run": "true"}, json=body,
                          headers=bearer(token))
        assert answer.status_code == 200, answer.text
        return dict(answer.json())

    # A gpu80 job could start now on an idle gpu80 worker
    now = dry({"entrypoint": "m:f", "resources": {"gpu_mem_gb": 70}})
    assert (now["size_class"], now["queue"], now["could_run_now"]) == ("gpu80", "e31.gpu80", True)
    assert now["where"] == {"worker": "gpu0@host-a", "host": "host-a"}
    assert now["estimated_start"] is not None and now["pending"] is None
    # a gpu48 job could too, by spill; a gpu24 job waits for the one gpu24 worker, busy now
    assert dry({"entrypoint": "m:f", "resources": {"gpu_mem_gb": 40}})["where"] == \
        {"worker": "gpu0@host-a", "host": "host-a"}
    busy = dry({"entrypoint": "m:f", "resources": {"gpu_mem_gb": 20}})
    assert busy["could_run_now"] is False and busy["pending"]["reason"] == "no_capacity"
    # a 2-GPU job waits: no worker serves 2 gpu80 GPUs as one job today
    two = dry({"entrypoint": "m:f", "resources": {"gpus": 2, "size_class": "gpu80"}})
    assert two["could_run_now"] is False and two["pending"]["reason"] == "no_workers"
    # a held impossible job says why, with no estimate; without allow_pending it gets 422
    held = dry({**BIG, "allow_pending": True})
    assert (held["could_run_now"], held["estimated_start"]) == (False, None)
    assert held["pending"]["text"] == MISSING
    assert api.post("/v1/jobs", params={"dry_run": "true"}, json=BIG,
                    headers=bearer(token)).status_code == 422
    # and nothing was stored
    assert api.get("/v1/jobs", headers=bearer(token)).json()["jobs"] == []
