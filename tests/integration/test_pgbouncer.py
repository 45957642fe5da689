"""Workers' store through a real PgBouncer in transaction pooling (issue 14, item 4).

A PgBouncer process of the test's own (a free port, `pool_mode = transaction`, two server
connections) in front of a fresh database on the PostgreSQL of E31_TEST_DATABASE_URL. Eight
worker engines (`make_engine(..., worker=True)`, as eight GPU worker processes of a node
build them) claim, renew and record jobs through it at once: every job succeeds, and
PostgreSQL never sees more than the pool's two connections however many worker processes
connect (docker-compose.yml's `pgbouncer` service; docs/architecture.md, "Connections").

And why the engine turns psycopg's server-side prepared statements off: with psycopg's
default, two clients that take turns on PgBouncer's one server connection collide on the
statement psycopg prepared there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ProgrammingError

from e31.core.clock import utcnow
from e31.core.states import JobState
from e31.edge.settings import Settings
from e31.local.redisserver import free_port
from e31.store import Repo, make_engine
from e31.store.migrate import upgrade
from tests.conftest import fresh_postgres_database, wait_for
from tests.integration.test_concurrent_outcomes import (
    JOBS_PER_WORKER,
    WORKERS,
    run_workers,
    submit_one,
)

pytestmark = [pytest.mark.postgres, pytest.mark.slow]   # a pooler process: on demand

SERVER_POOL = 2        # PgBouncer's server connections to the database


class PgBouncer:
    """pgbouncer as the `postgres` user (it refuses root), in a directory of its own."""

    def __init__(self, target: str) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="e31-pgb-"))
        url = make_url(target)
        self.database = str(url.database)
        (self.dir / "users.txt").write_text(f'"{url.username}" ""\n')
        (self.dir / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"{self.database} = host={url.host} port={url.port or 5432} user={url.username}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {self.dir / 'users.txt'}\n"
            f"pool_mode = transaction\ndefault_pool_size = {SERVER_POOL}\n"
            "reserve_pool_size = 0\nmax_client_conn = 200\n"
            f"logfile = {self.dir / 'pgbouncer.log'}\npidfile = {self.dir / 'pgbouncer.pid'}\n")
        shutil.chown(self.dir, "postgres")
        for path in self.dir.iterdir():
            shutil.chown(path, "postgres")
        self.url = f"postgresql+psycopg://{url.username}@127.0.0.1:{self.port}/{self.database}"

    @classmethod
    def available(cls) -> str | None:
        if not shutil.which("pgbouncer"):
            return "no pgbouncer on PATH (apt-get install pgbouncer)"
        if os.geteuid() != 0 or not shutil.which("runuser"):
            return "needs root and runuser to run pgbouncer as the postgres user"
        return None

    def start(self) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", "pgbouncer", "-d",
                        str(self.dir / "pgbouncer.ini")], check=True, timeout=30)
        wait_for(self._answers, timeout_s=30, what="pgbouncer to accept connections")

    def _answers(self) -> bool:
        try:
            psycopg.connect(self.url.replace("+psycopg", ""), connect_timeout=2).close()
            return True
        except psycopg.OperationalError:
            return False

    def stop(self) -> None:
        pid = self.dir / "pgbouncer.pid"
        if pid.exists():
            subprocess.run(["kill", pid.read_text().strip()], check=False)
            wait_for(lambda: not pid.exists(), timeout_s=10, what="pgbouncer to stop")
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def bouncer() -> Iterator[tuple[PgBouncer, str]]:
    why = PgBouncer.available()
    if why:
        pytest.skip(why)
    with fresh_postgres_database() as direct:
        upgrade_engine = make_engine(direct)
        upgrade(upgrade_engine)
        upgrade_engine.dispose()
        pgb = PgBouncer(direct)
        pgb.start()
        try:
            yield pgb, direct
        finally:
            pgb.stop()


def _server_connections(direct: str, database: str) -> int:
    """PostgreSQL's connections to `database`, less the one asking."""
    with psycopg.connect(direct.replace("+psycopg", ""), autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
                           "AND pid <> pg_backend_pid()", (database,)).fetchone()
    return int(row[0]) if row else 0


def test_eight_workers_claim_and_record_through_pgbouncer_on_two_server_connections(
        bouncer: tuple[PgBouncer, str]) -> None:
    pgb, direct = bouncer
    # Given eight worker engines that reach the store through PgBouncer
    engines = [make_engine(pgb.url, application_name=f"e31 worker gpu{i}@node", worker=True)
               for i in range(WORKERS)]
    repos = [Repo(e, half_life_s=Settings().fair_share_half_life_s) for e in engines]
    tenant, _ = repos[0].create_tenant("pooled", now=utcnow())
    seen: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            seen.append(_server_connections(direct, pgb.database))

    # When they run their jobs' claim, renewals and outcome at once
    sampler = threading.Thread(target=sample)
    sampler.start()
    ends, errors = run_workers(repos, lambda repo: submit_one(repo, tenant.id))
    done.set()
    sampler.join()
    try:
        # Then every job succeeded, with no store error in any worker
        assert not errors, errors
        assert ends == [JobState.SUCCEEDED] * WORKERS * JOBS_PER_WORKER
        # And PostgreSQL saw at most the pooler's connections, while eight engines held theirs
        assert seen and max(seen) <= SERVER_POOL, seen
        assert _server_connections(direct, pgb.database) <= SERVER_POOL
    finally:
        for e in engines:
            e.dispose()


def test_psycopg_prepared_statements_collide_behind_a_transaction_pooler(
        bouncer: tuple[PgBouncer, str]) -> None:
    pgb, _ = bouncer
    # Given an engine with psycopg's default (prepare after 5 uses), not make_engine's
    engine = create_engine(pgb.url, pool_size=2, max_overflow=0)
    a, b = engine.connect(), engine.connect()
    try:
        # When two clients take turns running the same statement through PgBouncer
        with pytest.raises(ProgrammingError, match="prepared statement"):
            for i in range(10):
                for conn in (a, b):
                    conn.execute(text("SELECT count(*) FROM jobs WHERE priority = :p"),
                                 {"p": i})
                    conn.commit()
    finally:
        a.close()
        b.close()
        engine.dispose()
    # Then the same turns through make_engine's engine (prepared statements off) succeed
    fixed = make_engine(pgb.url)
    c, d = fixed.connect(), fixed.connect()
    for i in range(10):
        for conn in (c, d):
            conn.execute(text("SELECT count(*) FROM jobs WHERE priority = :p"), {"p": i})
            conn.commit()
    c.close()
    d.close()
    fixed.dispose()
