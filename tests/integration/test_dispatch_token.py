"""The broker is not a trust boundary: a Celery message runs a job only with the dispatch token
the scheduler issued for that publication, and a Redis key drains a worker only when the store
holds an operator's request.

Real store, real Redis, the real scheduler, the real `e31.run` task body (messages are read
back from the broker and delivered to the task the worker registers) and the real heartbeat
thread. Each attack runs twice: `guarded` (the protection on: the attack fails) and
`unguarded` (the check switched off by the `guard` fixture: the same attack gets through),
which proves that the test would catch the hole.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection
from sqlalchemy import true

from e31.core import keys
from e31.core.clock import utcnow
from e31.core.sizeclasses import route
from e31.core.spec import JobSpec
from e31.edge import wiring
from e31.edge.artifacts import ArtifactStore
from e31.edge.celeryapp import TASK_NAME
from e31.edge.settings import Settings
from e31.ops.drain import drain_authorized, request_drain
from e31.ops.heartbeat import WorkerInfo
from e31.store import Repo
from e31.store import attempts as attempts_module
from e31_worker.attempt.services import AttemptServices
from e31_worker.attempt.task import register
from e31_worker.node.heartbeat import Heartbeat
from tests.conftest import wait_for
from tests.integration.test_scheduler import heartbeat, make
from tests.integration.test_store import claim
from tests.integration.test_task import services

QUEUE = "e31.gpu24"
NODE = "gpu0@test"
FORGED = "a-token-nobody-issued"


@pytest.fixture(params=["guarded", "unguarded"])
def guarded(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """True with the dispatch check on; False with it off (any token holds any publication),
    as the store behaved before it."""
    if request.param == "unguarded":
        monkeypatch.setattr(attempts_module, "holds_dispatch", lambda token: true())
        # the claim's statement is built once, at import: built again without the check
        monkeypatch.setattr(attempts_module, "_CLAIM", attempts_module._claim_statement())
    return bool(request.param == "guarded")


class Worker:
    """The task a worker process registers, over the real store, fed the messages that sit in
    the broker's queue (as Kombu decodes them for a consumer)."""

    def __init__(self, repo: Repo, r: redis.Redis, tmp_path: Path) -> None:
        svc = services(repo, r, tmp_path, ArtifactStore(f"file://{tmp_path / 'artifacts'}"))
        self.svc: AttemptServices = dataclasses.replace(svc, identity=WorkerInfo(
            node=NODE, queues=(QUEUE,), gpus="0", gpu_count=1, size_class="gpu24"))
        self.app = Celery("worker", set_as_current=False)
        register(self.app, self.svc)
        self._r = r

    def take(self) -> list[list[Any]]:
        """Take every message waiting in the queue, oldest first: their arguments."""
        found = []
        with Connection("memory://") as decoder:  # Kombu's message codec: no I/O
            channel = decoder.default_channel
            for key in sorted(self._r.scan_iter(match=f"{QUEUE}*")):
                if self._r.type(key) != b"list":
                    continue
                for raw in reversed(self._r.lrange(key, 0, -1)):   # LPUSHed: oldest last
                    args, _kwargs, _embed = channel.message_to_python(json.loads(raw)).decode()
                    found.append(list(args))
                self._r.delete(key)
        return found

    def deliver(self, args: list[Any]) -> None:
        """Run the task as a worker does: what it raises (a job that did not succeed) is the
        task's FAILURE, not the caller's."""
        self.app.tasks[TASK_NAME].apply(args=args)


@pytest.fixture
def worker(repo: Repo, redis_client: redis.Redis, tmp_path: Path) -> Worker:
    return Worker(repo, redis_client, tmp_path)


def submit(repo: Repo, tenant_id: str, script: str, **fields: Any) -> str:
    spec = JobSpec.parse({"command": ["sh", "-c", script], "resources": {"gpus": 1}, **fields})
    return repo.insert_job(tenant_id, spec, route(spec, Settings().size_classes), now=utcnow()).id


def attacker(redis_url: str) -> Celery:
    """The platform's own Celery app, as anyone holding the broker's URL can build it."""
    return wiring.celery(Settings(redis_url=redis_url))


def unauthorized(caplog: pytest.LogCaptureFixture, job_id: str) -> int:
    return sum(f"message_unauthorized job={job_id}" in r.getMessage() for r in caplog.records)


# -- dispatch tokens ----------------------------------------------------------------------


def test_a_hand_published_message_for_a_job_its_quota_holds_runs_nothing(
        guarded: bool, repo: Repo, redis_url: str, redis_client: redis.Redis, worker: Worker,
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Given a tenant with a quota of one gpu24 GPU, one job running, and a second job that
    # the quota holds although a worker is idle
    tenant, _ = repo.create_tenant("capped", quotas={"gpu24": 1}, now=utcnow())
    marker = tmp_path / "ran"
    running = submit(repo, tenant.id, "true")
    assert claim(repo, running, worker="gpu1@test") is not None
    held = submit(repo, tenant.id, f"echo ran > {marker}")
    heartbeat(redis_client, NODE, [QUEUE])
    assert make(repo, redis_url, dispatch_headroom=0).tick() == 0
    assert repo.get_job(None, held).state == "queued" and worker.take() == []

    # When someone with the broker's URL publishes `e31.run` for it by hand, the old way
    # (the job id alone) and with a made-up token, and the worker receives both
    caplog.set_level(logging.INFO, logger="e31_worker.attempt.task")
    app = attacker(redis_url)
    app.send_task(TASK_NAME, args=[held], queue=QUEUE, routing_key=QUEUE)
    app.send_task(TASK_NAME, args=[held, FORGED], queue=QUEUE, routing_key=QUEUE)
    messages = worker.take()
    assert [m[0] for m in messages] == [held, held]
    for message in messages:
        worker.deliver(message)

    # Then nothing ran: the job is still queued, without an attempt, and both are logged
    record = repo.get_job(None, held)
    if not guarded:  # the hole: the forged token claimed the job past its tenant's quota
        assert record.state == "succeeded" and len(record.attempts) == 1
        assert marker.read_text() == "ran\n"
        return
    assert record.state == "queued" and record.attempts == []
    assert not marker.exists()
    assert unauthorized(caplog, held) == 2


def test_a_genuine_message_delivered_again_after_its_claim_runs_nothing(
        guarded: bool, repo: Repo, redis_url: str, redis_client: redis.Redis, worker: Worker,
        tmp_path: Path) -> None:
    # Given a job the scheduler published, whose first attempt fails and queues it again
    tenant, _ = repo.create_tenant("a", now=utcnow())
    marker = tmp_path / "runs"
    job = submit(repo, tenant.id, f"echo run >> {marker}; exit 3",
                 retries={"max": 1, "backoff_s": 0})
    heartbeat(redis_client, NODE, [QUEUE])
    assert make(repo, redis_url, dispatch_headroom=0).tick() == 1
    [genuine] = worker.take()
    assert genuine[0] == job and len(genuine) == 2
    worker.deliver(genuine)
    assert repo.get_job(None, job).state == "queued"

    # When the same message is replayed (a copy read off the broker, or a redelivery)
    worker.deliver(genuine)

    # Then it claims nothing: its token went with the claim
    record = repo.get_job(None, job)
    if not guarded:  # the hole: the old message ran the job again, outside the scheduler
        assert len(record.attempts) == 2 and marker.read_text() == "run\nrun\n"
        return
    assert record.state == "queued" and len(record.attempts) == 1
    assert marker.read_text() == "run\n"


def test_a_job_published_again_runs_only_from_its_newest_message(
        repo: Repo, redis_url: str, redis_client: redis.Redis, worker: Worker, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    # Given a published job whose message is still in flight when Redis loses its data (the
    # scheduler publishes every outstanding job again, each with a new token)
    tenant, _ = repo.create_tenant("a", now=utcnow())
    marker = tmp_path / "runs"
    job = submit(repo, tenant.id, f"echo run >> {marker}")
    heartbeat(redis_client, NODE, [QUEUE])
    scheduler = make(repo, redis_url, dispatch_headroom=0)
    assert scheduler.tick() == 1
    [first] = worker.take()
    redis_client.delete(keys.BROKER_EPOCH)
    assert scheduler.tick() == 1
    [second] = worker.take()
    assert first[0] == second[0] == job and first[1] != second[1]

    # When the worker gets the older message first, then the newer
    caplog.set_level(logging.INFO, logger="e31_worker.attempt.task")
    worker.deliver(first)
    assert repo.get_job(None, job).state == "queued" and unauthorized(caplog, job) == 1
    worker.deliver(second)

    # Then the job ran once, from the newer message
    record = repo.get_job(None, job)
    assert record.state == "succeeded" and len(record.attempts) == 1
    assert marker.read_text() == "run\n"


def test_only_the_message_of_a_publication_hands_it_back_from_a_draining_worker(
        repo: Repo, redis_url: str, redis_client: redis.Redis, worker: Worker) -> None:
    # Given a published job and a draining worker
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job = submit(repo, tenant.id, "true")
    heartbeat(redis_client, NODE, [QUEUE])
    scheduler = make(repo, redis_url, dispatch_headroom=0)
    assert scheduler.tick() == 1
    [genuine] = worker.take()
    worker.svc.draining.set()

    # When it receives a forged message for the job, the publication stays (no duplicate)
    worker.deliver([job, FORGED])
    assert scheduler.tick() == 0

    # And when it receives the genuine one, it hands it back: published again at once
    worker.deliver(genuine)
    assert scheduler.tick() == 1
    [again] = worker.take()
    assert again[0] == job and again[1] != genuine[1]


def test_the_scheduler_shows_no_token_in_a_messages_display_form(
        repo: Repo, redis_url: str, redis_client: redis.Redis, worker: Worker) -> None:
    # Given a job the scheduler published
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job = submit(repo, tenant.id, "true")
    heartbeat(redis_client, NODE, [QUEUE])
    assert make(repo, redis_url, dispatch_headroom=0).tick() == 1
    [raw] = [m for key in redis_client.scan_iter(match=f"{QUEUE}*")
             if redis_client.type(key) == b"list" for m in redis_client.lrange(key, 0, -1)]
    headers = json.loads(raw)["headers"]
    [[_, token]] = worker.take()

    # Then Flower and task events, which show `argsrepr`, see the job but not its token
    assert job in headers["argsrepr"] and token not in headers["argsrepr"]


# -- drain authority ----------------------------------------------------------------------


@pytest.fixture(params=["guarded", "unguarded"])
def drain_check(request: pytest.FixtureRequest, repo: Repo) -> tuple[bool, Callable[[], bool]]:
    """(guarded, the worker's drain authority): the store's request (guarded), or none, so
    that any key drains (unguarded, as the worker behaved before)."""
    if request.param == "unguarded":
        return False, lambda: True
    return True, lambda: drain_authorized(repo, NODE)


@contextmanager
def live_worker(r: redis.Redis, check: Callable[[], bool]) -> Iterator[tuple[Heartbeat,
                                                                            threading.Event]]:
    """A live worker's heartbeat thread; the event is set when it starts to drain."""
    drained = threading.Event()
    beat = Heartbeat(redis_client=r, interval_s=0.05, on_drain=drained.set,
                     identity=WorkerInfo(node=NODE, queues=(QUEUE,), gpus="0", gpu_count=1),
                     drain_authorized=check)
    beat.start()
    try:
        yield beat, drained
    finally:
        beat.stop()


def test_a_drain_key_written_into_redis_does_not_drain_a_live_worker(
        drain_check: tuple[bool, Callable[[], bool]], redis_client: redis.Redis,
        caplog: pytest.LogCaptureFixture) -> None:
    guarded, check = drain_check
    caplog.set_level(logging.WARNING, logger="e31_worker.node.heartbeat")
    with live_worker(redis_client, check) as (beat, drained):
        # When someone with the broker's URL writes the worker's drain key
        redis_client.set(keys.drain(NODE), "1")

        # Then the worker logs it once and keeps serving, heartbeat after heartbeat
        if not guarded:  # the hole: a key alone drained it
            assert drained.wait(5)
            return
        wait_for(lambda: "drain_unauthorized node=gpu0@test" in caplog.text, timeout_s=5,
                 what="the refused drain to be logged")
        assert not drained.wait(0.5)
        assert not beat.drain_requested.is_set()
        assert redis_client.exists(keys.worker(NODE))
        assert caplog.text.count("drain_unauthorized") == 1


def test_an_operators_drain_recorded_in_the_store_drains_the_worker(
        repo: Repo, redis_client: redis.Redis) -> None:
    with live_worker(redis_client, lambda: drain_authorized(repo, NODE)) as (beat, drained):
        # When an operator asks for it (`e31 worker --drain`: the store's record, then the key)
        request_drain(redis_client, repo, [NODE])
        # Then the worker drains at its next heartbeat
        assert drained.wait(5) and beat.drain_requested.is_set()


def test_a_drain_request_older_than_a_day_or_for_another_node_has_no_authority(
        repo: Repo) -> None:
    repo.request_drain(["gpu1@test"], now=utcnow())
    repo.request_drain([NODE], now=utcnow() - timedelta(days=2))
    assert not drain_authorized(repo, NODE)
    repo.request_drain([NODE], now=utcnow())
    assert drain_authorized(repo, NODE)
    assert repo.clear_drain([NODE]) == 1 and not drain_authorized(repo, NODE)
