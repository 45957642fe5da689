"""A real `e31 up` stack for the end-to-end tests: Redis, SQLite, API, scheduler, workers.

Simulated GPUs `1x24,1x48` (indexes 0 and 1) and two cpu slots; short heartbeats and kill
grace so cancels and timeouts finish quickly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from e31.client import Client
from e31.local.redisserver import free_port
from e31.local.state import stack_ready
from tests.conftest import wait_for

JOBS_DIR = Path(__file__).parent / "jobs"


@dataclass
class Stack:
    home: Path
    url: str
    token: str
    env: dict[str, str]
    shared: Path   # the one host directory the stack's jobs may write (sandbox_writable_dirs)

    @property
    def redis_url(self) -> str:
        """The private Redis `e31 up` started (the profile records it)."""
        return str(json.loads((self.home / "profile.json").read_text())["redis_url"])

    def env_with_redis(self, **extra: str) -> dict[str, str]:
        """The stack's environment plus its Redis: for extra processes that join the stack."""
        return dict(self.env, E31_REDIS_URL=self.redis_url, **extra)

    def client(self, token: str | None = None) -> Client:
        return Client(self.url, token or self.token)

    def e31(self, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "e31.cli", *args], env=self.env,
                              capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("e31home")
    # No E31_REDIS_URL: `e31 up` starts its own private redis-server, as on a user's machine,
    # and the stack's workers stay away from the Redis the integration tests use.
    shared = tmp_path_factory.mktemp("shared")   # tests and their jobs meet here: a job's
    shared.chmod(0o777)                          # sandbox shows it nothing else of the host
    env = dict(os.environ, E31_HOME=str(home), E31_SANDBOX_WRITABLE_DIRS=str(shared),
               E31_API_PORT=str(free_port()), E31_FLOWER_PORT=str(free_port()),
               E31_HEARTBEAT_INTERVAL_S="0.5", E31_KILL_GRACE_S="2", E31_SCHEDULER_TICK_S="1",
               E31_INPUT_FILE_ROOTS=str(tmp_path_factory.getbasetemp()),  # file:// inputs
               PYTHONPATH=os.pathsep.join([str(JOBS_DIR), os.environ.get("PYTHONPATH", "")]))
    for var in ("E31_URL", "E31_TOKEN", "E31_REDIS_URL", "E31_DATABASE_URL", "E31_CONFIG"):
        env.pop(var, None)
    log = open(home / "up.out", "w")
    proc = subprocess.Popen([sys.executable, "-m", "e31.cli", "up", "--simulate-gpus", "1x24,1x48",
                             "--cpu-slots", "2", "--no-flower"], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: proc.poll() is not None or stack_ready(home), timeout_s=120, poll_s=0.2,
                 what="e31 up to be ready")
        assert proc.poll() is None, (home / "up.out").read_text()
        profile = json.loads((home / "profile.json").read_text())
        yield Stack(home=home, url=profile["url"], token=profile["token"], env=env,
                    shared=shared)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def shared_tmp(stack: Stack, tmp_path: Path) -> Path:
    """A directory this test shares with its jobs (pid files, release files): under the
    stack's shared directory, which sandboxed jobs may write, unlike the test's tmp_path."""
    path = stack.shared / tmp_path.name
    path.mkdir(mode=0o777)
    path.chmod(0o777)
    return path
