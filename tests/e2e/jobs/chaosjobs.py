"""Entrypoints the chaos tests submit. Each one leaves a trail in `trail` (a directory):
one line per event, so a test can tell how often the work started and finished."""

from __future__ import annotations

import os
import signal
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
    # A step's checkpoint and its trail line are written together: a drain's SIGTERM between
    # the two would leave a checkpoint the trail does not show. So SIGTERM is noted, and the
    # job dies of it (as it would have) once the step's line is written.
    terms: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: terms.append(signum))
    for step in range(first, steps):
        time.sleep(step_s)
        ctx.save_checkpoint({"step": step + 1})
        _mark(trail, f"step={step + 1}", ctx)
        if terms:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        ctx.progress(step + 1, steps)
    _mark(trail, "done", ctx)
    return {"resumed_from": first, "attempt": ctx.attempt}


def kill_worker(ctx: Any) -> None:
    """A poison job: SIGKILLs the worker process that supervises it. A cold job is the
    worker's child; a warm one is forked from its warm process, under an outer process of its
    own, so the job looks up its ancestors for the worker (`e31_worker.node.celery_process`)."""
    pid = os.getppid()
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"e31_worker.node.celery_process" in f.read():
                break
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    os.kill(pid if pid > 1 else os.getppid(), signal.SIGKILL)
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
