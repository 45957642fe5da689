"""A worker cut off from Redis and the store: it runs in its own network namespace, joined
to the rest by a veth pair on private addresses of this machine only, and the test pulls
the cable (the host end goes down, packets vanish without an error). Its job is recovered
elsewhere, and when the link returns, the cut-off worker's late outcome write is refused
by the fence."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e31.store.attempts import AttemptFacts
from tests.conftest import wait_for

from .conftest import Cluster, Postgres, make_cluster, trail

LEASE_TTL_S = "6"
JOB_S = 2.0               # ends while the link is cut, well inside the TTL


class Netns:
    """A network namespace with a veth pair: host end HOST_IP, namespace end NS_IP."""

    def __init__(self) -> None:
        tag = os.getpid() % 250 + 1
        self.name = f"e31-cut-{tag}"
        self.host_if, self.ns_if = f"e31h{tag}", f"e31n{tag}"
        self.host_ip, self.ns_ip = f"10.231.{tag}.1", f"10.231.{tag}.2"

    @staticmethod
    def unavailable() -> str | None:
        if os.geteuid() != 0 or not shutil.which("ip"):
            return "needs root and iproute2's `ip` for a network namespace"
        return None

    def _ip(self, *args: str, inside: bool = False) -> None:
        argv = ["ip", "netns", "exec", self.name, "ip", *args] if inside else ["ip", *args]
        subprocess.run(argv, check=True, capture_output=True, timeout=30)

    def create(self) -> None:
        self.destroy()
        self._ip("netns", "add", self.name)
        self._ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        self._ip("link", "set", self.ns_if, "netns", self.name)
        self._ip("addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
        self._ip("link", "set", self.host_if, "up")
        self._ip("addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if, inside=True)
        self._ip("link", "set", self.ns_if, "up", inside=True)
        self._ip("link", "set", "lo", "up", inside=True)

    def cut(self) -> None:
        self._ip("link", "set", self.host_if, "down")

    def restore(self) -> None:
        self._ip("link", "set", self.host_if, "up")

    def destroy(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)


@pytest.fixture
def partitioned(tmp_path: Path) -> Iterator[tuple[Cluster, Netns]]:
    why = Netns.unavailable() or Postgres.available()
    if why:
        pytest.skip(why)
    net = Netns()
    try:
        net.create()
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create a network namespace here: {exc.stderr.decode().strip()}")
    pg = Postgres(extra_listen=net.host_ip)
    cluster: Cluster | None = None
    try:
        pg.init()
        cluster = make_cluster(tmp_path, database_url=pg.url, redis_extra_bind=net.host_ip,
                               E31_LEASE_TTL_S=LEASE_TTL_S)
        cluster.start(hosts=("hb",))
        yield cluster, net
    finally:
        if cluster is not None:
            net.restore()
            cluster.stop()
        pg.destroy()
        net.destroy()


def test_a_cut_off_workers_job_is_recovered_elsewhere_and_its_late_write_is_fenced(
        partitioned: tuple[Cluster, Netns]) -> None:
    cluster, net = partitioned
    # Given worker `hc` in its own network namespace, reaching Redis and PostgreSQL over the veth
    database_url = cluster.env["E31_DATABASE_URL"]
    remote = dict(cluster.env,
                  E31_REDIS_URL=cluster.redis.url.replace("127.0.0.1", net.host_ip),
                  E31_DATABASE_URL=database_url.replace("127.0.0.1", net.host_ip))
    cluster.start_worker("hc", prefix=("ip", "netns", "exec", net.name), env=remote)
    cluster.wait_worker("hc")
    # and a job running there (hb is paused until then, so hc takes it)
    other = cluster.heartbeat("hb")
    assert other is not None
    os.kill(other["pid"], signal.SIGSTOP)
    try:
        wait_for(lambda: cluster.heartbeat("hb") is None, timeout_s=10, what="hb to look away")
        job = cluster.client().submit(entrypoint="chaosjobs:marked", resources={"gpus": 1},
                                      params={"trail": str(cluster.trail_dir), "seconds": JOB_S})
        assert cluster.running_on(job.id) == "hc"
        wait_for(lambda: trail(cluster.trail_dir, job.id), timeout_s=30, what="the job to start")
    finally:
        os.kill(other["pid"], signal.SIGCONT)

    # When the link to hc is cut, and comes back only after the job was settled elsewhere
    net.cut()
    status = job.wait(timeout=120)
    net.restore()

    # Then the job was recovered on hb and succeeded there, once in the store
    assert [a["reason"] for a in status["attempts"]] == ["lost", "succeeded"], status["attempts"]
    assert status["attempts"][0]["worker"] == "gpu0@hc"
    assert status["attempts"][1]["worker"] == "gpu0@hb"
    assert status["result"] == {"attempt": 2}
    # And hc's outcome write, retried through the cut, is refused by the fence when it lands
    wait_for(lambda: f"outcome_fenced job={job.id}" in cluster.log("worker-hc"), timeout_s=60,
             what="hc's late write to be refused")
    # (what the attempts recorded as their outcome is unchanged; how the cut-off attempt ran —
    # isolation, start, GPU use — is its own row's note, not fenced, and may land only now)
    assert _outcomes(cluster.client().get(job.id).status()) == _outcomes(status)


def _outcomes(status: dict[str, Any]) -> list[dict[str, Any]]:
    noted = set(AttemptFacts.__dataclass_fields__)
    return [{k: v for k, v in a.items() if k not in noted} for a in status["attempts"]]
