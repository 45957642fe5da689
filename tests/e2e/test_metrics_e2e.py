"""The pool's metrics and `e31 top` on a real `e31 up` stack: the API's /metrics behind the
token `e31 up` made, the series moving as a job fails and as a worker is killed under its job,
and `e31 top --once --json` showing a running job."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from e31.core import keys
from tests.conftest import wait_for

from .conftest import Stack

WAIT_S = 60
NODE = "gpu0@metrics-extra"


def metrics_token(stack: Stack) -> str:
    path = stack.home / "metrics.token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    return path.read_text().strip()


def scrape(stack: Stack) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    response = httpx.get(f"{stack.url}/metrics", timeout=30,
                         headers={"Authorization": f"Bearer {metrics_token(stack)}"})
    assert response.status_code == 200, response.text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(response.text)
            for s in family.samples}


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def descendants(pid: int) -> list[int]:
    """`pid`'s live descendants, from /proc (children before grandchildren)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int(
                    (entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError):
                continue
    found, frontier = [], [pid]
    while frontier:
        children = [c for c, p in parents.items() if p in frontier]
        found += children
        frontier = children
    return found


@pytest.fixture
def gpu80_worker(stack: Stack) -> Iterator[subprocess.Popen[bytes]]:
    """An extra `e31 worker` with one simulated 80 GB GPU (a class the stack lacks)."""
    log = open(stack.home / "logs" / "metrics-worker.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "e31.cli", "worker", "--simulate-gpus", "1x80",
                             "--hostname", NODE.split("@")[1]], env=stack.env_with_redis(),
                            stdout=log, stderr=subprocess.STDOUT)
    r = redis.Redis.from_url(stack.redis_url)
    wait_for(lambda: r.get(keys.worker(NODE)), timeout_s=WAIT_S, what="the gpu80 worker")
    yield proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_the_metrics_need_the_token_e31_up_made_and_count_a_failed_job(stack: Stack) -> None:
    # Given the stack's metrics, scraped with and without its token
    assert httpx.get(f"{stack.url}/metrics", timeout=30).status_code == 401
    before = scrape(stack)
    assert value(before, "e31_store_up") == 1 and value(before, "e31_broker_up") == 1
    assert time.time() - value(before, "e31_scheduler_last_tick_timestamp_seconds") < 30
    wait_for(lambda: sum(v for (name, labels), v in scrape(stack).items()
                         if name == "e31_gpus" and ("class", "gpu48") in labels) == 1,
             timeout_s=WAIT_S, what="the stack's gpu48 worker counted")
    assert [v for (name, _), v in scrape(stack).items() if name == "e31_gpu_simulated"] == [1, 1]

    # When a job fails
    job = stack.client().submit(command=["sh", "-c", "exit 3"], resources={"gpus": 0})
    wait_for(lambda: job.status()["state"] == "failed", timeout_s=WAIT_S, what="the job to fail")

    # Then its end is counted, by class and reason, and as a failed job of its tenant
    after = scrape(stack)
    cpu = {"class": "cpu"}
    assert value(after, "e31_attempts_ended_total", **cpu, reason="error") == \
        value(before, "e31_attempts_ended_total", **cpu, reason="error") + 1
    assert value(after, "e31_jobs_ended_total", state="failed", **cpu, tenant="default") == \
        value(before, "e31_jobs_ended_total", state="failed", **cpu, tenant="default") + 1


def test_a_worker_killed_under_its_job_is_lost_then_its_lease_expires(
        stack: Stack, gpu80_worker: subprocess.Popen[bytes]) -> None:
    # Given a job running on the extra gpu80 worker
    g80 = {"class": "gpu80"}
    job = stack.client().submit(entrypoint="e31_worker.examples:sleep",
                                params={"seconds": 300, "steps": 300}, resources={"gpu_mem_gb": 80})
    # (its code running, not only its state: until bubblewrap's namespace init has set up the
    # sandbox it does not die with its parent, so a kill in that window would orphan the job
    # until the node's next start releases it)
    wait_for(lambda: (job.status().get("progress") or {}).get("done", 0) >= 1,
             timeout_s=WAIT_S, what="the job's code to run")
    busy = scrape(stack)
    assert value(busy, "e31_workers", **g80, state="busy") == 1
    assert value(busy, "e31_gpu_busy", node=NODE.split("@")[1], gpu="0") == 1
    expiries = value(busy, "e31_lease_expiries_total", **g80)

    # When its worker, launcher and all, is killed
    pids = [gpu80_worker.pid, *descendants(gpu80_worker.pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    gpu80_worker.wait(timeout=30)

    # Then the node is lost while the store still shows its lease, and once the lease expires
    # the attempt is a lease expiry and the node is no longer counted
    wait_for(lambda: value(scrape(stack), "e31_workers", **g80, state="lost") == 1,
             timeout_s=WAIT_S, poll_s=0.2, what="the node counted lost")
    wait_for(lambda: value(scrape(stack), "e31_lease_expiries_total", **g80) == expiries + 1,
             timeout_s=WAIT_S, poll_s=0.5, what="the lease expiry counted")
    after = scrape(stack)
    assert value(after, "e31_workers", **g80, state="lost") == 0
    assert value(after, "e31_attempts_ended_total", **g80, reason="lost") >= 1
    assert job.status()["state"] == "queued"
    job.cancel()


def test_e31_top_once_json_shows_a_running_job_with_its_gpu(stack: Stack) -> None:
    # Given a job running on the stack's simulated 24 GB GPU
    job = stack.client().submit(entrypoint="e31_worker.examples:sleep",
                                params={"seconds": 300, "steps": 300},
                                resources={"gpu_mem_gb": 20}, name="top-me")
    wait_for(lambda: job.status()["state"] == "running", timeout_s=WAIT_S, what="the job to run")

    # When `e31 top --once --json` runs
    try:
        result = stack.e31("top", "--once", "--json")
    finally:
        job.cancel()

    # Then it shows the job with its tenant and GPU, and the class with a busy GPU
    assert result.returncode == 0, result.stderr
    snap = json.loads(result.stdout)
    [mine] = [j for j in snap["running"] if j["id"] == job.id]
    assert mine["name"] == "top-me" and mine["tenant"] == "default"
    assert mine["size_class"] == "gpu24" and mine["runtime_s"] >= 0
    [gpu] = [g for g in snap["gpus"] if g["job"] == job.id]   # its own class's, or spilled
    assert gpu["state"] == "busy" and gpu["size_class"] in ("gpu24", "gpu48")
    assert gpu["simulated"] is True and gpu["utilization"] is not None
    [held] = [c for c in snap["classes"] if c["size_class"] == gpu["size_class"]]
    assert held["busy_gpus"] >= 1
    [g24] = [c for c in snap["classes"] if c["size_class"] == "gpu24"]
    assert g24["running"] >= 1


def test_no_job_sees_the_metrics_token(stack: Stack) -> None:
    # Given the token e31 up made for the metrics
    token = metrics_token(stack)

    # When a job prints its environment
    job = stack.client().submit(command=["env"], resources={"gpus": 0})
    wait_for(lambda: job.status()["state"] == "succeeded", timeout_s=WAIT_S,
             what="the job to end")

    # Then neither the token nor where it lies is in it
    logs = job.logs()
    assert "PATH=" in logs                       # the job did print its environment
    assert token not in logs and "METRICS" not in logs
