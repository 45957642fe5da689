"""What `e31 down`, `e31 up -d` and the tools that find a running stack read: `stack.json`
under E31_HOME (the `e31 up` process, its children, ready or not), whether a pid lives, and
how to stop the stack. Apart from `e31.local.stack` so that these commands import neither
Redis, the store nor the HTTP client: `e31 up -d` waits on its child, and `e31 down` on the
stack, without first paying the second of imports that starting a stack needs.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

STATE_FILE = "stack.json"     # under home: the up process, its children, ready or not
STOP_POLL_S = 0.1             # how often `e31 down` looks whether the stack has stopped


def stack_ready(home: Path) -> bool:
    """Whether the `e31 up` of `home` has said it is ready (its state file)."""
    try:
        return bool(json.loads((home / STATE_FILE).read_text()).get("ready"))
    except (OSError, ValueError):
        return False


def stack_redis_url(home: Path) -> str | None:
    """The Redis URL of the running `e31 up` of `home` (its profile records it; it changes at
    every start), or None when no stack runs from `home`: how `e31 worker --drain` finds the
    stack's Redis without E31_REDIS_URL."""
    try:
        pid = int(json.loads((home / STATE_FILE).read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None
    from e31.client.profile import read_profile  # the client package imports httpx
    url = read_profile(home).get("redis_url")
    return str(url) if url and pid_alive(pid) else None


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs (ours or not); a zombie, exited but not yet
    reaped by its parent, does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True    # no /proc: it exists
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def stop_stack(home: Path, *, timeout_s: float = 120.0) -> bool:
    """`e31 down`: ask the `e31 up` of `home` to stop and wait for it; False if none ran."""
    state_path = home / STATE_FILE
    try:
        pid = int(json.loads(state_path.read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return False
    if not pid_alive(pid):
        state_path.unlink(missing_ok=True)
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(STOP_POLL_S)
    return not pid_alive(pid)
