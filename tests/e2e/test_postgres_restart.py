"""PostgreSQL restarted under load (issue 14, item 3): a stream of jobs runs on two workers
while a private PostgreSQL cluster is restarted twice, once `-m fast` (sessions closed
cleanly) and once `-m immediate` (killed, crash recovery on start). The workers ride it out
(outcome writes and lease renewals are retried for `store_retry_max_s`), the API answers
503 while it is down and serves again by itself, and every job ends succeeded exactly once.

The cluster is the test's own (initdb in a temporary directory, a free port): the machine's
shared PostgreSQL is never restarted. About 70 s on a loaded 2-core host (40 s of it the
cluster's start), so it runs on demand with `pytest -m slow`, not in CI.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from e31.client import JobHandle
from e31.core.errors import ClientError
from tests.conftest import wait_for
from tests.e2e.chaos.conftest import Cluster, Postgres, cluster_on_postgres, trail

pytestmark = pytest.mark.slow   # a cluster of processes and a private PostgreSQL: ~70 s

LEASE_TTL_S = "10"      # longer than a restart takes on a loaded machine: no lease expires
JOB_S = 1.5             # each job's work; long enough that restarts land mid-job
SUBMIT_EVERY_S = 0.4    # the stream's pace: two workers always have a backlog
AFTER_S = 3.0           # the stream goes on this long after each restart


class RestartablePostgres(Postgres):
    def restart(self, mode: str) -> None:
        """`pg_ctl restart -m MODE` on the test's own cluster."""
        self._as_postgres(str(self._bin / "pg_ctl"), "-D", str(self.dir / "data"), "-m", mode,
                          "-w", "restart")


@pytest.fixture
def pg_cluster(tmp_path: Path) -> Iterator[tuple[Cluster, RestartablePostgres]]:
    pg = RestartablePostgres()
    with cluster_on_postgres(tmp_path, pg, E31_LEASE_TTL_S=LEASE_TTL_S) as cluster:
        yield cluster, pg


class Stream:
    """Submits a short job every SUBMIT_EVERY_S until stopped; a submit the API refuses
    with 503 (store down) is counted and not retried, so no job can be stored twice."""

    def __init__(self, cluster: Cluster) -> None:
        self.client = cluster.client()
        self.trail = str(cluster.trail_dir)
        self.accepted: list[tuple[float, JobHandle]] = []
        self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while not self._stop.wait(SUBMIT_EVERY_S):
            try:
                job = self.client.submit(entrypoint="chaosjobs:marked", resources={"gpus": 1},
                                         params={"trail": self.trail, "seconds": JOB_S})
            except ClientError as exc:
                if exc.status_code != 503 and "cannot reach" not in str(exc):
                    raise
                self.refused += 1
                continue
            self.accepted.append((time.monotonic(), job))


def _api_ok(cluster: Cluster) -> bool:
    try:
        return httpx.get(f"{cluster.url}/v1/jobs", timeout=5,
                         headers={"Authorization": f"Bearer {cluster.token}"}).status_code == 200
    except httpx.HTTPError:
        return False


def _running(cluster: Cluster, jobs: list[tuple[float, JobHandle]]) -> bool:
    started = [job for _, job in jobs if trail(cluster.trail_dir, job.id)]
    return any(len(trail(cluster.trail_dir, job.id)) == 1 for job in started)


def test_postgresql_restarted_under_load_loses_nothing_and_runs_nothing_twice(
        pg_cluster: tuple[Cluster, RestartablePostgres]) -> None:
    cluster, pg = pg_cluster
    stream = Stream(cluster)
    # Given a stream of jobs being submitted and run on two workers
    stream.start()
    restarts: list[float] = []
    try:
        for mode in ("fast", "immediate"):
            wait_for(lambda: _running(cluster, stream.accepted), timeout_s=60,
                     what="a job to be running")
            # When PostgreSQL is restarted while a job runs and submits keep coming
            pg.restart(mode)
            restarts.append(time.monotonic())
            # Then the API serves again by itself
            wait_for(lambda: _api_ok(cluster), timeout_s=60, what=f"the API after a {mode} restart")
            time.sleep(AFTER_S)                 # the stream's length is the test
    finally:
        stream.stop()

    # And the stream went on: jobs were accepted after the last restart
    assert any(t > restarts[-1] for t, _ in stream.accepted), "no submit accepted after restart"
    # And every job the API ever stored ends succeeded with exactly one attempt that ran once
    ids = {job.id for _, job in stream.accepted}
    client = cluster.client()
    for job_id in ids:
        status = client.get(job_id).wait(timeout=180)
        assert [a["reason"] for a in status["attempts"]] == ["succeeded"], status
        events = trail(cluster.trail_dir, job_id)
        assert sum(e.startswith("start") for e in events) == 1, events
    stored = {j["id"] for j in client.list(limit=1000)}
    assert stored == ids, "the store holds a job no submit was answered for, or lost one"
    # And the workers did see the store go away (the restarts landed mid-run)
    workers = cluster.log("worker-ha") + cluster.log("worker-hb")
    assert any(word in workers for word in ("outcome_write_failed", "lease_renew_failed",
                                             "claim_failed", "OperationalError")), workers[-3000:]
