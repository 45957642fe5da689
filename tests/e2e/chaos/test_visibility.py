"""A job that outlives Redis's visibility timeout: the message comes back to another worker,
whose claim drops it. The job runs once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kombu import Connection

from e31.edge.celeryapp import broker_transport_options
from e31.edge.settings import Settings
from tests.conftest import wait_for

from .conftest import Cluster, billed_seconds, running_cluster, trail

VISIBILITY_TIMEOUT_S = 1
JOB_S = 3 * VISIBILITY_TIMEOUT_S + 3


@pytest.fixture
def tiny_visibility(tmp_path: Path) -> Iterator[Cluster]:
    with running_cluster(tmp_path,
                         E31_VISIBILITY_TIMEOUT_S=str(VISIBILITY_TIMEOUT_S)) as cluster:
        yield cluster


def test_a_job_three_times_longer_than_the_visibility_timeout_runs_once(
        tiny_visibility: Cluster) -> None:
    cluster = tiny_visibility
    # Given a job much longer than the visibility timeout, and an idle second worker
    job = cluster.client().submit(entrypoint="chaosjobs:marked", resources={"gpus": 1},
                                  params={"trail": str(cluster.trail_dir), "seconds": JOB_S})

    cluster.running_on(job.id)
    wait_for(lambda: trail(cluster.trail_dir, job.id), timeout_s=30, what="the job to start")

    # When its message has been unacknowledged for longer than the visibility timeout and
    # Kombu's sweep hands it out again (the workers sweep every ~100 s by default; the test
    # runs the same sweep now rather than waiting for it)
    time.sleep(VISIBILITY_TIMEOUT_S + 0.5)   # the message must age past the timeout
    restored = _sweep_unacked(cluster)

    # Then the idle worker receives it again and its claim drops it
    assert restored >= 1
    logs = lambda: cluster.log("worker-ha") + cluster.log("worker-hb")  # noqa: E731
    wait_for(lambda: f"claim_skipped job={job.id}" in logs(), timeout_s=20,
             what="the redelivered message to be dropped by the claim")
    # And the job runs to its end once, with one attempt
    status = job.wait(timeout=90)
    assert [a["reason"] for a in status["attempts"]] == ["succeeded"]
    events = trail(cluster.trail_dir, job.id)
    assert [e.split()[0] for e in events] == ["start", "done"], events
    assert status["gpu_seconds"] == pytest.approx(billed_seconds(status), abs=0.01)


def _sweep_unacked(cluster: Cluster) -> int:
    """Kombu's own restore of messages unacked past the visibility timeout; returns how many
    were unacked before it ran."""
    settings = Settings(redis_url=cluster.redis.url, visibility_timeout_s=VISIBILITY_TIMEOUT_S)
    before = int(cluster.redis_client().hlen("unacked"))
    options = broker_transport_options(settings)
    with Connection(cluster.redis.url, transport_options=options) as conn:
        conn.default_channel.qos.restore_visible(num=100, interval=1)
    return before
