"""Many machines on one: hosts as network namespaces on a bridge (tests/e2e/netns.py).

- `control`: a private PostgreSQL (initdb into a temporary directory, listening on this
  host's address only: never the machine's shared PostgreSQL), Redis with Sentinel (a
  primary, a replica, three `redis-server --sentinel`), the S3 server (`moto_server`), the
  API and two schedulers (one leads, one stands by).
- `gpu-a` (`--simulate-gpus 2x80`) and `gpu-b` (`2x24`): `e31 worker`, joined with only the
  settings docs/operations.md "Add a GPU node" names, and the pool's config file.
- `client`: submits a mix of jobs over the API's address with a tenant's token, waits for
  them, and downloads the outputs the GPU hosts wrote to S3, through the API.

The story: the first wave runs on both GPU hosts; `gpu-b` is cut off (its veth down) while
it runs jobs, and the leading scheduler is killed at once, so the standby recovers the
lost leases (the jobs finish on `gpu-a`); the cable comes back, `gpu-b`'s late outcome
writes are refused by the fence; the Redis primary is killed, Sentinel promotes the
replica, and a second wave runs on the pool. In the store, every job succeeded exactly once.

Root only (network namespaces); skips with the reason elsewhere. Run it alone with
`python -m pytest -m multihost tests/e2e/test_multihost.py` (docs/operations.md).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import redis

from e31.core import keys
from e31.edge import wiring
from e31.edge.settings import Settings
from e31.local.redisserver import find_redis_server
from tests.conftest import stop_process_groups, wait_for

from .netns import NetnsUnavailable, Network

pytestmark = pytest.mark.multihost

# Ports: each host has its own, so they are fixed.
PG_PORT, API_PORT, S3_PORT = 5432, 8031, 5000
PRIMARY_PORT, REPLICA_PORT = 6379, 6380
SENTINEL_PORTS = (26379, 26380, 26381)
MASTER = "e31-pool"     # not the default name: the node must be told (E31_REDIS_MASTER_NAME)
BUCKET = "e31-artifacts"
S3_KEY, S3_SECRET = "e31-node", "e31-node-secret"
# The pool's config file, the same on every host ("Add a GPU node": settings the pool must
# agree on come from one file). Short timings so that recovery is quick to watch.
POOL_CONFIG = """\
heartbeat_interval_s = 0.5
lease_ttl_s = 5.0        # a cut-off job of JOB_CUT_S ends well inside it, as it would
scheduler_tick_s = 1.0   # the leader's lock lives 3 ticks: a busy host's tick can be late
dispatch_timeout_s = 5.0
kill_grace_s = 3.0
warm_start = false       # command jobs only: no warm process importing torch for nothing
"""
LEADER_TTL_S = 1.0 * 3   # scheduler_tick_s × LEADER_TTL_TICKS
READY_S = 120.0
JOB_CUT_S = 2            # the gpu24 jobs of the first wave: they end while gpu-b is cut off
JOB_WAIT_S = 180.0

# What the client host runs: `submit SPECS_JSON` prints the job ids; `fetch IDS_JSON DIR`
# waits for each job and downloads its outputs into DIR/<id>, printing each final state and
# the downloaded files' contents. E31_URL and E31_TOKEN say where and who.
CLIENT_PY = """\
import json, sys
from pathlib import Path
from e31 import Client, JobFailed
client = Client()
if sys.argv[1] == "submit":
    print(json.dumps([client.submit(**spec).id for spec in json.loads(sys.argv[2])]))
else:
    seen = {}
    for job_id in json.loads(sys.argv[2]):
        job = client.get(job_id)
        try:
            state = job.wait(timeout=float(sys.argv[4]))["state"]
        except JobFailed as exc:
            state = "failed: " + str(exc)
        files = job.download(Path(sys.argv[3]) / job_id) if state == "succeeded" else []
        seen[job_id] = {"state": state, "files": {p.name: p.read_text() for p in files}}
    print(json.dumps(seen))
"""


def _job(n: int, gpu_mem_gb: int, seconds: float) -> dict[str, Any]:
    """A command job that works `seconds`, then writes out.txt naming itself."""
    return {"name": f"mh-{n}", "resources": {"gpus": 1, "gpu_mem_gb": gpu_mem_gb},
            "command": ["sh", "-c", f'sleep {seconds}; echo "job {n}" > "$E31_OUTPUT_DIR/out.txt"'],
            "retries": {"max": 2, "backoff_s": 0.5}}


@dataclass
class Pool:
    net: Network
    root: Path
    pg_dir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    token: str = ""

    @property
    def control(self) -> str:
        return self.net.addresses["control"]

    @property
    def database_url(self) -> str:
        return f"postgresql://postgres@{self.control}:{PG_PORT}/postgres"

    @property
    def redis_url(self) -> str:
        return ";".join(f"sentinel://{self.control}:{p}" for p in SENTINEL_PORTS) + "/0"

    @property
    def api_url(self) -> str:
        return f"http://{self.control}:{API_PORT}"

    def node_env(self, home: Path) -> dict[str, str]:
        """A GPU host's environment: exactly what "Add a GPU node" lists, and its home."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("E31_", "AWS_"))}
        env.update(E31_REDIS_URL=self.redis_url, E31_REDIS_MASTER_NAME=MASTER,
                   E31_DATABASE_URL=self.database_url,
                   E31_ARTIFACTS_URL=f"s3://{BUCKET}/pool",
                   E31_S3_ENDPOINT_URL=f"http://{self.control}:{S3_PORT}",
                   E31_S3_ACCESS_KEY_ID=S3_KEY, E31_S3_SECRET_ACCESS_KEY=S3_SECRET,
                   E31_CONFIG=str(self.root / "e31.toml"), E31_HOME=str(home))
        return env

    @property
    def control_env(self) -> dict[str, str]:
        return dict(self.node_env(self.root / "control-home"), E31_API_HOST=self.control,
                    E31_API_PORT=str(API_PORT))

    @property
    def client_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("E31_", "AWS_"))}
        env.update(E31_URL=self.api_url, E31_TOKEN=self.token,
                   E31_HOME=str(self.root / "client-home"))
        return env

    # -- processes ---------------------------------------------------------------------

    def spawn(self, name: str, host: str, argv: list[str], env: dict[str, str]) -> None:
        (self.root / "logs").mkdir(exist_ok=True)
        self.procs[name] = self.net.popen(host, argv, env=env,
                                          log=self.root / "logs" / f"{name}.log",
                                          cwd=self.root)

    def e31(self, name: str, host: str, *args: str, env: dict[str, str]) -> None:
        self.spawn(name, host, [sys.executable, "-m", "e31.cli", *args], env)

    def run_e31(self, host: str, *args: str) -> str:
        done = self.net.run(host, [sys.executable, "-m", "e31.cli", *args],
                            env=self.control_env)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def log(self, name: str) -> str:
        path = self.root / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def leads(self, name: str) -> bool:
        """Whether scheduler `name` said last that it leads (the lock may change hands on
        a busy host before the test kills the leader)."""
        text = self.log(name)
        return text.rfind("scheduler_leading") > text.rfind("scheduler_standby")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)

    def client(self, *args: str, timeout_s: float = 300) -> Any:
        script = self.root / "client.py"
        script.write_text(CLIENT_PY)
        done = self.net.run("client", [sys.executable, str(script), *args],
                            env=self.client_env, timeout_s=timeout_s)
        assert done.returncode == 0, done.stdout + done.stderr
        return json.loads(done.stdout)

    # -- the control host's services ---------------------------------------------------

    def start_postgres(self) -> None:
        bindir = Path("/usr/lib/postgresql/15/bin")
        if not (bindir / "initdb").exists():
            bindir = Path(shutil.which("initdb") or "/usr/bin/initdb").parent
        shutil.chown(self.pg_dir, "postgres")
        data = self.pg_dir / "data"

        def as_postgres(*argv: str) -> None:
            done = self.net.run("control", ["runuser", "-u", "postgres", "--", *argv])
            assert done.returncode == 0, done.stdout + done.stderr

        as_postgres(str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres",
                    "--no-sync")
        with open(data / "pg_hba.conf", "a") as hba:
            hba.write(f"host all all {self.net.subnet}.0/24 trust\n")
        as_postgres(str(bindir / "pg_ctl"), "-D", str(data), "-w", "-l",
                    str(self.pg_dir / "pg.log"), "-o",
                    f"-p {PG_PORT} -k {self.pg_dir} -c listen_addresses={self.control} "
                    "-c fsync=off -c synchronous_commit=off -c full_page_writes=off", "start")

    def stop_postgres(self) -> None:
        bindir = Path("/usr/lib/postgresql/15/bin")
        if not (bindir / "pg_ctl").exists():
            bindir = Path(shutil.which("pg_ctl") or "/usr/bin/pg_ctl").parent
        if (self.pg_dir / "data" / "postmaster.pid").exists():
            subprocess.run(["runuser", "-u", "postgres", "--", str(bindir / "pg_ctl"), "-D",
                            str(self.pg_dir / "data"), "-m", "immediate", "-w", "stop"],
                           capture_output=True, timeout=60)

    def start_redis(self) -> None:
        server = find_redis_server()
        common = ["--bind", self.control, "--protected-mode", "no", "--save", "",
                  "--appendonly", "no"]
        for name, port, extra in (("redis-primary", PRIMARY_PORT, []),
                                  ("redis-replica", REPLICA_PORT,
                                   ["--replicaof", self.control, str(PRIMARY_PORT)])):
            (self.root / name).mkdir()
            self.spawn(name, "control", [server, "--port", str(port), "--dir",
                                         str(self.root / name), *common, *extra], os.environ.copy())
        for i, port in enumerate(SENTINEL_PORTS):
            conf = self.root / f"sentinel{i}.conf"
            conf.write_text(f"port {port}\nbind {self.control}\nprotected-mode no\n"
                            f"sentinel monitor {MASTER} {self.control} {PRIMARY_PORT} 2\n"
                            f"sentinel down-after-milliseconds {MASTER} 1000\n"
                            f"sentinel failover-timeout {MASTER} 5000\n")
            self.spawn(f"sentinel{i}", "control", [server, str(conf), "--sentinel"],
                       os.environ.copy())
        wait_for(lambda: self._replicas_known() >= 1, timeout_s=READY_S,
                 what="the sentinels to know the replica")

    def sentinel(self) -> redis.Redis:
        return redis.Redis(host=self.control, port=SENTINEL_PORTS[0], socket_timeout=2)

    def _replicas_known(self) -> int:
        try:
            return len(self.sentinel().sentinel_slaves(MASTER))
        except redis.RedisError:
            return 0

    def primary_port(self) -> int | None:
        try:
            address: Any = self.sentinel().sentinel_get_master_addr_by_name(MASTER)
            return int(address[1])
        except (redis.RedisError, TypeError):
            return None

    def redis(self) -> redis.Redis:
        """The pool's Redis as its processes find it: through the sentinels."""
        settings = Settings(redis_url=self.redis_url, redis_master_name=MASTER)
        return wiring.redis_client(settings, socket_timeout_s=3)

    def start_s3(self) -> None:
        self.spawn("s3", "control", [str(Path(sys.executable).parent / "moto_server"), "-H",
                                     self.control, "-p", str(S3_PORT)], os.environ.copy())
        import boto3

        s3 = boto3.client("s3", endpoint_url=f"http://{self.control}:{S3_PORT}",
                          aws_access_key_id=S3_KEY, aws_secret_access_key=S3_SECRET,
                          region_name="us-east-1")

        def bucket() -> bool:
            try:
                s3.create_bucket(Bucket=BUCKET)
            except Exception:  # noqa: BLE001 - not up yet, whatever the error
                return False
            return True

        wait_for(bucket, timeout_s=READY_S, poll_s=0.3, what="the S3 server")

    # -- readiness and the store's view ------------------------------------------------

    def heartbeat(self, node: str) -> bool:
        try:
            return bool(self.redis().exists(keys.worker(node)))
        except redis.RedisError:
            return False

    def api_up(self) -> bool:
        try:
            return httpx.get(f"{self.api_url}/v1/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(self.database_url, connect_timeout=5) as db:
            return list(db.execute(sql, params).fetchall())

    def attempts(self, ids: list[str]) -> dict[str, list[tuple[str, str | None]]]:
        """Each job's attempts in order: (worker, reason)."""
        rows = self.query("SELECT job_id, worker, reason FROM attempts WHERE job_id = ANY(%s)"
                          " ORDER BY job_id, n", ids)
        out: dict[str, list[tuple[str, str | None]]] = {i: [] for i in ids}
        for job_id, worker, reason in rows:
            out[job_id].append((worker, reason))
        return out

    def stop(self) -> None:
        """The workers and schedulers first, then what they talk to: a worker told to stop
        while Redis and the Sentinels stop beside it spends 18 s on its warm shutdown's
        reconnects."""
        first = [p for name, p in self.procs.items() if name.startswith(("worker-", "scheduler-"))]
        stop_process_groups(first)
        stop_process_groups([p for p in self.procs.values() if p not in first])


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Pool]:
    """The control host's services, two GPU hosts' workers, and a tenant for the client;
    everything is stopped and the network removed at the end, whatever happened."""
    try:
        net = Network.create(["control", "gpu-a", "gpu-b", "client"])
    except (NetnsUnavailable, subprocess.CalledProcessError) as exc:
        reason = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else exc
        pytest.skip(f"cannot build hosts as network namespaces here: {reason}")
    pool = Pool(net=net, root=tmp_path, pg_dir=Path(tempfile.mkdtemp(prefix="e31-mh-pg-")))
    began = time.monotonic()
    try:
        (tmp_path / "e31.toml").write_text(POOL_CONFIG)
        pool.start_postgres()
        pool.start_redis()
        pool.start_s3()
        pool.run_e31("control", "db", "upgrade")
        pool.token = json.loads(pool.run_e31("control", "tenant", "create", "mh", "--json")
                                )["token"]
        pool.e31("api", "control", "api", env=pool.control_env)
        pool.e31("scheduler-1", "control", "scheduler", env=pool.control_env)
        for host, gpus in (("gpu-a", "2x80"), ("gpu-b", "2x24")):
            home = tmp_path / f"{host}-home"
            pool.e31(f"worker-{host}", host, "worker", "--simulate-gpus", gpus, "--hostname",
                     host, env=pool.node_env(home))
        wait_for(lambda: "scheduler_leading" in pool.log("scheduler-1"), timeout_s=READY_S,
                 poll_s=0.2, what="the first scheduler to lead")
        pool.e31("scheduler-2", "control", "scheduler", env=pool.control_env)
        wait_for(pool.api_up, timeout_s=READY_S, poll_s=0.2, what="the API to answer")
        for node in ("gpu0@gpu-a", "gpu1@gpu-a", "gpu0@gpu-b", "gpu1@gpu-b"):
            wait_for(functools.partial(pool.heartbeat, node), timeout_s=READY_S, poll_s=0.2,
                     what=f"{node} to beat")
        wait_for(lambda: "scheduler_standby" in pool.log("scheduler-2"), timeout_s=READY_S,
                 poll_s=0.2, what="the second scheduler to stand by")
        print(f"multihost: the pool was up in {time.monotonic() - began:.0f} s")
        yield pool
    finally:
        for host in ("gpu-a", "gpu-b"):
            with contextlib.suppress(subprocess.CalledProcessError):
                net.restore(host)   # a cut host's processes stop sooner with a link
        pool.stop()
        pool.stop_postgres()
        net.destroy()
        shutil.rmtree(pool.pg_dir, ignore_errors=True)


@pytest.mark.timeout(600)
def test_a_pool_of_hosts_survives_a_cut_off_node_a_scheduler_and_a_redis_primary_and_runs_every_job_once(  # noqa: E501
        pool: Pool) -> None:
    started = time.monotonic()
    # Given a pool of two GPU hosts, and a client host that submits a first wave of jobs
    # (gpu80 ones only gpu-a can run, gpu24 ones that both can)
    wave1 = [_job(n, 80, 1) for n in range(2)] + [_job(n, 24, JOB_CUT_S) for n in range(2, 6)]
    first = pool.client("submit", json.dumps(wave1))
    # and some of them run on gpu-b (their command started: the worker noted how)
    on_b = cast(list[str], wait_for(lambda: [job_id for (job_id,) in pool.query(
        "SELECT job_id FROM attempts WHERE job_id = ANY(%s) AND worker LIKE '%%@gpu-b'"
        " AND start IS NOT NULL AND ended_at IS NULL", first)], timeout_s=JOB_WAIT_S,
        poll_s=0.1, what="a job to run on gpu-b"))

    # When gpu-b is cut off mid-run, and the leading scheduler is killed at the same time
    pool.net.cut("gpu-b")
    leader, standby = (("scheduler-1", "scheduler-2") if pool.leads("scheduler-1")
                       else ("scheduler-2", "scheduler-1"))
    pool.kill(leader)
    killed_at = time.monotonic()
    wait_for(lambda: pool.leads(standby), timeout_s=30, poll_s=0.05,
             what="the standby scheduler to lead")
    took_over_s = time.monotonic() - killed_at

    # Then the standby leads within two lock TTLs, and every job of the wave succeeds, those
    # of gpu-b on gpu-a after their leases expired, and the client downloads each output
    fetched = pool.client("fetch", json.dumps(first), str(pool.root / "out1"), str(JOB_WAIT_S))
    assert took_over_s <= 2 * LEADER_TTL_S + 1.0, f"the standby took {took_over_s:.1f} s"
    for n, job_id in enumerate(first):
        assert fetched[job_id] == {"state": "succeeded", "files": {"out.txt": f"job {n}\n"}}
    attempts = pool.attempts(first)
    for job_id in on_b:
        assert attempts[job_id][0][0].endswith("@gpu-b"), attempts[job_id]
        assert attempts[job_id][0][1] == "lost", attempts[job_id]
        assert attempts[job_id][-1][0].endswith("@gpu-a"), attempts[job_id]

    # When gpu-b's cable is plugged back
    pool.net.restore("gpu-b")
    # Then its late outcome writes land, and the fence refuses them (or, where the job outlived
    # the lease its worker could not renew, the worker stopped it and offers no outcome)
    wait_for(lambda: all(f"outcome_fenced job={j}" in pool.log("worker-gpu-b")
                         or f"lease_lost job={j}" in pool.log("worker-gpu-b") for j in on_b),
             timeout_s=120, poll_s=0.5, what="gpu-b's late writes to be refused")

    # When the Redis primary dies, and Sentinel promotes the replica
    pool.kill("redis-primary")
    wait_for(lambda: pool.primary_port() == REPLICA_PORT, timeout_s=60, poll_s=0.2,
             what="the sentinels to promote the replica")
    # Then the pool carries on: a second wave from the client runs on it
    wave2 = [_job(n, 80, 0.5) for n in range(6, 8)] + [_job(n, 24, 0.5) for n in range(8, 10)]
    second = pool.client("submit", json.dumps(wave2))
    fetched = pool.client("fetch", json.dumps(second), str(pool.root / "out2"), str(JOB_WAIT_S))
    for n, job_id in enumerate(second, start=6):
        assert fetched[job_id] == {"state": "succeeded", "files": {"out.txt": f"job {n}\n"}}

    # And in the store, every job succeeded exactly once: one succeeded attempt each, its
    # outputs recorded
    everyone = first + second
    rows = pool.query("SELECT id, state, outputs FROM jobs WHERE id = ANY(%s)", everyone)
    assert {job_id: state for job_id, state, _ in rows} == {j: "succeeded" for j in everyone}
    assert all(outputs for _, _, outputs in rows), rows
    attempts = pool.attempts(everyone)
    assert {j: [r for _, r in a].count("succeeded") for j, a in attempts.items()} == {
        j: 1 for j in everyone}, attempts
    assert all(attempts[j][0] == (attempts[j][0][0], "lost") for j in on_b), attempts
    print(f"multihost: {time.monotonic() - started:.0f} s after the pool was up")
