"""The broker is not a trust boundary, against a real `e31 up` stack and a real `e31 worker`:
anyone holding the Redis URL (every worker host has it) can publish `e31.run` and write drain
keys, and neither runs a job the scheduler did not admit nor drains a worker.

Each test also shows that it would catch the hole: with the authority the attack lacked put
where the platform looks for it (the dispatch token written into the store, the drain
recorded by `e31 worker --drain`), the same message runs the job and the same key drains.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from celery import Celery

from e31.client import Client
from e31.core import keys
from e31.edge import wiring
from e31.edge.celeryapp import TASK_NAME
from e31.edge.settings import Settings
from tests.conftest import process_alive, wait_for

from .conftest import Stack

WAIT_S = 60
HOST = "target"
NODE = f"gpu0@{HOST}"
QUEUE = f"e31.node.{HOST}"    # the extra (gang) worker's host queue: no stack worker takes it
FORGED = "a-token-nobody-issued"
BEATS_S = 2.0                # four heartbeats of the stack (0.5 s): a drain would have begun


@dataclass
class Target:
    """An extra `e31 worker` on the stack, one simulated 80 GB GPU, as host `target`."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    redis: redis.Redis

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def beat(self) -> dict:
        raw = self.redis.get(keys.worker(NODE))
        return json.loads(raw) if raw else {}


@pytest.fixture
def target(stack: Stack, tmp_path: Path) -> Iterator[Target]:
    log_path = tmp_path / "target-worker.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "e31.cli", "worker", "--simulate-gpus",
                                 "1x80", "--hostname", HOST], env=stack.env_with_redis(),
                                stdout=log, stderr=subprocess.STDOUT)
    found = Target(proc, log_path, redis.Redis.from_url(stack.redis_url))
    try:
        wait_for(lambda: found.beat(), timeout_s=WAIT_S, what="the target worker's heartbeat")
        yield found
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)


def attacker(stack: Stack) -> Celery:
    """The platform's own Celery app, as anyone with the broker's URL builds it."""
    return wiring.celery(Settings(redis_url=stack.redis_url))


def capped_client(stack: Stack, name: str) -> Client:
    """A new tenant whose quota allows no gpu80 GPU at all."""
    done = stack.e31("tenant", "create", name, "--quota", "gpu80=0", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    return stack.client(json.loads(done.stdout)["token"])


def test_a_hand_published_message_does_not_run_a_job_its_quota_holds(
        stack: Stack, target: Target) -> None:
    # Given a job its tenant's quota holds, although the worker of its class is idle
    client = capped_client(stack, "capped-broker")
    job = client.submit(command=["true"], resources={"gpu_mem_gb": 80}, name="held")
    wait_for(lambda: (job.status()["pending"] or {}).get("reason") == "quota", timeout_s=WAIT_S,
             what="the scheduler to hold the job for its quota")

    # When someone with the broker's URL publishes `e31.run` for it by hand: the job id alone,
    # and with a made-up dispatch token
    app = attacker(stack)
    app.send_task(TASK_NAME, args=[job.id], queue=QUEUE, routing_key=QUEUE)
    app.send_task(TASK_NAME, args=[job.id, FORGED], queue=QUEUE, routing_key=QUEUE)

    # Then the worker receives both, runs neither, and says so; the job is queued, untouched
    wait_for(lambda: target.log().count(f"message_unauthorized job={job.id}") == 2,
             timeout_s=WAIT_S, what="the worker to refuse both messages")
    status = job.status()
    assert status["state"] == "queued" and status["attempts"] == []
    assert status["pending"]["reason"] == "quota"

    # And the same forged message runs the job once the store holds its token and place (what
    # the check guards): a run past the quota would show here
    with sqlite3.connect(stack.home / "e31.db", timeout=30) as db:
        db.execute("UPDATE jobs SET dispatch_token = ?, dispatch_host = ?, dispatch_gpus = '0' "
                   "WHERE id = ?", (FORGED, HOST, job.id))
    app.send_task(TASK_NAME, args=[job.id, FORGED], queue=QUEUE, routing_key=QUEUE)
    done = job.wait(timeout=WAIT_S)
    assert done["state"] == "succeeded" and done["attempts"][0]["worker"] == NODE


def test_a_drain_key_written_into_redis_does_not_drain_a_worker_but_e31_worker_drain_does(
        stack: Stack, target: Target) -> None:
    # Given the class's only worker, live and idle
    pid = target.beat()["pid"]

    # When someone with the broker's URL writes its drain key
    target.redis.set(keys.drain(NODE), "1")

    # Then it logs the refusal and keeps serving: same process, heartbeat after heartbeat
    wait_for(lambda: f"drain_unauthorized node={NODE}" in target.log(), timeout_s=WAIT_S,
             what="the worker to refuse the drain key", evidence=lambda: target.log()[-4000:])
    time.sleep(BEATS_S)  # nothing to wait for: a drain that should not happen
    assert target.beat().get("pid") == pid and target.proc.poll() is None
    assert "worker_drain_requested" not in target.log()
    job = stack.client().submit(command=["true"], resources={"gpu_mem_gb": 80}, name="still")
    assert job.wait(timeout=WAIT_S)["attempts"][0]["worker"] == NODE

    # And an operator's drain, recorded in the store, drains it: the check lets authority in
    done = subprocess.run([sys.executable, "-m", "e31.cli", "worker", "--drain", "--node", NODE],
                          env=stack.env_with_redis(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all drained" in done.stdout
    assert target.proc.wait(timeout=WAIT_S) == 0
    assert "worker_drain_requested" in target.log() and not process_alive(pid)
