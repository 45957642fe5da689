"""Dispatch through real Celery workers: a busy worker never holds a second job."""

from __future__ import annotations

from pathlib import Path

from e31.core.states import FINAL_STATES
from tests.conftest import wait_for

from .conftest import Stack

WAIT_S = 60


def test_short_jobs_never_wait_behind_a_busy_worker_while_another_is_idle(
        stack: Stack, shared_tmp: Path) -> None:
    # Given two cpu workers, one busy with a job that runs until the test releases it
    client = stack.client()
    release = shared_tmp / "release"
    long = client.submit(entrypoint="e2ejobs:held", params={"release": str(release)},
                         resources={"gpus": 0})
    wait_for(lambda: long.status()["state"] == "running", timeout_s=WAIT_S,
             what="the long job to run")

    # When four short jobs are submitted
    shorts = [client.submit(entrypoint="e2ejobs:timed", params={"seconds": 0.3},
                            resources={"gpus": 0}) for _ in range(4)]

    # Then all four end while the long job still holds its worker: none waited behind it,
    # however slowly they start one after another on the idle worker
    try:
        wait_for(lambda: all(s.status()["state"] in FINAL_STATES for s in shorts),
                 timeout_s=WAIT_S, poll_s=0.2,
                 what="the short jobs to end while the long one runs (one waits behind it?)")
    finally:
        release.touch()
    long_status = long.wait(timeout=WAIT_S)
    long_worker = long_status["attempts"][0]["worker"]
    for status in (s.wait(timeout=WAIT_S) for s in shorts):
        assert status["attempts"][0]["worker"] != long_worker
        assert status["result"]["end"] < long_status["result"]["end"], \
            "a short job waited for the long one"
