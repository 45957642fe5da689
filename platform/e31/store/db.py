"""Engines for SQLite (WAL, busy timeout, BEGIN IMMEDIATE for writes) and PostgreSQL."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import Session
from sqlalchemy.sql.functions import FunctionElement

SQLITE_BUSY_TIMEOUT_MS = 30_000  # a writer waits this long for another's short transaction
WRITE_OPTION = "e31_write"       # execution option: this transaction writes
# PostgreSQL over a network that can silently drop packets (a cut link, a dead node): without
# these a query on a dead connection waits for TCP's retransmissions, minutes, and a worker
# could neither renew its lease nor notice that it cannot. Data sent and unacknowledged for
# PG_TCP_USER_TIMEOUT_MS, or a connect longer than PG_CONNECT_TIMEOUT_S, fails the call, and
# the caller's store-outage handling takes over. A long query with nothing in flight is not
# affected; keepalives find a dead idle connection.
PG_CONNECT_TIMEOUT_S = 5
PG_TCP_USER_TIMEOUT_MS = 5_000
PG_KEEPALIVE = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2,
                "keepalives_count": 2}
# psycopg 3 prepares a statement on the server after a few uses; behind a transaction pooler
# (PgBouncer before 1.21, docker-compose.yml's `pgbouncer`) the next transaction may get
# another server connection, where it is missing or taken: "prepared statement _pg3_0 does
# not exist / already exists". Off, as tests/integration/test_pgbouncer.py shows it must be.
PG_NO_PREPARE = {"prepare_threshold": None}


# Connections of one process to PostgreSQL (docs/architecture.md, "Connections"). A process
# of the control plane (API, scheduler; a few per pool) keeps up to CONTROL_POOL_SIZE open and
# opens up to CONTROL_MAX_OVERFLOW more under load. A worker process (one per GPU: a thousand
# in a fleet) keeps one, and opens a second only while a call nests within another's
# transaction; it closes that one at once. Its threads (the attempt, the lease renewal, the
# heartbeat's drain check) hold a connection for one short transaction at a time, so they take
# turns on the one connection and wait at most WORKER_POOL_TIMEOUT_S for it.
CONTROL_POOL_SIZE, CONTROL_MAX_OVERFLOW = 5, 5
WORKER_POOL_SIZE, WORKER_MAX_OVERFLOW = 1, 1
WORKER_POOL_TIMEOUT_S = 30.0
APPLICATION_NAME_MAX = 63   # PostgreSQL keeps this many bytes of application_name


def make_engine(url: str, *, application_name: str = "e31", worker: bool = False) -> Engine:
    """An engine for `url`; SQLite is set up to serve several processes at once. On
    PostgreSQL the process names itself `application_name` (pg_stat_activity shows it; the
    PGAPPNAME variable wins) and a worker process (`worker`) keeps the smaller pool."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        size, overflow = ((WORKER_POOL_SIZE, WORKER_MAX_OVERFLOW) if worker
                          else (CONTROL_POOL_SIZE, CONTROL_MAX_OVERFLOW))
        name = os.environ.get("PGAPPNAME") or application_name
        return create_engine(url, pool_pre_ping=True, pool_size=size, max_overflow=overflow,
                             pool_timeout=WORKER_POOL_TIMEOUT_S if worker else 30.0,
                             connect_args={"connect_timeout": PG_CONNECT_TIMEOUT_S,
                                           "tcp_user_timeout": PG_TCP_USER_TIMEOUT_MS,
                                           "application_name":
                                               name.encode()[:APPLICATION_NAME_MAX].decode(
                                                   errors="ignore"),
                                           **PG_KEEPALIVE,
                                           **(PG_NO_PREPARE if parsed.get_driver_name()
                                              == "psycopg" else {})})
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000,
                                              "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves, below
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        # A deferred transaction that later writes can fail at once with "database is locked"
        # when another process wrote in between; taking the write lock up front waits instead.
        immediate = conn.get_execution_options().get(WRITE_OPTION, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


# A worker's transactions last milliseconds. One left open by a worker that was cut off or
# stopped mid-transaction (its node's link down: PostgreSQL notices a silent peer only after
# hours of TCP keepalive) holds its rows' locks, and the scheduler's recovery of that very
# worker's lease waits on them: every tick, so the whole pool, stops. PostgreSQL ends a
# worker's session that stays idle in a transaction this long, and the locks go with it
# (tests/e2e/test_multihost.py cut a node mid-transaction and saw the scheduler hang).
WORKER_IDLE_IN_TRANSACTION_TIMEOUT_MS = 15_000


def end_abandoned_transactions(engine: Engine,
                               timeout_ms: int = WORKER_IDLE_IN_TRANSACTION_TIMEOUT_MS) -> Engine:
    """Have PostgreSQL end each session of `engine` that stays idle within a transaction for
    `timeout_ms` (`idle_in_transaction_session_timeout`, set as each connection opens); the
    engine's next use reconnects (pool_pre_ping). Nothing to do on SQLite: a dead process's
    locks end with it."""
    if engine.dialect.name != "postgresql":
        return engine

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute(f"SET idle_in_transaction_session_timeout = {int(timeout_ms)}")
        cur.close()
        dbapi_conn.commit()

    return engine


def core_of(s: Session | Connection) -> Connection:
    """The connection of a session's transaction (its pending changes flushed first, as its
    own execute would), or the connection itself: for statement functions that callers run
    in either (a session's ORM work, or `Store._core`)."""
    if isinstance(s, Connection):
        return s
    s.flush()
    return s.connection()


class unindexed(FunctionElement[Any]):   # lower case: it reads as a SQL function
    """A column's value written so that no planner uses an index on it: `+col` on SQLite,
    `coalesce(col, col)` elsewhere. Without statistics (SQLite never gathers them; PostgreSQL
    lags after a bulk insert) `state = 'queued'` looks selective, and the planner scans every
    queued job through a state index instead of looking up 32 ids by key or the few
    published jobs by `dispatched_at`."""

    inherit_cache = True


@compiles(unindexed)
def _opaque(element: unindexed, compiler: Any, **kw: Any) -> str:
    col = str(compiler.process(element.clauses, **kw))
    return f"coalesce({col}, {col})"


@compiles(unindexed, "sqlite")
def _sqlite_plus(element: unindexed, compiler: Any, **kw: Any) -> str:
    return "+" + str(compiler.process(element.clauses, **kw))


@contextmanager
def scratch_database(server_url: str, *, prefix: str,
                     template: str | None = None) -> Iterator[str]:
    """A new PostgreSQL database on the server of `server_url` (a SQLAlchemy URL), empty or a
    copy of the database `template`, dropped afterwards: for the test suite and the
    benchmarks. Yields its URL."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    copy = f' TEMPLATE "{template}"' if template else ""
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"{copy}'))
    try:
        yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
