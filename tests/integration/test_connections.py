"""A worker node holds a bounded number of PostgreSQL connections, however busy it is.

Real PostgreSQL (E31_TEST_DATABASE_URL), a real Redis, API and scheduler, and one `e31 worker`
launcher with two simulated GPUs (two worker processes) running two checkpointing jobs at
once: each job's attempt claims, renews its lease, uploads checkpoints and records its outcome
while the heartbeat threads beat. Every connection of the node's processes is counted in
`pg_stat_activity` by its application name (`e31 worker <node>`, which each worker process
sets), sampled while the jobs run. The node's bound is the sum of its processes' (checked
per process too), so two show it as well as four did; the warm start is off (jobs start cold):
it adds no connection to the store, and on a 2-core CI host a warm process per worker process,
each importing torch, cost most of the test's time.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from e31.edge.settings import Settings
from e31.store.db import WORKER_MAX_OVERFLOW, WORKER_POOL_SIZE
from tests.conftest import fresh_postgres_database, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.slow]   # a node of workers: on demand

GPUS = 2
HOST = "hconn"


@pytest.fixture
def postgres_url() -> Iterator[str]:
    with fresh_postgres_database() as url:
        yield url


def _sample(url: str, stop: threading.Event, seen: list[Counter[str]]) -> None:
    """Connections to the test's database by application name, every 0.1 s until `stop`."""
    engine = create_engine(Settings(database_url=url).resolved_database_url)
    name = url.rsplit("/", 1)[1]
    try:
        with engine.connect() as conn:
            while not stop.is_set():
                rows = conn.execute(text(
                    "SELECT application_name, count(*) FROM pg_stat_activity "
                    "WHERE datname = :db GROUP BY application_name"), {"db": name}).all()
                conn.commit()
                seen.append(Counter({str(r[0]): int(r[1]) for r in rows}))
                stop.wait(0.1)
    finally:
        engine.dispose()


def test_a_busy_worker_node_holds_at_most_its_bound_of_connections(
        postgres_url: str, tmp_path: Path) -> None:
    from tests.e2e.chaos.conftest import make_cluster
    from tests.e2e.chaos.test_drain import _steps_of_attempt

    cluster = make_cluster(tmp_path / "home", database_url=postgres_url,
                           E31_WARM_START="false")
    seen: list[Counter[str]] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample, args=(postgres_url, stop, seen), daemon=True)
    try:
        cluster.start(hosts=())
        cluster.spawn(f"worker-{HOST}", "worker", "--simulate-gpus", f"{GPUS}x24",
                      "--hostname", HOST, "--loglevel", "INFO")
        for gpu in range(GPUS):
            wait_for(lambda g=gpu: cluster.redis_client().get(f"e31:worker:gpu{g}@{HOST}"),
                     timeout_s=60, what=f"gpu{gpu}@{HOST} to beat")
        sampler.start()

        # Given two jobs running at once on the node's two worker processes
        jobs = [cluster.client().submit(entrypoint="chaosjobs:checkpointed",
                                        resources={"gpus": 1}, retries={"max": 0},
                                        params={"trail": str(cluster.trail_dir), "steps": 6,
                                                "step_s": 0.5})
                for _ in range(GPUS)]
        wait_for(lambda: all(len(_steps_of_attempt(cluster, j.id, 1)) >= 2 for j in jobs),
                 timeout_s=60, what="every job two steps in")
        for job in jobs:
            assert job.wait(timeout=90)["state"] == "succeeded"
    finally:
        stop.set()
        if sampler.is_alive():
            sampler.join(timeout=10)
        cluster.stop()

    # Then no sample ever saw more connections from the node than its bound
    node = [sum(n for app, n in s.items() if app.startswith("e31 worker ") and
                app.endswith(f"@{HOST}")) for s in seen]
    per_process = Counter(app for s in seen for app in s if app.endswith(f"@{HOST}"))
    assert len(seen) > 20 and max(node) > 0, seen[-3:]
    assert set(per_process) == {f"e31 worker gpu{g}@{HOST}" for g in range(GPUS)}, per_process
    assert max(node) <= GPUS * (WORKER_POOL_SIZE + WORKER_MAX_OVERFLOW), max(node)
