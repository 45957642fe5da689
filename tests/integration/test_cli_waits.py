"""What `e31 submit` and `e31 submit --wait` say of a job that waits (issue 32, rough edge 2):
the CLI in a process of its own, off a terminal, against the real API served on a local port
over the test's store and Redis. No worker runs: the heartbeats a test writes are all there is.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import redis
from fastapi.testclient import TestClient

from e31.core.clock import utcnow
from e31.store import Repo
from tests.integration.test_api_limits import serving
from tests.integration.test_scheduler import a_scheduler_leads, heartbeat


def cli_env(port: int, token: str, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("E31_")}
    env.update(E31_URL=f"http://127.0.0.1:{port}", E31_TOKEN=token, E31_HOME=str(home))
    return env


def lines_of(stream: IO[str]) -> queue.Queue[str]:
    """The lines of `stream` as they come, read by a thread of their own."""
    got: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in stream:
            got.put(line.rstrip("\n"))
    threading.Thread(target=read, daemon=True).start()
    return got


def next_line(got: queue.Queue[str], within_s: float, containing: str) -> tuple[str, float]:
    """The first line holding `containing` within `within_s`, and how long it took to come."""
    start = time.monotonic()
    deadline = start + within_s
    seen = []
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = got.get(timeout=left)
        except queue.Empty:
            break
        seen.append(line)
        if containing in line:
            return line, time.monotonic() - start
    raise AssertionError(f"no line with {containing!r} within {within_s} s: {seen}")


@contextmanager
def running(args: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-m", "e31.cli", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_wait_on_a_class_nobody_serves_says_why_at_once_and_when_it_changes(
        repo: Repo, api: TestClient, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given the API, and no worker serving e31.cpu
    _, token = repo.create_tenant("team-a", now=utcnow())
    with serving(api.app) as port:       # type: ignore[arg-type]
        env = cli_env(port, token, tmp_path)
        # When a CPU job is submitted with --wait, off a terminal
        with running(["submit", "--wait", "--gpus", "0", "--", "true"], env) as proc:
            assert proc.stdout is not None and proc.stderr is not None
            out, err = lines_of(proc.stdout), lines_of(proc.stderr)
            job_id, _ = next_line(out, 60, "j-")

            # Then within a second or two of the id, stderr says why it waits
            line, took = next_line(err, 3, "waits:")
            assert line == f"{job_id} waits: no worker serves e31.cpu: no cpu worker is running"
            assert took < 3

            # And when a worker of its queue appears, the new reason follows
            heartbeat(redis_client, "cpu@test", ["e31.cpu"])
            changed, _ = next_line(err, 5, "waits:")
            assert changed.startswith(f"{job_id} waits: ") and "no worker serves" not in changed


def test_a_submit_of_a_class_nobody_serves_warns_on_stderr_and_one_that_is_served_does_not(
        repo: Repo, api: TestClient, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given the API, and no worker serving e31.cpu
    _, token = repo.create_tenant("team-a", now=utcnow())
    with serving(api.app) as port:       # type: ignore[arg-type]
        env = cli_env(port, token, tmp_path)

        # When a CPU job is submitted
        done = subprocess.run([sys.executable, "-m", "e31.cli", "submit", "--gpus", "0", "--",
                               "true"], env=env, capture_output=True, text=True, timeout=60,
                              check=False)

        # Then stdout holds its id alone and stderr warns that nothing serves its class
        assert done.returncode == 0, done.stderr
        job_id = done.stdout.strip()
        assert job_id.startswith("j-")
        assert (f"warning: {job_id} waits: no worker serves e31.cpu: no cpu worker is running; "
                "it starts only once such a worker is started") in done.stderr

        # And once a worker serves e31.cpu, while no scheduler runs, a submit warns of that
        # (issue 32: the job said it waited for a free slot)
        heartbeat(redis_client, "cpu@test", ["e31.cpu"])
        unled = subprocess.run([sys.executable, "-m", "e31.cli", "submit", "--gpus", "0", "--",
                                "true"], env=env, capture_output=True, text=True, timeout=60,
                               check=False)
        assert unled.returncode == 0, unled.stderr
        assert (f"warning: {unled.stdout.strip()} waits: no scheduler is running: nothing is "
                "published until one is") in unled.stderr

        # And once a scheduler leads too, a submit warns of nothing
        a_scheduler_leads(redis_client)
        again = subprocess.run([sys.executable, "-m", "e31.cli", "submit", "--gpus", "0", "--",
                                "true"], env=env, capture_output=True, text=True, timeout=60,
                               check=False)
        assert again.returncode == 0, again.stderr
        assert "warning" not in again.stderr
