"""Entrypoints the end-to-end tests submit (on the workers' PYTHONPATH)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any


def spin(ctx: Any, pidfile: str, seconds: float = 300) -> None:
    """Starts a grandchild, records both pids, then waits (to be cancelled or timed out)."""
    grandchild = subprocess.Popen(["sleep", str(seconds)])
    partial = Path(f"{pidfile}.partial")
    partial.write_text(f"{os.getpid()} {grandchild.pid}")
    partial.replace(pidfile)  # a test that sees the file sees both pids
    print("spinning", flush=True)
    time.sleep(seconds)


def where(ctx: Any) -> dict[str, Any]:
    return {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "attempt": ctx.attempt}


def timed(ctx: Any, seconds: float) -> dict[str, float]:
    """Sleeps, and says when it started and ended (wall clock)."""
    start = time.time()
    time.sleep(seconds)
    return {"start": start, "end": time.time()}


def held(ctx: Any, release: str, timeout_s: float = 120) -> dict[str, float]:
    """Runs until the file `release` exists (the test says when; at most `timeout_s`), and
    says when it started and ended (wall clock)."""
    start = time.time()
    deadline = time.monotonic() + timeout_s
    while not Path(release).exists():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{release} did not appear within {timeout_s:g} s")
        time.sleep(0.05)
    return {"start": start, "end": time.time()}


def secret_hash(ctx: Any, name: str) -> str:
    """The sha256 of the environment variable `name` (a secret the job names): proof that the
    job saw it, without the value in its result."""
    import hashlib
    return hashlib.sha256(os.environ[name].encode()).hexdigest()


def gpu_window(ctx: Any, seconds: float) -> dict[str, Any]:
    """Holds its GPUs for `seconds`: says which (CUDA_VISIBLE_DEVICES), and when (wall clock)."""
    start = time.time()
    time.sleep(seconds)
    return {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""), "start": start,
            "end": time.time()}
