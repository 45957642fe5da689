"""The whole path through real processes: submit -> queue -> pinned worker -> stored result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from e31.core.errors import ClientError, JobFailed
from tests.conftest import host_pid, job_processes, process_alive, wait_for

from .conftest import Stack

WAIT_S = 60


def test_an_entrypoint_job_succeeds_with_its_result_and_an_output_file(
        stack: Stack, tmp_path: Path) -> None:
    client = stack.client()
    job = client.submit(entrypoint="e31_worker.examples:hello", params={"name": "e2e"},
                        resources={"gpus": 0}, name="greet")

    status = job.wait(timeout=WAIT_S)

    assert status["result"]["greeting"] == "hello, e2e"
    assert job.result() == status["result"]
    [path] = job.download(tmp_path / "out")
    assert path.read_text() == "hello, e2e\n"
    assert "hello, e2e from job" in job.logs()


def test_a_command_job_runs_its_argv_and_keeps_its_log(stack: Stack) -> None:
    job = stack.client().submit(command=["sh", "-c", "echo line-one; echo line-two >&2"],
                                resources={"gpus": 0})
    job.wait(timeout=WAIT_S)
    log = job.logs()
    assert "line-one" in log and "line-two" in log


def test_a_job_that_fails_twice_then_succeeds_records_three_attempts(stack: Stack) -> None:
    job = stack.client().submit(entrypoint="e31_worker.examples:flaky", params={"succeed_on": 3},
                                retries={"max": 3, "backoff_s": 0.2}, resources={"gpus": 0})
    status = job.wait(timeout=WAIT_S)
    assert status["result"] == {"attempt": 3}
    assert [a["reason"] for a in status["attempts"]] == ["error", "error", "succeeded"]
    assert "fails on purpose" in status["attempts"][0]["error"]
    # billing: the sum of the attempts' durations (cpu class: no GPUs, so no GPU-seconds)
    assert status["gpu_seconds"] == 0


def test_a_job_past_its_timeout_is_killed_and_fails_with_reason_timeout(
        stack: Stack, shared_tmp: Path) -> None:
    pidfile = shared_tmp / "pids"
    job = stack.client().submit(entrypoint="e2ejobs:spin", params={"pidfile": str(pidfile)},
                                timeout_s=2, resources={"gpus": 0})
    with pytest.raises(JobFailed) as failed:
        job.wait(timeout=WAIT_S)
    assert failed.value.reason == "timeout"
    assert len(pidfile.read_text().split()) == 2   # it ran, with its grandchild
    wait_for(lambda: not job_processes(job.id), timeout_s=10,
             what="every process of the job to be gone")


def test_cancelling_a_running_job_kills_its_processes(stack: Stack, shared_tmp: Path) -> None:
    pidfile = shared_tmp / "pids"
    job = stack.client().submit(entrypoint="e2ejobs:spin", params={"pidfile": str(pidfile)},
                                resources={"gpus": 0})
    wait_for(pidfile.exists, timeout_s=WAIT_S, what="the job to start")
    pids = [host_pid(job.id, int(p)) for p in pidfile.read_text().split()]

    job.cancel()

    with pytest.raises(JobFailed) as failed:
        job.wait(timeout=WAIT_S)
    assert failed.value.status["state"] == "cancelled"
    assert failed.value.status["attempts"][-1]["reason"] == "cancelled"
    for pid in pids:
        wait_for(lambda pid=pid: not process_alive(pid), timeout_s=10,
                 what=f"pid {pid} to be gone")


def test_cancelling_a_queued_job_means_it_never_runs(stack: Stack) -> None:
    # gpu80 has no worker in this stack, so the job waits in its queue
    job = stack.client().submit(entrypoint="e2ejobs:where", resources={"gpu_mem_gb": 80})
    assert job.status()["state"] == "queued"
    assert job.cancel()["state"] == "cancelled"
    assert job.status()["attempts"] == []


def test_a_40gb_job_runs_only_on_the_gpu48_worker_and_sees_its_gpu(stack: Stack) -> None:
    client = stack.client()
    jobs = [client.submit(entrypoint="e2ejobs:where", resources={"gpus": 1, "gpu_mem_gb": 40})
            for _ in range(3)]
    for job in jobs:
        status = job.wait(timeout=WAIT_S)
        assert status["size_class"] == "gpu48"
        assert status["result"]["cuda_visible_devices"] == "1"
        # given GPU 1 (the 48 GB one) by whichever of the host's gang workers took it
        [attempt] = status["attempts"]
        assert attempt["gpus"] == "1" and attempt["worker"].startswith("gpu")
        assert status["gpu_seconds"] > 0


def test_a_refused_spec_gets_422_and_nothing_is_stored(stack: Stack) -> None:
    client = stack.client()
    before = len(client.list(limit=1000))
    with pytest.raises(ClientError) as refused:
        client.submit(entrypoint="e2ejobs:where", resources={"gpu_mem_gb": 999})
    assert refused.value.status_code == 422
    assert "resources.gpu_mem_gb" in refused.value.message
    assert len(client.list(limit=1000)) == before


def test_tenant_b_cannot_see_or_touch_tenant_as_job(stack: Stack) -> None:
    created = stack.e31("tenant", "create", "tenant-b", "--json")
    assert created.returncode == 0, created.stderr
    token_b = json.loads(created.stdout)["token"]
    job = stack.client().submit(entrypoint="e2ejobs:where", resources={"gpus": 0})
    other = stack.client(token_b)
    for call in (lambda: other.get(job.id), lambda: other.get(job.id)):
        with pytest.raises(ClientError) as hidden:
            call()
        assert hidden.value.status_code == 404
    for path, method in ((f"/v1/jobs/{job.id}/cancel", "POST"), (f"/v1/jobs/{job.id}/logs", "GET"),
                         (f"/v1/jobs/{job.id}/outputs", "GET")):
        with pytest.raises(ClientError) as hidden:
            other.request(method, path)
        assert hidden.value.status_code == 404
    assert job.wait(timeout=WAIT_S)["state"] == "succeeded"  # B's cancel did nothing
    assert all(j["id"] != job.id for j in other.list())
