"""Failover of the central processes, with real processes over a real Redis and store.

Two schedulers: SIGKILL the leader, and the standby leads within two leader-lock TTLs; every
job is published once (its `dispatch_count` in the store) and runs once. Two API processes on
two ports serve the same tenants: a job submitted through one is read, its logs read and it
is cancelled through the other. A pool with Sentinel carries on when the Redis primary dies.

Sized for a 2-core CI host: every job is a command job, so the workers run without a warm
process (which would import torch for nothing); one worker host where one shows the point.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from e31.client import Client
from e31.core import keys
from e31.edge import wiring
from e31.edge.settings import Settings
from e31.local.redisserver import find_redis_server, free_port
from e31.scheduling.leader import LEADER_TTL_TICKS
from tests.conftest import wait_for

TICK_S = 1.0
LOCK_TTL_S = TICK_S * LEADER_TTL_TICKS
JOBS = 4

pytestmark = pytest.mark.slow   # two schedulers, two APIs, Sentinel: on demand (-m slow)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One API, one scheduler and a worker (`ha`, one GPU) over SQLite and a private Redis,
    for both tests (the API test first: the scheduler test kills the first scheduler)."""
    from tests.e2e.chaos.conftest import make_cluster

    c = make_cluster(tmp_path_factory.mktemp("failover") / "home",
                     E31_SCHEDULER_TICK_S=str(TICK_S), E31_WARM_START="false")
    try:
        c.start(hosts=("ha",))
        yield c
    finally:
        c.stop()


def _leader(cluster: Any) -> bytes | None:
    value = cluster.redis_client().get(keys.LEADER)
    return value if isinstance(value, bytes) else None


def test_two_api_processes_serve_the_same_tenants_a_job_is_followed_through_either(
        cluster: Any) -> None:
    # Given two API processes on two ports over the same store and Redis
    port_b = free_port()
    cluster.spawn("api-b", "api", env=dict(cluster.env, E31_API_PORT=str(port_b)))
    try:
        one, other = cluster.client(), Client(f"http://127.0.0.1:{port_b}", cluster.token)
        wait_for(lambda: _answers(other), timeout_s=60, what="the second API to answer")

        # When a job is submitted through one
        job = one.submit(command=["sh", "-c", "echo started; sleep 60"], resources={"gpus": 1})

        # Then the other reads it, its logs, and cancels it; and the first sees the cancel
        seen = other.get(job.id)
        wait_for(lambda: seen.status()["state"] == "running", timeout_s=60,
                 what="the job to run")
        wait_for(lambda: "started" in seen.logs(), timeout_s=30, what="its log through B")
        seen.cancel()
        wait_for(lambda: one.get(job.id).status()["state"] == "cancelled", timeout_s=60,
                 what="A to see the cancel")
        assert [j["id"] for j in other.list()] == [j["id"] for j in one.list()]
        assert job.id in [j["id"] for j in other.list()]
    finally:
        _stop(cluster, "api-b")


def test_the_standby_scheduler_leads_within_two_lock_ttls_and_nothing_is_published_twice(
        cluster: Any) -> None:
    # Given a leading scheduler, a standby, and a worker
    first = wait_for(lambda: _leader(cluster), timeout_s=30, what="a leader")
    standby = cluster.spawn("scheduler-b", "scheduler")
    try:
        wait_for(lambda: "scheduler_standby" in cluster.log("scheduler-b"), timeout_s=60,
                 what="the second scheduler to stand by")
        client = cluster.client()
        jobs = [client.submit(command=["sh", "-c", "sleep 0.3"], resources={"gpus": 1},
                              retries={"max": 0}) for _ in range(JOBS)]
        wait_for(lambda: client.get(jobs[0].id).status()["state"] == "succeeded",
                 timeout_s=60, what="the first job to succeed")

        # When the leader is killed outright, with jobs still to publish
        os.killpg(cluster.procs["scheduler"].pid, signal.SIGKILL)
        cluster.procs["scheduler"].wait()
        killed_at = time.monotonic()
        took_over = wait_for(lambda: (v := _leader(cluster)) is not None and v != first,
                             timeout_s=30, poll_s=0.05, what="the standby to lead")
        elapsed = time.monotonic() - killed_at

        # Then the standby leads within two TTLs of the lock, and every job runs once,
        # published once
        assert took_over and standby.poll() is None
        assert elapsed <= 2 * LOCK_TTL_S, f"took {elapsed:.1f} s; the lock's TTL is {LOCK_TTL_S}"
        for job in jobs:
            status = job.wait(timeout=90)
            assert status["state"] == "succeeded" and len(status["attempts"]) == 1, status
        with sqlite3.connect(cluster.home / "e31.db") as db:
            counts = dict(db.execute("SELECT id, dispatch_count FROM jobs").fetchall())
        assert {j.id: counts[j.id] for j in jobs} == {j.id: 1 for j in jobs}
        assert "scheduler_leading" in cluster.log("scheduler-b")
    finally:
        _stop(cluster, "scheduler-b")


def _stop(cluster: Any, name: str) -> None:
    """Stop a process the test itself started (the fixture stops its own)."""
    proc = cluster.procs.pop(name)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def _answers(client: Client) -> bool:
    try:
        client.list()
    except Exception:  # noqa: BLE001 - not up yet, whatever the error
        return False
    return True


# -- Redis with Sentinel --------------------------------------------------------------------

MASTER = "e31"


class SentinelRedis:
    """A primary, a replica and three sentinels (`redis-server --sentinel`), all real
    processes on free ports; the sentinels judge the primary down after 1 s."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.primary_port, self.replica_port = free_port(), free_port()
        self.sentinel_ports = [free_port() for _ in range(3)]

    @property
    def url(self) -> str:
        return ";".join(f"sentinel://127.0.0.1:{p}" for p in self.sentinel_ports) + "/0"

    def _start(self, name: str, *argv: str) -> None:
        (self.root / name).mkdir(parents=True, exist_ok=True)
        out = open(self.root / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen([find_redis_server(), *argv], stdout=out,
                                            stderr=subprocess.STDOUT, cwd=self.root / name)
        out.close()

    def start(self) -> None:
        common = ("--bind", "127.0.0.1", "--save", "", "--appendonly", "no")
        self._start("primary", "--port", str(self.primary_port), *common)
        self._start("replica", "--port", str(self.replica_port), *common,
                    "--replicaof", "127.0.0.1", str(self.primary_port))
        for i, port in enumerate(self.sentinel_ports):
            conf = self.root / f"sentinel{i}.conf"
            conf.write_text(f"port {port}\nbind 127.0.0.1\n"
                            f"sentinel monitor {MASTER} 127.0.0.1 {self.primary_port} 2\n"
                            f"sentinel down-after-milliseconds {MASTER} 1000\n"
                            f"sentinel failover-timeout {MASTER} 5000\n")
            self._start(f"sentinel{i}", str(conf), "--sentinel")
        wait_for(lambda: self._replicas_known() >= 1, timeout_s=30,
                 what="the sentinels to know the replica")

    def _sentinel(self) -> redis.Redis:
        return redis.Redis(port=self.sentinel_ports[0], socket_timeout=2)

    def _replicas_known(self) -> int:
        try:
            return len(self._sentinel().sentinel_slaves(MASTER))
        except redis.RedisError:
            return 0

    def primary(self) -> int | None:
        try:
            return int(self._sentinel().sentinel_get_master_addr_by_name(MASTER)[1])
        except (redis.RedisError, TypeError):
            return None

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_with_sentinel_the_pool_carries_on_when_the_redis_primary_dies_and_no_job_is_lost(
        tmp_path: Path) -> None:
    from tests.e2e.chaos.conftest import make_cluster

    sentinel = SentinelRedis(tmp_path / "redis")
    # its own Redis is left unused and stopped; command jobs only: no warm process
    cluster = make_cluster(tmp_path / "home", E31_WARM_START="false")
    try:
        sentinel.start()
        cluster.redis.kill()
        cluster.env.update(E31_REDIS_URL=sentinel.url, E31_REDIS_MASTER_NAME=MASTER)
        settings = Settings(redis_url=sentinel.url, redis_master_name=MASTER)
        cluster.redis_client = lambda: wiring.redis_client(settings, socket_timeout_s=5)
        # Given a pool whose processes know only the sentinels (one worker: when the primary
        # dies, one job runs and the others wait in the queue)
        cluster.start(hosts=("ha",))
        client = cluster.client()
        first = [client.submit(command=["sh", "-c", "sleep 1"], resources={"gpus": 1},
                               retries={"max": 0}) for _ in range(3)]
        wait_for(lambda: client.get(first[0].id).status()["state"] == "succeeded",
                 timeout_s=90, what="the first job to succeed")

        # When the primary dies mid-run
        sentinel.procs["primary"].kill()
        sentinel.procs["primary"].wait()
        wait_for(lambda: sentinel.primary() == sentinel.replica_port, timeout_s=60,
                 what="the sentinels to promote the replica")
        more = [client.submit(command=["sh", "-c", "sleep 0.5"], resources={"gpus": 1},
                              retries={"max": 0}) for _ in range(2)]

        # Then every job, before and after, succeeds, and runs once
        for job in first + more:
            status = job.wait(timeout=120)
            assert status["state"] == "succeeded", status
            assert len(status["attempts"]) == 1, status
    finally:
        cluster.stop()
        sentinel.stop()
