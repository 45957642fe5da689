"""A worker's session left idle in a transaction is ended by PostgreSQL, and its row locks go
with it. A worker cut off from the store mid-transaction (its node's link down) cannot end it
itself, and PostgreSQL would not notice the silent peer for hours: the scheduler's recovery of
that worker's lease, which updates the same rows, would wait on the locks at every tick, and
the pool's scheduling with it (seen in tests/e2e/test_multihost.py). Real PostgreSQL
(E31_TEST_DATABASE_URL)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import DBAPIError

from e31.edge import wiring
from e31.edge.settings import Settings
from e31.store.db import end_abandoned_transactions, make_engine
from tests.conftest import fresh_postgres_database

pytestmark = pytest.mark.postgres


@pytest.fixture
def pg_url() -> Iterator[str]:
    with fresh_postgres_database() as url:
        setup = create_engine(url)
        with setup.begin() as c:
            c.execute(text("CREATE TABLE leases (id int PRIMARY KEY, owner text)"))
            c.execute(text("INSERT INTO leases VALUES (1, 'gpu0@cut')"))
        setup.dispose()
        yield url


def _recovery_gets_the_row(url: str, worker: Engine, *, lock_wait_ms: int) -> bool:
    """A worker session updates the row and goes silent in its transaction; whether another
    session (the scheduler's recovery) then updates the row within `lock_wait_ms`."""
    abandoned = worker.connect()
    abandoned.begin()
    abandoned.execute(text("UPDATE leases SET owner = 'gpu0@cut' WHERE id = 1"))
    scheduler = create_engine(url)
    try:
        with scheduler.begin() as c:
            c.execute(text(f"SET LOCAL lock_timeout = {lock_wait_ms}"))
            c.execute(text("UPDATE leases SET owner = NULL WHERE id = 1"))
        return True
    except DBAPIError as exc:
        assert "lock timeout" in str(exc), exc
        return False
    finally:
        scheduler.dispose()
        with contextlib.suppress(DBAPIError):
            abandoned.rollback()
        with contextlib.suppress(DBAPIError):
            abandoned.close()
        worker.dispose()


def test_a_worker_sessions_abandoned_transaction_is_ended_and_its_row_freed(pg_url: str) -> None:
    # Given a worker's engine that has PostgreSQL end transactions idle for 0.3 s
    worker = end_abandoned_transactions(make_engine(pg_url, worker=True), timeout_ms=300)
    # When its session is left idle in a transaction that locked a row
    # Then another session updates that row once PostgreSQL ended the silent one
    assert _recovery_gets_the_row(pg_url, worker, lock_wait_ms=10_000)


def test_without_it_the_abandoned_transaction_holds_the_row(pg_url: str) -> None:
    # Given a worker's engine as it was: PostgreSQL keeps an idle transaction open
    worker = make_engine(pg_url, worker=True)
    # Then the row stays locked: the other session's update waits and gives up
    assert not _recovery_gets_the_row(pg_url, worker, lock_wait_ms=1_000)


def test_every_worker_process_engine_ends_abandoned_transactions_the_control_plane_not(
        pg_url: str) -> None:
    settings = Settings(database_url=pg_url)
    for node, expected in (("gpu0@host", "15s"), (None, "0")):
        engine = wiring.repo(settings, node=node).engine
        try:
            with engine.connect() as c:
                shown = c.execute(text("SHOW idle_in_transaction_session_timeout")).scalar()
        finally:
            engine.dispose()
        assert shown == expected, (node, shown)
