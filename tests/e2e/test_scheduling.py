"""Scheduling through the real stack: `after:`, and why a job waits (`e31 status`, `e31 queue`)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import wait_for

from .conftest import Stack

WAIT_S = 60


def test_a_job_after_another_starts_only_once_the_first_succeeded(
        stack: Stack, shared_tmp: Path) -> None:
    # Given a cpu job that runs until the test releases it, and a job after it (two cpu
    # slots: it could start at once)
    client = stack.client()
    release = shared_tmp / "release"
    first = client.submit(entrypoint="e2ejobs:held", params={"release": str(release)},
                          resources={"gpus": 0})
    second = client.submit(entrypoint="e2ejobs:timed", params={"seconds": 0}, resources={"gpus": 0},
                           after=[first.id])

    # When the first runs, the second says what it waits for
    try:
        wait_for(lambda: (second.status()["pending"] or {}).get("reason") == "dependency",
                 timeout_s=10, what="the scheduler's pending reason")
        status = json.loads(stack.e31("status", second.id, "--json").stdout)
    finally:
        release.touch()
    assert status["after"] == [first.id]
    assert status["pending"]["reason"] == "dependency"
    assert status["pending"]["text"] == f"dependency {first.id} not finished"

    # Then it starts after the first ended
    done = [first.wait(timeout=WAIT_S), second.wait(timeout=WAIT_S)]
    assert done[1]["result"]["start"] >= done[0]["result"]["end"]


def test_status_and_queue_explain_a_job_waiting_for_a_busy_class(
        stack: Stack, shared_tmp: Path) -> None:
    # Given one gpu48 GPU busy with a job that runs until the test releases it, and two more
    # gpu48 jobs behind it
    client = stack.client()
    release = shared_tmp / "release"
    busy = client.submit(entrypoint="e2ejobs:held", params={"release": str(release)},
                         resources={"gpu_mem_gb": 48})
    try:
        wait_for(lambda: busy.status()["state"] == "running", timeout_s=WAIT_S,
                 what="the first job")
        behind = [client.submit(entrypoint="e2ejobs:timed", params={"seconds": 0},
                                resources={"gpu_mem_gb": 48}) for _ in range(2)]

        # When the last one is looked at (the first behind may already wait in its queue)
        last = behind[-1]
        wait_for(lambda: (last.status()["pending"] or {}).get("reason") == "no_capacity",
                 timeout_s=10, what="the scheduler's pending reason")
        shown = stack.e31("status", last.id)
        queue = json.loads(stack.e31("queue", "--json").stdout)
        queue_text = stack.e31("queue").stdout
    finally:
        release.touch()

    # Then status says why, where and when; the queue shows the class busy with work queued
    assert shown.returncode == 0, shown.stderr
    assert "waiting for a free gpu48 GPU" in shown.stdout and "position" in shown.stdout
    gpu48 = next(c for c in queue["classes"] if c["size_class"] == "gpu48")
    assert gpu48["gpus"] == 1 and gpu48["busy_gpus"] == 1 and gpu48["queued"] >= 1
    assert "gpu48" in queue_text
    for job in (busy, *behind):
        assert job.wait(timeout=WAIT_S)["state"] == "succeeded"
