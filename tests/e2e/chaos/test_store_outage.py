"""The store stops for less than a lease TTL: jobs keep running, nothing lost or repeated,
the API answers 503 meanwhile and recovers by itself."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import wait_for

from .conftest import Cluster, Postgres, billed_seconds, cluster_on_postgres, trail

OUTAGE_S = 3.0            # the store is down this long, well inside the TTL below
LEASE_TTL_S = "8"


@pytest.fixture
def pg_cluster(tmp_path: Path) -> Iterator[tuple[Cluster, Postgres]]:
    pg = Postgres()
    with cluster_on_postgres(tmp_path, pg, E31_LEASE_TTL_S=LEASE_TTL_S) as cluster:
        yield cluster, pg


def _api(cluster: Cluster) -> httpx.Response:
    return httpx.get(f"{cluster.url}/v1/jobs", timeout=10,
                     headers={"Authorization": f"Bearer {cluster.token}"})


def test_postgresql_stopped_for_less_than_a_ttl_loses_nothing_and_repeats_nothing(
        pg_cluster: tuple[Cluster, Postgres]) -> None:
    cluster, pg = pg_cluster
    client = cluster.client()
    # Given one job that runs across the outage and one that ends in the middle of it
    long = client.submit(entrypoint="chaosjobs:marked", resources={"gpus": 1},
                         params={"trail": str(cluster.trail_dir), "seconds": 8})
    short = client.submit(entrypoint="chaosjobs:marked", resources={"gpus": 1},
                          params={"trail": str(cluster.trail_dir), "seconds": 2.5})
    wait_for(lambda: trail(cluster.trail_dir, long.id) and trail(cluster.trail_dir, short.id),
             timeout_s=30, what="both jobs to start")

    # When PostgreSQL stops for a few seconds, while the owner reads the job's status
    pg.stop()
    stopped = time.monotonic()
    down = _api(cluster)
    read: list[dict] = []
    reader = threading.Thread(target=lambda: read.append(client.get(long.id).status()))
    reader.start()
    time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - stopped)))  # the outage's length is the test
    pg.start()

    # Then the API said so while it was down, and answers again by itself
    assert down.status_code == 503, down.text
    assert down.json()["error"] == "store_unavailable"
    wait_for(lambda: _api(cluster).status_code == 200, timeout_s=30, what="the API to recover")
    # and the client's read rode out the 503s instead of failing
    reader.join(timeout=60)
    assert read and read[0]["id"] == long.id
    # And both jobs succeed with their one attempt: nothing lost, nothing run twice
    for job in (long, short):
        status = job.wait(timeout=90)
        assert [a["reason"] for a in status["attempts"]] == ["succeeded"], status["attempts"]
        events = trail(cluster.trail_dir, job.id)
        assert sum(e.startswith("start") for e in events) == 1, events
        assert status["gpu_seconds"] == pytest.approx(billed_seconds(status), abs=0.01)
    workers = cluster.log("worker-ha") + cluster.log("worker-hb")
    assert "outcome_write_failed" in workers or "lease_renew_failed" in workers
