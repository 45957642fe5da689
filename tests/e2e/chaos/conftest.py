"""A cluster of real processes that the chaos tests may break: their own Redis, store, API,
scheduler and one `e31 worker` launcher per pretend host, each in its own session so that
one worker, one host or one job can be killed alone.

Short timings make recovery quick to watch: heartbeat 0.5 s, lease TTL 3 s, tick 0.5 s.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from e31.client import Client
from e31.core import keys
from e31.core.clock import utcnow
from e31.edge import wiring
from e31.edge.settings import Settings
from e31.local.redisserver import free_port, start_redis
from e31.store.migrate import upgrade
from tests.conftest import stop_process_groups, wait_for

JOBS_DIR = Path(__file__).parent.parent / "jobs"
LEASE_TTL_S = 3.0
HEARTBEAT_S = 0.5
READY_S = 60.0


def parse_ts(text: str) -> datetime:
    return datetime.fromisoformat(text)


def billed_seconds(status: dict[str, Any]) -> float:
    """GPU-seconds as the attempts add up: run time × GPUs of each attempt, where the run time
    is its duration less its setup (`setup_s`, never billed: docs/jobs.md). Without the
    setup, a run whose setup took over 10 ms on a busy machine failed the comparison."""
    total = 0.0
    for a in status["attempts"]:
        gpus = len([g for g in a["gpus"].split(",") if g])
        duration = (parse_ts(a["ended_at"]) - parse_ts(a["started_at"])).total_seconds()
        total += max(0.0, duration - (a.get("setup_s") or 0.0)) * gpus
    return total


def trail(directory: Path, job_id: str) -> list[str]:
    """The events a chaos job wrote (see tests/e2e/jobs/chaosjobs.py)."""
    path = directory / f"{job_id}.log"
    return path.read_text().splitlines() if path.exists() else []


class Redis:
    """A redis-server the test can kill, restart (same port, nothing kept) and flush."""

    def __init__(self, data_dir: Path, port: int, *, extra_bind: str | None = None) -> None:
        self.data_dir, self.port, self.extra_bind = data_dir, port, extra_bind
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc, _ = start_redis(self.data_dir, port=self.port,
                                   also_bind=[self.extra_bind] if self.extra_bind else [])

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()


class Postgres:
    """A private PostgreSQL the test can stop and start (initdb as the `postgres` user)."""

    def __init__(self, *, extra_listen: str | None = None) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="e31-pg-"))
        self._bin = Path(shutil.which("pg_ctl") or "").parent
        self._listen = ",".join(["127.0.0.1", *([extra_listen] if extra_listen else [])])

    @classmethod
    def available(cls) -> str | None:
        """Why it cannot run here, or None."""
        if not shutil.which("pg_ctl") or not shutil.which("initdb"):
            return "no pg_ctl/initdb on PATH"
        if os.geteuid() != 0 or not shutil.which("runuser"):
            return "needs root and runuser to run PostgreSQL as the postgres user"
        return None

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _as_postgres(self, *argv: str) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", *argv], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=120)

    def init(self) -> None:
        shutil.chown(self.dir, "postgres")
        self._as_postgres(str(self._bin / "initdb"), "-D", str(self.dir / "data"), "-A", "trust",
                          "-U", "postgres")
        for address in self._listen.split(",")[1:]:  # initdb trusts only the loopback
            with open(self.dir / "data" / "pg_hba.conf", "a") as hba:
                hba.write(f"host all all {address.rpartition('.')[0]}.0/24 trust\n")
        self.start()

    def start(self) -> None:
        self._as_postgres(str(self._bin / "pg_ctl"), "-D", str(self.dir / "data"), "-w",
                          "-l", str(self.dir / "pg.log"), "-o",
                          f"-p {self.port} -k {self.dir} -c listen_addresses={self._listen}",
                          "start")

    def stop(self) -> None:
        self._as_postgres(str(self._bin / "pg_ctl"), "-D", str(self.dir / "data"), "-m", "fast",
                          "-w", "stop")

    def destroy(self) -> None:
        try:
            self.stop()
        except subprocess.SubprocessError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class Cluster:
    home: Path
    redis: Redis
    env: dict[str, str]
    url: str = ""
    token: str = ""
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def shared(self) -> Path:
        """The one host directory the cluster's jobs may write (sandbox_writable_dirs): beside
        its home, which no job may see."""
        return shared_dir(self.home)

    @property
    def trail_dir(self) -> Path:
        return self.shared / "trail"

    def e31(self, *args: str, env: dict[str, str] | None = None) -> str:
        done = subprocess.run([sys.executable, "-m", "e31.cli", *args], env=env or self.env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def spawn(self, name: str, *args: str, prefix: tuple[str, ...] = (),
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start `e31 ARGS` in its own session, its output in logs/NAME.log."""
        (self.home / "logs").mkdir(exist_ok=True)
        out = open(self.home / "logs" / f"{name}.log", "ab")
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "e31.cli", *args],
                                env=env or self.env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        out.close()
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        path = self.home / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self, *, hosts: tuple[str, ...] = ("ha", "hb")) -> None:
        self.prepare_store()
        self.spawn("api", "api")
        self.spawn("scheduler", "scheduler")
        for host in hosts:
            self.start_worker(host)
        wait_for(self._api_up, timeout_s=READY_S, what="the API to answer")
        for host in hosts:
            self.wait_worker(host)

    def prepare_store(self) -> None:
        """What `e31 db upgrade` and `e31 tenant create chaos` do, in this process: two
        Python starts fewer per cluster (3 s of each chaos test on 2 cores)."""
        repo = wiring.repo(Settings(home=self.home,
                                    database_url=self.env.get("E31_DATABASE_URL", "")))
        try:
            upgrade(repo.engine)
            self.token = repo.create_tenant("chaos", now=utcnow())[1]
        finally:
            repo.engine.dispose()

    def start_worker(self, host: str, *, prefix: tuple[str, ...] = (),
                     env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        return self.spawn(f"worker-{host}", "worker", "--simulate-gpus", "1x24", "--hostname", host,
                          "--loglevel", "INFO", prefix=prefix, env=env)

    def node(self, host: str) -> str:
        return f"gpu0@{host}"

    def heartbeat(self, host: str) -> dict[str, Any] | None:
        raw = self.redis_client().get(keys.worker(self.node(host)))
        return json.loads(raw) if raw else None

    def wait_worker(self, host: str) -> None:
        wait_for(lambda: self.heartbeat(host) is not None, timeout_s=READY_S,
                 what=f"the worker of {host} to beat")

    def redis_client(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis.url, socket_timeout=5)

    def _api_up(self) -> bool:
        try:
            return httpx.get(f"{self.url}/v1/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def client(self) -> Client:
        return Client(self.url, self.token)

    def running_on(self, job_id: str) -> str:
        """The host of the job's running attempt, once it runs."""
        client = self.client()

        def host() -> str | None:
            status = client.get(job_id).status()
            if status["state"] != "running" or not status["attempts"]:
                return None
            return str(status["attempts"][-1]["worker"]).rpartition("@")[2]

        return str(wait_for(host, timeout_s=30, what=f"job {job_id} to run"))

    def stop(self) -> None:
        stop_process_groups(self.procs.values())
        if self.redis.proc is not None and self.redis.proc.poll() is None:
            self.redis.kill()


def make_cluster(home: Path, *, database_url: str | None = None,
                 redis_extra_bind: str | None = None, **settings: str) -> Cluster:
    port = free_port()
    store = Redis(home / "redis", port, extra_bind=redis_extra_bind)
    store.start()
    api_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("E31_")}
    env.update(E31_HOME=str(home), E31_REDIS_URL=store.url, E31_API_PORT=str(api_port),
               E31_SANDBOX_WRITABLE_DIRS=str(shared_dir(home)),
               E31_HEARTBEAT_INTERVAL_S=str(HEARTBEAT_S), E31_LEASE_TTL_S=str(LEASE_TTL_S),
               E31_SCHEDULER_TICK_S="0.5", E31_KILL_GRACE_S="3", E31_DISPATCH_TIMEOUT_S="5",
               PYTHONPATH=os.pathsep.join([str(JOBS_DIR), env.get("PYTHONPATH", "")]))
    if database_url:
        env["E31_DATABASE_URL"] = database_url
    env.update(settings)
    cluster = Cluster(home=home, redis=store, env=env, url=f"http://127.0.0.1:{api_port}")
    cluster.trail_dir.mkdir(parents=True, exist_ok=True)
    for d in (cluster.shared, cluster.trail_dir):   # a sandboxed job runs as its own user
        d.chmod(0o777)
    return cluster


@contextmanager
def running_cluster(home: Path, *, database_url: str | None = None,
                    **settings: str) -> Iterator[Cluster]:
    """A cluster made by `make_cluster` with these settings, started, and stopped at the end."""
    cluster = make_cluster(home, database_url=database_url, **settings)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@contextmanager
def cluster_on_postgres(tmp_path: Path, pg: Postgres, **settings: str) -> Iterator[Cluster]:
    """A cluster (as `make_cluster`) whose store is `pg`, initialised here; both stopped and
    `pg` removed at the end. Skips where a private PostgreSQL cannot run."""
    why = Postgres.available()
    if why:
        pytest.skip(why)
    pg.init()
    try:
        with running_cluster(tmp_path, database_url=pg.url, **settings) as cluster:
            yield cluster
    finally:
        pg.destroy()

def shared_dir(home: Path) -> Path:
    return home.parent / f"{home.name}-shared"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """Two pretend hosts `ha` and `hb`, one simulated 24 GB GPU each, on SQLite."""
    with running_cluster(tmp_path) as c:
        yield c
