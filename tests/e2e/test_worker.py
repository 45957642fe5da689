"""`e31 worker` as an operator runs it: pinning, no CUDA in the worker, restart, drain."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from e31.core import keys
from tests.conftest import host_pid, process_alive, wait_for

from .conftest import Stack

WAIT_S = 60


@pytest.fixture
def gpu80_worker(stack: Stack, request: pytest.FixtureRequest
                 ) -> Iterator[tuple[subprocess.Popen[bytes], redis.Redis]]:
    """An extra `e31 worker` with one simulated 80 GB GPU, a class the stack itself lacks; of
    the default layout (gangs on demand), or of the one a test names (`--static`)."""
    env = stack.env_with_redis()
    log = open(stack.home / "logs" / "gpu80-worker.log", "ab")
    layout = [getattr(request, "param", "--gangs")]
    proc = subprocess.Popen([sys.executable, "-m", "e31.cli", "worker", "--simulate-gpus", "1x80",
                             "--hostname", "extra", *layout], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    r = redis.Redis.from_url(stack.redis_url)
    wait_for(lambda: r.get(keys.worker("gpu0@extra")), timeout_s=WAIT_S, what="the gpu80 worker")
    yield proc, r
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def _heartbeat(r: redis.Redis) -> dict:
    raw = r.get(keys.worker("gpu0@extra"))
    return json.loads(raw) if raw else {}


@pytest.mark.parametrize("gpu80_worker", ["--gangs", "--static"], indirect=True)
def test_the_worker_process_is_pinned_and_never_loads_torch_or_cuda(
        gpu80_worker, stack: Stack, request: pytest.FixtureRequest) -> None:
    _, r = gpu80_worker
    job = stack.client().submit(entrypoint="e31_worker.examples:matmul", params={"n": 64},
                                resources={"gpu_mem_gb": 80})
    status = job.wait(timeout=WAIT_S)
    assert status["attempts"][0]["worker"] == "gpu0@extra"
    assert status["attempts"][0]["gpus"] == "0"
    pid = _heartbeat(r)["pid"]
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    # a static worker is pinned to its GPU; a gang worker to none (each job to its own)
    static = request.node.callspec.params["gpu80_worker"] == "--static"
    assert (b"CUDA_VISIBLE_DEVICES=0" if static else b"CUDA_VISIBLE_DEVICES=") in environ
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert "libtorch" not in maps and "libcuda" not in maps
    assert status["result"]["device"] == "cpu"  # the job imported torch, in its own process


def test_a_worker_process_killed_with_sigkill_is_restarted(gpu80_worker) -> None:
    _, r = gpu80_worker
    first = _heartbeat(r)["pid"]
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: _heartbeat(r).get("pid") not in (None, first), timeout_s=WAIT_S,
             what="a new worker process")


def test_sigterm_drains_the_running_job_back_to_the_queue_without_using_a_retry(
        gpu80_worker, stack: Stack) -> None:
    proc, r = gpu80_worker
    job = stack.client().submit(entrypoint="e31_worker.examples:sleep",
                                params={"seconds": 300, "steps": 300}, resources={"gpu_mem_gb": 80})
    wait_for(lambda: job.status()["state"] == "running", timeout_s=WAIT_S, what="the job to run")

    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)

    status = job.status()
    assert status["state"] == "queued"            # no gpu80 worker is left to take it
    assert [a["reason"] for a in status["attempts"]] == ["drained"]
    assert r.get(keys.worker("gpu0@extra")) is None
    job.cancel()


def test_a_restarted_worker_kills_what_its_dead_predecessors_job_left_running(
        gpu80_worker, stack: Stack, shared_tmp: Path) -> None:
    _, r = gpu80_worker
    pidfile = shared_tmp / "pids"
    job = stack.client().submit(entrypoint="e2ejobs:spin", params={"pidfile": str(pidfile)},
                                resources={"gpu_mem_gb": 80})
    wait_for(pidfile.exists, timeout_s=WAIT_S, what="the job to start")
    child, grandchild = (host_pid(job.id, int(p)) for p in pidfile.read_text().split())
    worker_pid = _heartbeat(r)["pid"]

    os.kill(worker_pid, signal.SIGKILL)               # the worker dies mid-job

    wait_for(lambda: not process_alive(child), timeout_s=10, what="the job's child to die with it")
    wait_for(lambda: _heartbeat(r).get("pid") not in (None, worker_pid), timeout_s=WAIT_S,
             what="the restarted worker")
    wait_for(lambda: not process_alive(grandchild), timeout_s=10,
             what="the orphaned grandchild to be killed by the restarted worker")
    job.cancel()


def test_a_second_worker_for_the_same_gpu_and_node_name_refuses_to_serve(
        gpu80_worker, stack: Stack) -> None:
    _, r = gpu80_worker
    first = _heartbeat(r)["pid"]
    env = stack.env_with_redis()
    second = subprocess.Popen([sys.executable, "-m", "e31_worker.node.celery_process",
                               "--node", "gpu0@extra", "--queues", "e31.gpu80", "--gpus", "0",
                               "--gpu-count", "1", "--size-class", "gpu80"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = second.communicate(timeout=60)
    assert second.returncode == 3
    assert f"node_taken node=gpu0@extra pid={first}" in output
    assert _heartbeat(r)["pid"] == first
