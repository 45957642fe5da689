"""Entrypoints the sandbox tests submit: each one tries what a job must not be able to do
and reports, per attempt, what happened (an exception's name, or what it got)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any


def _try(fn: Any) -> str:
    try:
        return str(fn())
    except OSError as exc:
        return type(exc).__name__


def _read(path: str) -> str:
    with open(path, "rb") as f:
        f.read(1)
    return "read"


def _write(path: str) -> str:
    with open(path, "w") as f:
        f.write("written by a job\n")
    return "written"


def _signal(pid: int) -> str:
    os.kill(pid, 0)
    return "signalled"


def _environ(pid: int) -> str:
    names = [kv.split(b"=", 1)[0].decode() for kv in
             Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if kv]
    return "E31_REDIS_URL" if "E31_REDIS_URL" in names else "read"


def probe(ctx: Any, read: list[str], write: list[str], pids: list[int],
          secrets: list[str]) -> dict[str, Any]:
    """Try to read each path of `read`, write each of `write`, signal and read the
    environment of each pid of `pids`; say which of `secrets` its own environment holds."""
    return {
        "uid": os.getuid(),
        "read": {p: _try(lambda p=p: _read(p)) for p in read},
        "write": {p: _try(lambda p=p: _write(p)) for p in write},
        "signal": {str(pid): _try(lambda pid=pid: _signal(pid)) for pid in pids},
        "environ": {str(pid): _try(lambda pid=pid: _environ(pid)) for pid in pids},
        "env_secrets": [s for s in secrets if any(s in v for v in os.environ.values())],
    }


def connect(ctx: Any, port: int) -> str:
    """Open a TCP connection to 127.0.0.1:`port`: 'connected', or the error's name."""
    def go() -> str:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        return "connected"
    return _try(go)


def hold(ctx: Any, release: str, secret: str) -> str:
    """Leave `secret` in its output directory, then run until the file `release` exists."""
    (ctx.output_dir / "secret.txt").write_text(secret)
    import time
    deadline = time.monotonic() + 120
    while not Path(release).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return "released"


def reach(ctx: Any, targets: list[list[Any]]) -> dict[str, str]:
    """Open a TCP connection to each [host, port]: 'connected', or the error's name."""
    def go(host: str, port: int) -> str:
        socket.create_connection((host, port), timeout=5).close()
        return "connected"
    return {f"{host}:{port}": _try(lambda h=host, p=port: go(h, p)) for host, port in targets}
