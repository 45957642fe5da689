"""Engines for SQLite (WAL, busy timeout, BEGIN IMMEDIATE for writes) and PostgreSQL."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.compiler import compiles
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


def make_engine(url: str) -> Engine:
    """An engine for `url`; SQLite is set up to serve several processes at once."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=5,
                             connect_args={"connect_timeout": PG_CONNECT_TIMEOUT_S,
                                           "tcp_user_timeout": PG_TCP_USER_TIMEOUT_MS,
                                           **PG_KEEPALIVE})
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
def scratch_database(server_url: str, *, prefix: str) -> Iterator[str]:
    """A new, empty PostgreSQL database on the server of `server_url` (a SQLAlchemy URL),
    dropped afterwards: for the test suite and the benchmarks. Yields its URL."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
