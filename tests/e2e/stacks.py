"""A short-lived `e31 up` of its own, for tests that break what they run on (drain every node,
kill Redis, stop the store) and so cannot use the session's `stack` (tests/e2e/conftest.py).

    with own_stack(tmp_path_factory.mktemp("home"), "--cpu-slots", "2") as st:
        st.e31("submit", ...)          # a Stack, as the session's fixture gives
        st.state()                    # stack.json: {"pid": ..., "children": {...}}
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from e31.local.redisserver import free_port
from e31.local.state import stack_ready
from tests.conftest import wait_for

from .conftest import JOBS_DIR, Stack

READY_S = 120


class OwnStack(Stack):
    def state(self) -> dict[str, Any]:
        """The stack's stack.json: the `e31 up` pid and its children's pids."""
        return dict(json.loads((self.home / "stack.json").read_text()))


@contextmanager
def own_stack(home: Path, *up_args: str, shared: Path | None = None,
              **settings: str) -> Iterator[OwnStack]:
    """`e31 up --no-flower` with `up_args` from `home`, as the session's stack is set (short
    heartbeats and kill grace) and with `settings` (E31_* variables) over that; stopped
    (SIGTERM, as `e31 down` does) at the end."""
    shared = shared or home.with_name(home.name + "-shared")
    shared.mkdir(mode=0o777, exist_ok=True)
    shared.chmod(0o777)
    env = {k: v for k, v in os.environ.items()
           if k not in ("E31_URL", "E31_TOKEN", "E31_REDIS_URL", "E31_DATABASE_URL", "E31_CONFIG")}
    env.update(E31_HOME=str(home), E31_SANDBOX_WRITABLE_DIRS=str(shared),
               E31_API_PORT=str(free_port()), E31_FLOWER_PORT=str(free_port()),
               E31_HEARTBEAT_INTERVAL_S="0.5", E31_KILL_GRACE_S="2", E31_SCHEDULER_TICK_S="1",
               PYTHONPATH=os.pathsep.join([str(JOBS_DIR), os.environ.get("PYTHONPATH", "")]))
    env.update(settings)
    home.mkdir(parents=True, exist_ok=True)
    log = open(home / "up.out", "w")
    proc = subprocess.Popen([sys.executable, "-m", "e31.cli", "up", "--no-flower", *up_args],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: proc.poll() is not None or stack_ready(home), timeout_s=READY_S,
                 poll_s=0.2, what="e31 up to be ready")
        assert proc.poll() is None, (home / "up.out").read_text()
        profile = json.loads((home / "profile.json").read_text())
        yield OwnStack(home=home, url=profile["url"], token=profile["token"], env=env,
                       shared=shared)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
