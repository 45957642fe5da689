"""Gangs on demand on real worker processes (issue 15, docs/scheduling.md "Gangs on demand"):
two simulated nodes, one of 8 × 80 GB and one of 4 × 48 GB, each running `e31 worker
--no-spill` (the default layout: one gang worker per GPU, no fixed group layout; each class
on its own node). Jobs of 1, 2, 4 and 8 GPUs all run, each seeing exactly its GPUs, no GPU
ever held by two jobs at once, and an 8-GPU job that waited behind one-GPU jobs gets the
whole node before any later one-GPU job."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import combinations
from pathlib import Path
from typing import Any

import pytest

from e31.client import JobHandle
from e31.core.errors import ClientError
from tests.conftest import wait_for

from .chaos.conftest import Cluster, make_cluster

WAIT_S = 180


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Cluster]:
    cluster = make_cluster(tmp_path / "home", E31_WARM_START="false", E31_RESERVE_AFTER_S="1",
                           E31_HEARTBEAT_INTERVAL_S="0.5")
    try:
        cluster.start(hosts=())
        for host, gpus in (("ha", "8x80"), ("hb", "4x48")):
            cluster.spawn(f"worker-{host}", "worker", "--no-spill",
                          "--simulate-gpus", gpus, "--hostname", host, "--loglevel", "INFO")
        for host, n in (("ha", 8), ("hb", 4)):
            for i in range(n):
                wait_for(lambda node=f"gpu{i}@{host}": cluster.redis_client().get(
                    f"e31:worker:{node}"), timeout_s=WAIT_S, what=f"gpu{i}@{host} to beat",
                    evidence=lambda h=host: cluster.log(f"worker-{h}")[-3000:])
        yield cluster
    finally:
        cluster.stop()


def submit(cluster: Cluster, gpus: int, size_class: str, seconds: float) -> JobHandle:
    return cluster.client().submit(entrypoint="e2ejobs:gpu_window", params={"seconds": seconds},
                                   resources={"gpus": gpus, "size_class": size_class},
                                   name=f"g{gpus}-{size_class}")


def test_jobs_of_one_to_eight_gpus_share_no_gpu_and_the_big_one_is_not_backfilled(
        pool: Cluster) -> None:
    # Given the 80 GB node filled by eight one-GPU jobs, then an 8-GPU job, then four more
    # one-GPU jobs; and 1-, 2- and 4-GPU jobs on the 48 GB node meanwhile
    first = [submit(pool, 1, "gpu80", 4) for _ in range(8)]
    wait_for(lambda: all(j.status()["state"] != "queued" for j in first), timeout_s=WAIT_S,
             what="the eight one-GPU jobs to start")
    big = submit(pool, 8, "gpu80", 2)
    later = [submit(pool, 1, "gpu80", 2) for _ in range(4)]
    small = [submit(pool, g, "gpu48", 2) for g in (2, 1, 4, 1, 2)]

    # When they all end
    jobs = [*first, big, *later, *small]
    done = {j.id: j.wait(timeout=WAIT_S) for j in jobs}

    # Then every job succeeded on a node of its class, seeing exactly as many GPUs as it asked
    runs: list[dict[str, Any]] = []
    for job in jobs:
        status = done[job.id]
        assert status["state"] == "succeeded", status
        [attempt] = status["attempts"]
        host = attempt["worker"].rpartition("@")[2]
        seen = status["result"]["cuda_visible_devices"].split(",")
        assert len(seen) == status["gpus"] and len(set(seen)) == len(seen), status
        assert attempt["gpus"] == status["result"]["cuda_visible_devices"]
        assert host == ("ha" if status["size_class"] == "gpu80" else "hb")
        runs.append({"id": job.id, "host": host, "gpus": set(seen), **status["result"]})
    # And no two jobs on one node held one GPU at the same time
    for a, b in combinations(runs, 2):
        if a["host"] == b["host"] and a["start"] < b["end"] and b["start"] < a["end"]:
            assert not a["gpus"] & b["gpus"], (a, b)
    # And the 8-GPU job had the whole node before any one-GPU job submitted after it started
    big_run = next(r for r in runs if r["id"] == big.id)
    assert big_run["gpus"] == {str(i) for i in range(8)}
    assert all(r["start"] >= big_run["end"] - 0.05 for r in runs
               if r["id"] in {j.id for j in later}), (big_run, runs)

    # And a shape no node has (8 × gpu48: the 48 GB node has 4) is refused, naming it
    with pytest.raises(ClientError, match="no node with 8 × gpu48"):
        submit(pool, 8, "gpu48", 1)
