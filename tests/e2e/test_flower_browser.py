"""Flower, opened in headless Chromium behind its basic auth, shows a failed job as failed: a
job whose command exits 3 is a FAILURE task named `<tenant>/<name>` whose exception names the
job id, its reason and its state; a job that succeeds after it is a SUCCESS. The failed
task's message is acked all the same, and its worker keeps serving. Screenshots of Flower's
task list and of the failed task are kept under the test's tmp dir (their paths are
printed).

Skips where Chromium is absent (CI installs Debian's `chromium`, .ci/run).
"""

from __future__ import annotations

import html
import itertools
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from e31.core import keys
from e31.core.errors import JobFailed
from e31.local.redisserver import free_port
from tests.conftest import wait_for

from .conftest import Stack

WAIT_S = 90
PROBE_SEEN_S = 5      # how long a probe job may take to show in Flower before the next one
CHROMIUM_TIMEOUT_S = 90
USER, PASSWORD = "e31", "fl0wer-e2e"
UNACKED = "unacked"   # kombu's Redis hash of delivered, not yet acknowledged messages
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
# Headless and quiet: no sandbox (CI runs as root), no GPU, no network of its own.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                  "--hide-scrollbars", "--virtual-time-budget=8000")


def browser() -> str:
    for name in BROWSERS:
        if found := shutil.which(name):
            return found
    pytest.skip("Chromium is not installed (Debian: apt-get install chromium, as .ci/run "
                "does): Flower's pages are not checked in a browser here")


@pytest.fixture
def flower(stack: Stack) -> Iterator[str]:
    """`e31 flower` on the stack's broker with basic auth; its base URL."""
    port = free_port()
    env = stack.env_with_redis(E31_FLOWER_PORT=str(port), E31_FLOWER_USER=USER,
                               E31_FLOWER_PASSWORD=PASSWORD)
    log = open(stack.home / "logs" / "flower-browser-test.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "e31.cli", "flower"], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(f"{base}/healthcheck"), timeout_s=WAIT_S, what="Flower")
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()


def task_of(flower: str, name: str, state: str) -> dict[str, Any] | None:
    """The task Flower's API lists with this name and state, with its uuid; None: none yet."""
    tasks = httpx.get(f"{flower}/api/tasks", auth=(USER, PASSWORD), timeout=10).json()
    return next(({"uuid": uuid, **t} for uuid, t in tasks.items()
                 if t.get("name") == name and t.get("state") == state), None)


def listening(client: Any, flower: str) -> None:
    """Run short probe jobs until Flower lists one: its event receiver is then subscribed
    (events sent before that are not kept for it), so every later job's events reach it."""
    deadline = time.monotonic() + WAIT_S
    for n in itertools.count(1):
        name = f"flower-probe-{n}"
        client.submit(command=["true"], resources={"gpus": 0}, name=name).wait(timeout=WAIT_S)
        seen = time.monotonic() + PROBE_SEEN_S
        while time.monotonic() < seen:
            if task_of(flower, f"default/{name}", "SUCCESS"):
                return
            time.sleep(0.1)
        if time.monotonic() > deadline:
            pytest.fail(f"Flower listed none of {n} probe jobs in {WAIT_S} s")


def chromium(tmp_path: Path, url: str, *args: str) -> str:
    """Run headless Chromium on `url` with `args`; its standard output (a DOM dump)."""
    result = subprocess.run([browser(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'ud'}",
                             *args, url], capture_output=True, text=True,
                            timeout=CHROMIUM_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_flower_shows_a_failed_job_as_failed_in_a_browser(stack: Stack, flower: str,
                                                          tmp_path: Path) -> None:
    browser()   # skip before anything runs where there is none
    authed = flower.replace("http://", f"http://{USER}:{PASSWORD}@")

    # Given Flower listening for task events (it answers /healthcheck before its event
    # receiver has subscribed, and a task that ends before then never shows)
    client = stack.client()
    listening(client, flower)

    # And a job that fails (no retry) and, after it, one that succeeds
    failed = client.submit(command=["sh", "-c", "echo flower-e2e; exit 3"],
                           resources={"gpus": 0}, name="fails-in-flower", retries={"max": 0})
    with pytest.raises(JobFailed, match="exited with code 3"):
        failed.wait(timeout=WAIT_S)
    ok = client.submit(command=["true"], resources={"gpus": 0}, name="succeeds-in-flower")
    assert ok.wait(timeout=WAIT_S)["state"] == "succeeded"

    # When Flower has heard of both (its API, behind the same basic auth, as a cross-check)
    bad = wait_for(lambda: task_of(flower, "default/fails-in-flower", "FAILURE"),
                   timeout_s=WAIT_S, what="the failed job as a FAILURE task in Flower")
    good = wait_for(lambda: task_of(flower, "default/succeeds-in-flower", "SUCCESS"),
                    timeout_s=WAIT_S, what="the succeeded job as a SUCCESS task in Flower")
    assert isinstance(bad, dict) and isinstance(good, dict)
    assert failed.id in bad["args"] and "JobNotSucceeded" in bad["exception"]
    assert f"job {ok.id} attempt 1 succeeded" in good["result"]
    # And the failed task's message was acked (nothing of it waits in Redis's unacked hash),
    # and its worker still beats
    r = redis.Redis.from_url(stack.redis_url)
    try:
        assert not [v for v in r.hvals(UNACKED) if bad["uuid"].encode() in v]
        assert r.exists(keys.worker(bad["worker"]))
    finally:
        r.close()

    # Then the failed task's page, opened in Chromium behind the basic auth, says FAILURE, the
    # job's id, its tenant/name and why
    page = html.unescape(chromium(tmp_path, f"{authed}/task/{bad['uuid']}", "--dump-dom"))
    assert "FAILURE" in page and "SUCCESS" not in page
    assert "default/fails-in-flower" in page and failed.id in page
    assert f"job {failed.id} attempt 1 ended error; the job is failed" in page
    # And the task list shows the failed job failed and the other one succeeded
    tasks_page = html.unescape(chromium(tmp_path, f"{authed}/tasks", "--dump-dom"))
    assert "default/fails-in-flower" in tasks_page and "FAILURE" in tasks_page
    assert "default/succeeds-in-flower" in tasks_page and "SUCCESS" in tasks_page
    # And without the password Flower shows nothing of it, not even in its metrics
    assert httpx.get(f"{flower}/task/{bad['uuid']}", timeout=10).status_code == 401
    assert httpx.get(f"{flower}/metrics", timeout=10).status_code == 401

    # The screenshots, kept as the test's artifacts
    for name, url in (("flower-tasks.png", f"{authed}/tasks"),
                      ("flower-failed-task.png", f"{authed}/task/{bad['uuid']}")):
        shot = tmp_path / name
        chromium(tmp_path, url, f"--screenshot={shot}", "--window-size=1400,900")
        assert shot.stat().st_size > 10_000
        print(f"screenshot: {shot}")


def _answers(url: str) -> bool:
    """Whether Flower answers `url` with its credentials (it answers nothing without them)."""
    try:
        return httpx.get(url, auth=(USER, PASSWORD), timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
