"""Flower answers nothing without its credentials, `/metrics` and `/healthcheck` included: a real
`e31 flower` process on a real Redis (issue 25). And the same Flower started as Flower itself
starts (`celery flower --basic-auth=...`) answers `/metrics` to anyone, which is what
`e31.edge.flowerauth` closes: without that, the first test would check nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from e31.local.redisserver import free_port
from tests.conftest import wait_for

USER, PASSWORD = "e31", "s3cret-flower"
START_S = 60      # Flower imports Celery and connects to Redis before it listens
# Every kind of route Flower has: its pages, its API, its metrics and health, its static
# files, its login page, and a path it does not know.
ROUTES = ("/", "/workers", "/tasks", "/api/workers", "/api/tasks", "/metrics", "/healthcheck",
          "/static/css/flower.css", "/login", "/no-such-page")
# A plain Flower (no e31.edge.flowerauth) on the pool's settings, with the same basic auth.
PLAIN_FLOWER = ("import sys; from e31.edge import wiring; "
                "from e31.cli.common import load_settings; "
                "wiring.celery(load_settings()).start(['flower', *sys.argv[1:]])")


def flower_env(redis_url: str, home: Path, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("E31_", "FLOWER_"))}
    env.update(E31_HOME=str(home), E31_REDIS_URL=redis_url, E31_FLOWER_PORT=str(port),
               E31_FLOWER_USER=USER, E31_FLOWER_PASSWORD=PASSWORD)
    return env


def start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def listening(base: str) -> bool:
    try:
        return httpx.get(f"{base}/healthcheck", auth=(USER, PASSWORD), timeout=2).status_code \
            == 200
    except httpx.HTTPError:
        return False


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@pytest.fixture
def flower(redis_url: str, tmp_path: Path) -> Iterator[str]:
    """`e31 flower` on the test's Redis; its base URL."""
    port = free_port()
    log = tmp_path / "flower.log"
    proc = start([sys.executable, "-m", "e31.cli", "flower"],
                 flower_env(redis_url, tmp_path, port), log)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: listening(base) or proc.poll() is not None, timeout_s=START_S,
                 what="e31 flower", evidence=lambda: log.read_text(errors="replace")[-3000:])
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        yield base
    finally:
        stop(proc)


def test_every_flower_route_answers_401_without_its_credentials(flower: str) -> None:
    # Given `e31 flower` with basic auth, listening

    # When each kind of route is asked without credentials, or with a wrong password, or with
    # a header that is no basic auth
    for route in ROUTES:
        for auth in (None, (USER, "wrong"), ("nobody", PASSWORD)):
            answer = httpx.get(f"{flower}{route}", auth=auth, timeout=10)
            # Then it is refused, asking for basic auth, and shows nothing of the pool
            assert answer.status_code == 401, (route, auth, answer.status_code)
            assert answer.headers["WWW-Authenticate"] == 'Basic realm="flower"'
            assert "flower_" not in answer.text and "celery" not in answer.text.lower()
        bearer = httpx.get(f"{flower}{route}", headers={"Authorization": f"Bearer {PASSWORD}"},
                           timeout=10)
        assert bearer.status_code == 401, route
    # a POST to its API too
    assert httpx.post(f"{flower}/api/task/async-apply/e31.run", json={},
                      timeout=10).status_code == 401


def test_with_its_credentials_flower_answers_as_before(flower: str) -> None:
    # When the same routes are asked with the credentials
    for route in ("/", "/workers", "/api/workers", "/api/tasks", "/metrics", "/healthcheck",
                  "/static/css/flower.css"):
        answer = httpx.get(f"{flower}{route}", auth=(USER, PASSWORD), timeout=10)
        # Then they answer as Flower does
        assert answer.status_code == 200, (route, answer.status_code, answer.text[:300])
    assert "flower_" in httpx.get(f"{flower}/metrics", auth=(USER, PASSWORD), timeout=10).text
    assert httpx.get(f"{flower}/healthcheck", auth=(USER, PASSWORD), timeout=10).text == "OK"
    assert httpx.get(f"{flower}/no-such-page", auth=(USER, PASSWORD),
                     timeout=10).status_code == 404


def test_flower_itself_answers_metrics_and_healthcheck_without_credentials(
        redis_url: str, tmp_path: Path) -> None:
    # Given Flower started as Flower starts itself, with the same basic auth
    port = free_port()
    log = tmp_path / "plain-flower.log"
    proc = start([sys.executable, "-c", PLAIN_FLOWER, f"--port={port}",
                  f"--basic-auth={USER}:{PASSWORD}", "--persistent=False"],
                 flower_env(redis_url, tmp_path, port), log)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: listening(base) or proc.poll() is not None, timeout_s=START_S,
                 what="plain Flower", evidence=lambda: log.read_text(errors="replace")[-3000:])
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]

        # Then its basic auth guards its API, but its metrics and health answer anyone
        assert httpx.get(f"{base}/api/workers", timeout=10).status_code == 401
        metrics = httpx.get(f"{base}/metrics", timeout=10)
        assert metrics.status_code == 200 and "flower_" in metrics.text
        assert httpx.get(f"{base}/healthcheck", timeout=10).text == "OK"
    finally:
        stop(proc)
