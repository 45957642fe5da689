"""The watchdog and GPU use through the worker's task body, with real child processes, a real
store and Redis: a hung job is flagged, or killed with reason idle; a job that prints is
left alone; an attempt on simulated GPUs records what it used. And a GPU's XID error drains
its node through the real heartbeat, the reason kept in the store."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

import redis

from e31.core import keys
from e31.core.clock import utcnow
from e31.edge.artifacts import ArtifactStore
from e31.ops.heartbeat import WorkerInfo
from e31.store import Repo
from e31_worker.attempt import task
from e31_worker.attempt.services import AttemptServices
from e31_worker.node.heartbeat import Heartbeat
from e31_worker.node.telemetry import (
    SIM_JOB_MEM_FRACTION,
    GpuMonitor,
    NvmlSource,
    SimulatedSource,
)
from tests.conftest import wait_for
from tests.integration.test_store import publish
from tests.integration.test_task import services, submit
from tests.unit.fake_nvml import FakeGpu, FakeNvml

WAIT_S = 30
PRINTS = "for i in 1 2 3 4 5 6 7 8 9 10 11 12; do echo step $i; sleep 0.25; done"


def run(svc: AttemptServices, job_id: str, repo: Repo) -> None:
    task.run_job(svc, job_id, publish(repo, job_id))


def on_gpu(svc: AttemptServices, mem_gb: float = 24.0) -> AttemptServices:
    """The services of a worker pinned to one simulated GPU of `mem_gb`."""
    identity = WorkerInfo(node="gpu0@test", queues=("e31.cpu",), gpus="0", gpu_count=1,
                          size_class="gpu24")
    return dataclasses.replace(svc, identity=identity,
                               gpus=GpuMonitor(SimulatedSource({0: mem_gb}), max_age_s=1.0))


def test_a_hung_job_is_flagged_idle_while_it_runs_and_keeps_running(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given a job that sleeps without output or progress, with an idle timeout of 1 s
    tenant_id, job_id = submit(repo, command=["sleep", "4"], idle_timeout_s=1)
    svc = services(repo, redis_client, tmp_path, ArtifactStore(f"file://{tmp_path / 'a'}"))
    worker = threading.Thread(target=run, args=(svc, job_id, repo))

    # When it runs
    worker.start()
    try:
        # Then it is flagged in its status while it runs
        status = wait_for(lambda: (s := repo.get_job(tenant_id, job_id).to_status())
                          ["idle_since"] and s, timeout_s=WAIT_S, what="the idle flag")
        assert status["state"] == "running"
        assert status["attempts"][0]["idle_since"] == status["idle_since"]
        assert repo.idle_jobs() == {"cpu": 1}
    finally:
        worker.join(timeout=WAIT_S)

    # And on_idle: flag let it finish; its attempt keeps the flag it ended with
    status = repo.get_job(tenant_id, job_id).to_status()
    assert status["state"] == "succeeded"
    assert status["attempts"][0]["idle_since"] is not None
    assert repo.idle_jobs() == {}


def test_a_hung_job_with_on_idle_kill_is_stopped_with_reason_idle(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given a hung job that asks to be killed when idle, with no retry
    marker = tmp_path / "trapped"
    command = ["sh", "-c", f"trap 'echo term > {marker}; exit 143' TERM; sleep 60 & wait"]
    tenant_id, job_id = submit(repo, command=command, idle_timeout_s=1, on_idle="kill",
                               retries={"max": 0})
    svc = services(repo, redis_client, tmp_path, ArtifactStore(f"file://{tmp_path / 'a'}"))

    # When it runs
    run(svc, job_id, repo)

    # Then it was stopped like a timeout (SIGTERM first) and failed with reason idle
    status = repo.get_job(tenant_id, job_id).to_status()
    assert status["state"] == "failed" and status["reason"] == "idle"
    assert "idle_timeout_s" in status["error"]
    assert [a["reason"] for a in status["attempts"]] == ["idle"]
    assert marker.read_text() == "term\n"


def test_an_idle_kill_is_retried_like_a_timeout(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path) -> None:
    tenant_id, job_id = submit(repo, command=["sleep", "60"], idle_timeout_s=1, on_idle="kill",
                               retries={"max": 1, "backoff_s": 0})
    run(services(repo, redis_client, tmp_path, ArtifactStore(f"file://{tmp_path / 'a'}")),
        job_id, repo)
    status = repo.get_job(tenant_id, job_id).to_status()
    assert status["state"] == "queued" and status["reason"] == "idle"


def test_a_job_that_prints_regularly_is_never_flagged(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given a job that prints every quarter second for three seconds, killed if idle for 1 s
    tenant_id, job_id = submit(repo, command=["sh", "-c", PRINTS], idle_timeout_s=1,
                               on_idle="kill")

    # When it runs
    run(services(repo, redis_client, tmp_path, ArtifactStore(f"file://{tmp_path / 'a'}")),
        job_id, repo)

    # Then it succeeded, never flagged
    status = repo.get_job(tenant_id, job_id).to_status()
    assert status["state"] == "succeeded"
    assert status["attempts"][0]["idle_since"] is None


def test_a_job_that_only_reports_progress_is_not_idle(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path) -> None:
    progress = ('for i in 1 2 3 4 5 6 7 8 9 10 11 12; do '
                'echo "{\\"done\\": $i, \\"total\\": 12}" > "$E31_PROGRESS_PATH.tmp"; '
                'mv "$E31_PROGRESS_PATH.tmp" "$E31_PROGRESS_PATH"; sleep 0.25; done')
    tenant_id, job_id = submit(repo, command=["sh", "-c", progress], idle_timeout_s=1,
                               on_idle="kill")
    run(services(repo, redis_client, tmp_path, ArtifactStore(f"file://{tmp_path / 'a'}")),
        job_id, repo)
    status = repo.get_job(tenant_id, job_id).to_status()
    assert status["state"] == "succeeded", status["error"]


def test_an_attempt_on_simulated_gpus_records_its_peak_memory_and_mean_utilisation(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given a worker on a simulated 24 GB GPU and a job that works (prints) for 3 s
    tenant_id, job_id = submit(repo, command=["sh", "-c", PRINTS])
    svc = on_gpu(services(repo, redis_client, tmp_path,
                          ArtifactStore(f"file://{tmp_path / 'a'}")))

    # When it runs
    run(svc, job_id, repo)

    # Then its attempt says what it held of the GPU and how busy it kept it
    [attempt] = repo.get_job(tenant_id, job_id).to_status()["attempts"]
    assert attempt["gpu_mem_peak_gb"] == 24.0 * SIM_JOB_MEM_FRACTION
    assert 0 < attempt["gpu_util_mean"] <= 100


def test_a_hung_job_on_a_simulated_gpu_is_killed_its_gpu_idle(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path) -> None:
    tenant_id, job_id = submit(repo, command=["sleep", "60"], idle_timeout_s=1, on_idle="kill",
                               retries={"max": 0})
    svc = on_gpu(services(repo, redis_client, tmp_path,
                          ArtifactStore(f"file://{tmp_path / 'a'}")))
    run(svc, job_id, repo)
    status = repo.get_job(tenant_id, job_id).to_status()
    assert status["reason"] == "idle"
    assert status["attempts"][0]["gpu_util_mean"] == 0.0


def test_an_xid_error_takes_its_worker_out_of_service_with_the_reason_shown(
        repo: Repo, redis_client: redis.Redis) -> None:
    # Given a worker's heartbeat over a GPU read through (fake) NVML
    gpu = FakeGpu(util_pct=40)
    monitor = GpuMonitor(NvmlSource.open([0], FakeNvml({0: gpu})), max_age_s=0.0)
    node = "gpu0@xid-test"
    drains: list[Any] = []
    beat = Heartbeat(redis_client=redis_client,
                     identity=WorkerInfo(node=node, queues=("e31.gpu80",), gpus="0",
                                         gpu_count=1, size_class="gpu80"),
                     interval_s=0.1, on_drain=lambda: drains.append(True),
                     drain_authorized=lambda: False, gpus=monitor,
                     record_drain=lambda why: repo.request_drain([node], now=utcnow(),
                                                                 reason=why))
    beat.start()
    try:
        heartbeat = wait_for(lambda: redis_client.get(keys.worker(node)), timeout_s=WAIT_S,
                             what="the first heartbeat")
        assert json.loads(heartbeat)["gpus_telemetry"][0]["util_pct"] == 40.0

        # When its GPU reports XID 79 (fallen off the bus)
        gpu.xids.append(79)

        # Then the node drains itself, once, for its GPU's error, and the store says why
        wait_for(lambda: beat.drain_requested.is_set(), timeout_s=WAIT_S, what="the drain")
        assert drains == [True] and beat.gpu_fault.is_set()
        [drained] = repo.drained_nodes()
        assert (drained.node, drained.reason) == (node, "GPU error: XID 79 on GPU 0")
    finally:
        beat.stop()
        monitor.close()
    repo.clear_drain([node])


class FailingGpus:
    """A GPU view whose readings fail with OSError (a full disk under the gang ledger) while
    `failing` is set."""

    def __init__(self) -> None:
        self.failing = threading.Event()
        self.failing.set()
        self.calls = 0

    def current(self, *, busy: bool) -> tuple[()]:
        self.calls += 1
        if self.failing.is_set():
            raise OSError(28, "No space left on device")
        return ()

    def faults(self) -> list[Any]:
        return []


def test_a_heartbeat_that_meets_an_unexpected_error_beats_on_once_it_clears(
        redis_client: redis.Redis) -> None:
    # Given a worker's heartbeat whose GPU readings fail with OSError (ENOSPC)
    gpus = FailingGpus()
    node = "gpu0@oserror-test"
    beat = Heartbeat(redis_client=redis_client,
                     identity=WorkerInfo(node=node, queues=("e31.gpu24",), gpus="0",
                                         gpu_count=1, size_class="gpu24"),
                     interval_s=0.05, on_drain=lambda: None, drain_authorized=lambda: False,
                     gpus=gpus)  # type: ignore[arg-type]
    beat.start()
    try:
        # When several beats fail so, and then the fault clears
        wait_for(lambda: gpus.calls >= 3, timeout_s=WAIT_S, what="three failed beats")
        assert redis_client.get(keys.worker(node)) is None
        gpus.failing.clear()

        # Then the same thread beats again: the pool sees the worker
        wait_for(lambda: redis_client.get(keys.worker(node)), timeout_s=WAIT_S,
                 what="a heartbeat after the fault")
        assert beat._thread is not None and beat._thread.is_alive()
    finally:
        beat.stop()


def drained_while_running(repo: Repo, redis_client: redis.Redis, tmp_path: Path, *,
                          gpu_fault: bool) -> tuple[str, str]:
    """A job with no retry of its own, running on a worker's simulated GPU when the node
    drains (for its GPU's error, as its heartbeat does on an XID, or not); returns (tenant,
    job) once its worker has recorded the attempt."""
    tenant_id, job_id = submit(repo, command=["sleep", "60"], retries={"max": 0})
    svc = on_gpu(services(repo, redis_client, tmp_path,
                          ArtifactStore(f"file://{tmp_path / 'a'}")))
    worker = threading.Thread(target=run, args=(svc, job_id, repo))
    worker.start()
    try:
        wait_for(lambda: repo.get_job(tenant_id, job_id).state == "running", timeout_s=WAIT_S,
                 what="the job to run")
        if gpu_fault:
            svc.gpu_fault.set()
        svc.draining.set()
    finally:
        worker.join(timeout=WAIT_S)
    return tenant_id, job_id


def test_a_job_on_a_gpu_that_reports_an_xid_runs_again_without_spending_a_retry(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given a job with no retry of its own running on a worker's simulated GPU, when its
    # node drains for the GPU's error, as its heartbeat does on an XID
    tenant_id, job_id = drained_while_running(repo, redis_client, tmp_path, gpu_fault=True)

    # Then its attempt ended gpu_fault, the pool's: with retries.max 0 the job is queued
    # again (an ending of the user's would have failed it)
    record = repo.get_job(tenant_id, job_id)
    assert record.state == "queued"
    assert [a.reason for a in record.attempts] == ["gpu_fault"]


def test_a_drain_that_is_not_a_gpu_fault_still_ends_drained(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given the same job on the same worker, when an operator drains the node (no GPU error)
    tenant_id, job_id = drained_while_running(repo, redis_client, tmp_path, gpu_fault=False)

    # Then it ended drained, as before: the difference is the GPU's error alone
    assert [a.reason for a in repo.get_job(tenant_id, job_id).attempts] == ["drained"]
