"""The API while its Redis accepts connections and never answers (a `redis-server` stopped with
SIGSTOP: the kernel still completes the handshake, so only a read timeout ends the wait):
every request that reads Redis answers without it within seconds instead of hanging
(issue 32). The API is built as `e31 api` builds it (`create_app(settings)`, its own Redis
client from the wiring), over a real redis-server of the test's own and a real store."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from e31.api import create_app
from e31.core.clock import utcnow
from e31.edge.settings import Settings
from e31.local.redisserver import start_redis
from e31.store import Repo

# A request reads Redis a few times (the submit rate, the heartbeats, the wake-up), each
# bounded by the API's 2 s timeout: seconds, well inside this. Without the timeout it never
# returns. (Not pytest-timeout alone: its exception, raised while the test client waits for
# the app, is held by that wait until the request ends, which it never does.)
ANSWER_S = 60


def answered(request: Callable[[], httpx.Response]) -> httpx.Response:
    """`request()`'s answer, or a failure if there is none within ANSWER_S."""
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        return pool.submit(request).result(timeout=ANSWER_S)
    except FutureTimeout:
        pytest.fail(f"no answer within {ANSWER_S} s: the request hangs on the stopped Redis")
    finally:
        pool.shutdown(wait=False)   # a hung request's thread ends when Redis is let go


@pytest.fixture
def stopped_redis(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """A redis-server of this test's own: (url, pid); SIGCONT and stopped at the end."""
    proc, url = start_redis(tmp_path / "redis")
    try:
        yield url, proc.pid
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout=10)


def test_requests_that_read_redis_answer_without_it_when_redis_is_stopped(
        repo: Repo, database_url: str, stopped_redis: tuple[str, int], tmp_path: Path) -> None:
    # Given the API as `e31 api` builds it, over a Redis that answers
    redis_url, redis_pid = stopped_redis
    settings = Settings(redis_url=redis_url, database_url=database_url, home=tmp_path,
                        artifacts_url=f"file://{tmp_path / 'artifacts'}")
    _, token = repo.create_tenant("a", now=utcnow())
    h = {"Authorization": f"Bearer {token}"}
    with TestClient(create_app(settings)) as api:
        assert api.get("/v1/queue", headers=h).json()["broker"] == "ok"

        # When redis-server is stopped: it still accepts connections, and answers nothing
        os.kill(redis_pid, signal.SIGSTOP)
        try:
            submitted = answered(lambda: api.post(
                "/v1/jobs", headers=h, json={"command": ["true"], "resources": {"gpus": 0}}))
            status = answered(lambda: api.get(f"/v1/jobs/{submitted.json()['id']}", headers=h))
            queue = answered(lambda: api.get("/v1/queue", headers=h))
        finally:   # a request still hanging ends once Redis answers, so the app can stop
            os.kill(redis_pid, signal.SIGCONT)

    # Then each request answers: the job is stored (the store is the record, Redis only
    # carries "it may run now"), its status says the broker is unreachable, and so does the
    # queue, whose slot counts are then unknown rather than zero
    assert submitted.status_code == 201, submitted.text
    assert status.status_code == 200, status.text
    assert status.json()["state"] == "queued"
    assert status.json()["pending"]["reason"] == "broker_unreachable"
    assert queue.status_code == 200, queue.text
    assert queue.json()["broker"] == "unreachable"
