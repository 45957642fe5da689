"""`GET /v1/pool/environments` over a real Redis and store: the workers' Python environments,
published once each under their digest and named by their heartbeats, answered per queue
(docs/notebooks.md, "How a call travels")."""

from __future__ import annotations

import pytest
import redis
from fastapi.testclient import TestClient

from e31.core import keys
from e31.core.clock import utcnow
from e31.core.functioncalls import environment, environment_digest
from e31.ops import heartbeat, pyenvs
from e31.ops.heartbeat import WorkerInfo
from e31.store import Repo
from e31_worker.node.heartbeat import Heartbeat
from tests.integration.conftest import bearer

OLD = {"python": "3.11", "packages": {"numpy": "1.26.0", "e31": "1"}}
NEW = {"python": "3.11", "packages": {"numpy": "2.1.0", "e31": "1"}}


def _worker(r: redis.Redis, node: str, queues: tuple[str, ...], env: dict | None) -> None:
    """A live worker of `queues` whose heartbeat names `env` (None: a worker that names none)."""
    digest = ""
    if env is not None:
        publisher = pyenvs.Publisher(env)
        publisher.renew(r)
        digest = publisher.digest
    info = WorkerInfo(node=node, queues=queues, gpus="", pyenv=digest)
    heartbeat.write(r, info, interval_s=30)


@pytest.fixture
def token(repo: Repo) -> dict[str, str]:
    _, secret = repo.create_tenant("team-a", now=utcnow())
    return bearer(secret)


def test_the_route_answers_the_distinct_environments_of_the_workers_of_the_job_s_queue(
        api: TestClient, redis_client: redis.Redis, token: dict[str, str]) -> None:
    # Given two cpu workers of one environment, one of another, and a GPU worker
    _worker(redis_client, "a@h", ("e31.cpu",), OLD)
    _worker(redis_client, "b@h", ("e31.cpu",), OLD)
    _worker(redis_client, "c@h", ("e31.cpu",), NEW)
    _worker(redis_client, "g@h", ("e31.gpu24",), NEW)
    # When a caller asks for those of a cpu job
    answer = api.get("/v1/pool/environments", headers=token).json()
    # Then each environment comes once, with its workers, its Python and its packages
    assert answer["size_class"] == "cpu" and answer["queue"] == "e31.cpu"
    assert answer["workers"] == 3 and answer["unknown"] == 0
    got = {e["digest"]: (e["workers"], e["python"], e["packages"])
           for e in answer["environments"]}
    assert got == {environment_digest(OLD): (2, "3.11", OLD["packages"]),
                   environment_digest(NEW): (1, "3.11", NEW["packages"])}
    assert not any("modules" in e for e in answer["environments"])
    # And a one-GPU job's are its class's workers' alone
    gpu = api.get("/v1/pool/environments", params={"gpus": 1}, headers=token).json()
    assert gpu["queue"] == "e31.gpu24" and gpu["workers"] == 1
    assert [e["digest"] for e in gpu["environments"]] == [environment_digest(NEW)]


def test_a_worker_whose_environment_is_not_known_is_counted_apart(
        api: TestClient, redis_client: redis.Redis, token: dict[str, str]) -> None:
    # Given a worker naming no environment (an older one), one whose record Redis lost
    _worker(redis_client, "old@h", ("e31.cpu",), None)
    _worker(redis_client, "lost@h", ("e31.cpu",), NEW)
    redis_client.delete(keys.pyenv(environment_digest(NEW)))
    # Then neither environment is answered, and both are `unknown`
    answer = api.get("/v1/pool/environments", headers=token).json()
    assert answer["workers"] == 2 and answer["unknown"] == 2 and answer["environments"] == []


def test_no_live_worker_or_resources_no_class_takes_answer_no_environment(
        api: TestClient, redis_client: redis.Redis, token: dict[str, str]) -> None:
    _worker(redis_client, "a@h", ("e31.cpu",), OLD)
    answer = api.get("/v1/pool/environments", params={"gpus": 2}, headers=token).json()
    assert answer == {"size_class": "gpu24", "queue": "e31.gpu24.x2", "workers": 0,
                      "unknown": 0, "environments": []}
    # Resources no class takes run nowhere (their submission is refused, naming the field)
    nowhere = api.get("/v1/pool/environments", params={"size_class": "nope"}, headers=token)
    assert nowhere.status_code == 200
    answer = nowhere.json()
    assert answer["environments"] == [] and answer["queue"] is None
    assert "unknown size class 'nope'" in answer["refused"]
    # And a query that is not one is refused as any is
    assert api.get("/v1/pool/environments", params={"gpus": "x"},
                   headers=token).status_code == 422


def test_a_worker_stores_its_environment_once_and_writes_it_again_when_redis_lost_it(
        redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given this interpreter's environment, published
    env = environment()
    publisher = pyenvs.Publisher(env)
    publisher.renew(redis_client)
    assert pyenvs.read(redis_client, [publisher.digest]) == {publisher.digest: env}
    assert 0 < redis_client.ttl(keys.pyenv(publisher.digest)) <= pyenvs.TTL_S
    # When Redis loses it, the next renewal (once RENEW_S has passed) writes it again
    redis_client.delete(keys.pyenv(publisher.digest))
    publisher.renew(redis_client)
    assert pyenvs.read(redis_client, [publisher.digest]) == {}   # not before RENEW_S
    monkeypatch.setattr(pyenvs, "RENEW_S", 0.0)
    publisher.renew(redis_client)
    assert pyenvs.read(redis_client, [publisher.digest]) == {publisher.digest: env}


def test_a_worker_s_heartbeat_names_its_environment_which_the_route_then_answers(
        api: TestClient, redis_client: redis.Redis, token: dict[str, str]) -> None:
    # Given a worker's heartbeat built as the worker process builds it
    publisher = pyenvs.Publisher(environment())
    beat = Heartbeat(redis_client=redis_client,
                     identity=WorkerInfo(node="cpu0@env-test", queues=("e31.cpu",), gpus="",
                                         pyenv=publisher.digest),
                     interval_s=30, on_drain=lambda: None, drain_authorized=lambda: False,
                     pyenv=publisher)
    # When it beats
    beat.beat()
    # Then its record names the digest, and the route answers this interpreter's environment
    [info] = heartbeat.read_workers(redis_client)
    assert info.pyenv == publisher.digest
    [env] = api.get("/v1/pool/environments", headers=token).json()["environments"]
    assert env["digest"] == publisher.digest and env["packages"] == environment()["packages"]
    # And the top-level modules it can import, which an older worker's environment (no
    # `modules`, as OLD and NEW) is answered without
    assert env["modules"] == environment()["modules"] and "json" in env["modules"]
