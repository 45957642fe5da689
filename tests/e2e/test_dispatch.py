"""Dispatch through real Celery workers: a busy worker never holds a second job."""

from __future__ import annotations

from .conftest import Stack

WAIT_S = 60


def test_short_jobs_never_wait_behind_a_busy_worker_while_another_is_idle(stack: Stack) -> None:
    """Two cpu workers; one runs a long job; four short jobs all go to the other at once."""
    client = stack.client()
    long = client.submit(entrypoint="e2ejobs:timed", params={"seconds": 8}, resources={"gpus": 0})
    for status in long.watch(timeout=WAIT_S, poll_s=0.1):
        if status["state"] == "running":
            break
    shorts = [client.submit(entrypoint="e2ejobs:timed", params={"seconds": 0.3},
                            resources={"gpus": 0}) for _ in range(4)]

    long_status = long.wait(timeout=WAIT_S)
    short_statuses = [s.wait(timeout=WAIT_S) for s in shorts]

    long_worker = long_status["attempts"][0]["worker"]
    for status in short_statuses:
        assert status["attempts"][0]["worker"] != long_worker
        assert status["result"]["end"] < long_status["result"]["end"], "a short job waited for the long one"
