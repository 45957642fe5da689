"""Entrypoints the chaos tests submit. Each one leaves a trail in `trail` (a directory):
one line per event, so a test can tell how often the work started and finished."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


def _mark(trail: str, event: str, ctx: Any) -> None:
    with open(Path(trail) / f"{ctx.job_id}.log", "a") as f:
        f.write(f"{event} attempt={ctx.attempt} pid={os.getpid()} t={time.time():.3f}\n")


def marked(ctx: Any, trail: str, seconds: float) -> dict[str, Any]:
    """Works for `seconds`, saying when it starts and when it is done."""
    _mark(trail, "start", ctx)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ctx.progress(seconds - (deadline - time.monotonic()), seconds)
        time.sleep(0.1)
    _mark(trail, "done", ctx)
    return {"attempt": ctx.attempt}


def checkpointed(ctx: Any, trail: str, steps: int, step_s: float) -> dict[str, Any]:
    """`steps` steps of `step_s`, a checkpoint after each; resumes from the last one."""
    first = (ctx.load_checkpoint(default={"step": 0}))["step"]
    _mark(trail, f"start step={first}", ctx)
    for step in range(first, steps):
        time.sleep(step_s)
        ctx.save_checkpoint({"step": step + 1})
        ctx.progress(step + 1, steps)
        _mark(trail, f"step={step + 1}", ctx)
    _mark(trail, "done", ctx)
    return {"resumed_from": first, "attempt": ctx.attempt}


def kill_worker(ctx: Any) -> None:
    """A poison job: SIGKILLs the worker process that supervises it."""
    import signal
    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(60)


def not_json(ctx: Any) -> object:
    """Returns something JSON cannot carry."""
    return {1, 2, 3}


def big_output(ctx: Any, trail: str, megabytes: int, release: str,
               timeout_s: float = 120) -> dict[str, Any]:
    """Writes an output file, says it is done, then returns once the file `release` exists
    (the test says when; at most `timeout_s`)."""
    _mark(trail, "start", ctx)
    block = b"x" * (1 << 20)
    with open(ctx.output_dir / "big.bin", "wb") as f:
        for _ in range(megabytes):
            f.write(block)
    _mark(trail, "done", ctx)
    deadline = time.monotonic() + timeout_s
    while not Path(release).exists():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{release} did not appear within {timeout_s:g} s")
        time.sleep(0.05)
    return {"attempt": ctx.attempt}
