"""Placement on the real stack (issue 15, items 2 and 3): an impossible job is refused and a
held one explains itself; a job that runs out of GPU memory on gpu24 goes on to gpu48 and
succeeds there, while with `on_oom: fail` it fails with reason oom. The session's stack:
simulated GPUs 1x24 (index 0) and 1x48 (index 1) on one host."""

from __future__ import annotations

from pathlib import Path

import pytest

from e31.core.errors import JobFailed
from tests.conftest import wait_for

from .conftest import Stack

WAIT_S = 60


def test_an_impossible_job_is_refused_and_a_held_one_says_what_is_missing(stack: Stack) -> None:
    # Given the stack's one host with one gpu48 GPU: a job asking for two is refused (exit 2)
    args = ("submit", "-e", "e2ejobs:where", "--gpus", "2", "--size-class", "gpu48")
    refused = stack.e31(*args)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "no node with 2 × gpu48 is registered (largest: 1 × gpu48 on" in refused.stderr

    # When it says --allow-pending, it is stored, and its status says exactly why it waits
    held = stack.e31(*args, "--allow-pending")
    assert held.returncode == 0, held.stderr
    job_id = held.stdout.strip()
    status = stack.client().get(job_id).status()
    assert (status["state"], status["pending"]["reason"]) == ("queued", "no_node")
    assert status["pending"]["text"].startswith("no node with 2 × gpu48 is registered")
    stack.client().get(job_id).cancel()


def test_a_cuda_oom_on_gpu24_moves_the_job_to_gpu48_where_it_succeeds_and_fail_fails_it(
        stack: Stack, shared_tmp: Path) -> None:
    client = stack.client()
    # Given the gpu48 GPU busy until the test releases it, so gpu24 jobs start on GPU 0
    release = shared_tmp / "release"
    blocker = client.submit(entrypoint="e2ejobs:held", params={"release": str(release)},
                            resources={"gpu_mem_gb": 40}, name="blocker")
    try:
        wait_for(lambda: blocker.status()["state"] == "running", timeout_s=WAIT_S,
                 what="the blocker to hold the gpu48 GPU")
        # When a job that does not fit 24 GB runs on gpu24: once with on_oom next_class,
        # once with on_oom fail (the control)
        moving = client.submit(entrypoint="placementjobs:needs_more_than",
                               resources={"gpu_mem_gb": 20, "on_oom": "next_class"})
        failing = client.submit(entrypoint="placementjobs:needs_more_than",
                                resources={"gpu_mem_gb": 20, "on_oom": "fail"})

        # Then the control fails with reason oom in gpu24, its one attempt on GPU 0
        with pytest.raises(JobFailed) as failed:
            failing.wait(timeout=WAIT_S)
        assert failed.value.reason == "oom"
        st = failing.status()
        assert (st["size_class"], [a["gpus"] for a in st["attempts"]]) == ("gpu24", ["0"])
        # and the other waits in gpu48, its OOM attempt on GPU 0 recorded as moved there
        wait_for(lambda: moving.status()["queue"] == "e31.gpu48", timeout_s=WAIT_S,
                 what="the OOM job to be queued in gpu48")
        shown = stack.e31("status", moving.id)
        assert "oom: moved to gpu48" in shown.stdout, shown.stdout
    finally:
        release.touch()

    # And once the gpu48 GPU is free it runs there and succeeds; both attempts were billed
    final = moving.wait(timeout=WAIT_S)
    assert final["size_class"] == "gpu48" and final["result"]["cuda_visible_devices"] == "1"
    assert [(a["gpus"], a["reason"], a["moved_to"]) for a in final["attempts"]] == \
        [("0", "oom", "gpu48"), ("1", "succeeded", None)]
    assert final["gpu_seconds"] > 0
    blocker.wait(timeout=WAIT_S)
