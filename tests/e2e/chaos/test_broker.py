"""Redis restarted empty, or flushed, while jobs run and wait: nothing lost, nothing twice."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from e31.client import JobHandle
from tests.conftest import wait_for

from .conftest import Cluster, billed_seconds, trail

WAIT_S = 120
JOBS = 4


def _submit(cluster: Cluster) -> list[JobHandle]:
    client = cluster.client()
    return [client.submit(entrypoint="chaosjobs:marked", resources={"gpus": 1},
                          params={"trail": str(cluster.trail_dir), "seconds": 2},
                          retries={"max": 0})
            for _ in range(JOBS)]


def _every_job_succeeded_once(cluster: Cluster, jobs: list[JobHandle]) -> None:
    for job in jobs:
        status = job.wait(timeout=WAIT_S)
        events = trail(cluster.trail_dir, job.id)
        assert [a["reason"] for a in status["attempts"]] == ["succeeded"], status["attempts"]
        assert sum(e.startswith("start") for e in events) == 1, events
        assert sum(e.startswith("done") for e in events) == 1, events
        assert status["gpu_seconds"] == pytest.approx(billed_seconds(status), abs=0.01)


def _restart(cluster: Cluster) -> None:
    cluster.redis.kill()       # SIGKILL: nothing saved, every message and heartbeat is gone
    cluster.redis.start()


def _flush(cluster: Cluster) -> None:
    cluster.redis_client().flushall()


@pytest.mark.parametrize("lose_everything", [_restart, _flush], ids=["restart", "flushall"])
def test_losing_every_message_mid_run_loses_no_job_and_runs_none_twice(
        cluster: Cluster, lose_everything: Callable[[Cluster], None]) -> None:
    # Given four jobs on two workers: two running, two published or waiting
    jobs = _submit(cluster)
    wait_for(lambda: sum(bool(trail(cluster.trail_dir, j.id)) for j in jobs) >= 2, timeout_s=30,
             what="two jobs to start")

    # When Redis loses everything it held
    lose_everything(cluster)

    # Then every job still succeeds, once, with one attempt
    _every_job_succeeded_once(cluster, jobs)
    assert "broker_reset" in cluster.log("scheduler")
