"""The hung-job watchdog and GPU telemetry on a real stack (`e31 up`, simulated GPUs): a job
that sleeps without output or progress is flagged in `e31 status`, or killed with reason
idle; one that prints is left alone; an attempt on a simulated GPU records what it used, and
the worker's heartbeat carries its GPU's (simulated) telemetry."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
import redis

from e31 import JobFailed
from e31.core import keys
from tests.conftest import wait_for

from .conftest import Stack

WAIT_S = 60
IDLE_S = 3
PRINTS = "for i in $(seq 1 12); do echo step $i; sleep 0.5; done"


def wide_e31(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    """`e31 ARGS` printing its tables on a terminal wide enough for every column."""
    return subprocess.run([sys.executable, "-m", "e31.cli", *args],
                          env=dict(stack.env, COLUMNS="200"), capture_output=True, text=True,
                          timeout=60)


def test_a_hung_job_is_flagged_in_e31_status_and_left_running(stack: Stack) -> None:
    # Given a job that sleeps without a word, flagged (not killed) after 3 s
    job = stack.client().submit(command=["sleep", "300"], resources={"gpus": 0},
                                idle_timeout_s=IDLE_S, name="hung")
    try:
        # When it has been silent for longer than that
        status = wait_for(lambda: (s := job.status())["idle_since"] and s, timeout_s=WAIT_S,
                          what="the idle flag")

        # Then it is still running, flagged in its status and in `e31 status`
        assert status["state"] == "running"
        shown = wide_e31(stack, "status", job.id)
        assert shown.returncode == 0, shown.stderr
        assert "idle_since" in shown.stdout and "running (idle)" in shown.stdout
        assert json.loads(stack.e31("status", job.id, "--json").stdout)["idle_since"]
    finally:
        job.cancel()
    with pytest.raises(JobFailed) as ended:
        job.wait(timeout=WAIT_S)
    assert ended.value.status["state"] == "cancelled"


def test_a_hung_job_with_on_idle_kill_ends_with_reason_idle(stack: Stack) -> None:
    job = stack.client().submit(command=["sleep", "300"], resources={"gpus": 0},
                                idle_timeout_s=IDLE_S, on_idle="kill", retries={"max": 0})
    with pytest.raises(JobFailed) as ended:
        job.wait(timeout=WAIT_S)
    status = ended.value.status
    assert (status["state"], status["reason"]) == ("failed", "idle")
    assert [a["reason"] for a in status["attempts"]] == ["idle"]
    assert status["attempts"][0]["idle_since"] is not None


def test_a_job_that_prints_regularly_is_not_flagged(stack: Stack) -> None:
    # Given a job that prints every half second for six seconds, killed if idle for 3 s
    job = stack.client().submit(command=["sh", "-c", PRINTS], resources={"gpus": 0},
                                idle_timeout_s=IDLE_S, on_idle="kill")

    # Then it runs to its end, never flagged
    status = job.wait(timeout=WAIT_S)
    assert status["state"] == "succeeded"
    assert status["attempts"][0]["idle_since"] is None


def test_an_attempt_on_a_simulated_gpu_records_its_gpu_use_and_the_heartbeat_its_telemetry(
        stack: Stack) -> None:
    # Given a job on one of the stack's simulated GPUs (24 GB, or the 48 GB one that spills
    # to gpu24) that works (prints) for six seconds
    job = stack.client().submit(command=["sh", "-c", PRINTS],
                                resources={"gpus": 1, "gpu_mem_gb": 24})
    gpu = wait_for(lambda: (a := job.status()["attempts"]) and a[-1]["gpus"],
                   timeout_s=WAIT_S, what="the job to start")
    gpu_gb = {"0": 24, "1": 48}[gpu]

    # Then while it runs, the heartbeat of the worker watching its GPU carries the GPU's
    # simulated reading, held (whichever of the host's gang workers runs the job)
    r = redis.Redis.from_url(stack.redis_url)
    node = f"gpu{gpu}@{socket.gethostname()}"

    def busy_reading() -> dict | None:
        raw = r.get(keys.worker(node))
        beat = json.loads(raw) if raw else {}
        readings = beat.get("gpus_telemetry") or []
        held = job.status()["state"] == "running" and readings and readings[0]["mem_used_bytes"]
        return readings[0] if held else None

    reading = wait_for(busy_reading, timeout_s=WAIT_S, what="the busy worker's GPU reading")
    assert reading["simulated"] is True and reading["index"] == int(gpu)
    assert reading["mem_total_bytes"] == gpu_gb * 1024 ** 3

    # And its attempt records the peak memory and mean utilisation, shown by e31 status
    status = job.wait(timeout=WAIT_S)
    [attempt] = status["attempts"]
    assert attempt["gpu_mem_peak_gb"] == gpu_gb / 2
    assert 0 < attempt["gpu_util_mean"] <= 100
    assert f"{gpu_gb / 2:.1f} GB" in wide_e31(stack, "status", job.id).stdout
