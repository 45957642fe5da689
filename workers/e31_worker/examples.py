"""Small entrypoints for the quick start, the docs and the tests. No downloads, no GPU needed."""

from __future__ import annotations

import os
import time
from typing import Any

from e31_worker.child.context import JobContext


def hello(ctx: JobContext, name: str = "world") -> dict[str, Any]:
    """Greets, writes one output file, and says where it ran."""
    (ctx.output_dir / "greeting.txt").write_text(f"hello, {name}\n")
    print(f"hello, {name} from job {ctx.job_id} attempt {ctx.attempt}")
    return {"greeting": f"hello, {name}", "device": ctx.device,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "")}


def sleep(ctx: JobContext, seconds: float = 1.0, steps: int = 10) -> dict[str, Any]:
    """Sleeps in `steps` steps, reporting progress; for cancel, timeout and queueing demos."""
    for i in range(steps):
        time.sleep(seconds / steps)
        ctx.progress(i + 1, steps)
    return {"slept_s": seconds, "pid": os.getpid()}


def flaky(ctx: JobContext, succeed_on: int = 3) -> dict[str, Any]:
    """Fails until attempt `succeed_on`; shows retries with back-off."""
    if ctx.attempt < succeed_on:
        raise RuntimeError(f"attempt {ctx.attempt} fails on purpose (succeeds on {succeed_on})")
    return {"attempt": ctx.attempt}


def matmul(ctx: JobContext, n: int = 512, repeats: int = 10) -> dict[str, Any]:
    """A small torch workload on `ctx.device` (the GPU when there is one)."""
    import torch

    a = torch.randn(n, n, device=ctx.device)
    b = torch.randn(n, n, device=ctx.device)
    start = time.perf_counter()
    for i in range(repeats):
        c = a @ b
        ctx.progress(i + 1, repeats)
    if ctx.device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return {"device": ctx.device, "gflops": round(2 * n ** 3 * repeats / elapsed / 1e9, 2),
            "checksum": float(c.sum().item())}


def resumable(ctx: JobContext, steps: int = 30, step_s: float = 1.0,
              crash_at: int = 0) -> dict[str, Any]:
    """Counts to `steps`, a checkpoint after each step, and resumes where it stopped
    (docs/reliability.md). `crash_at` fails the first attempt at that step, to show it."""
    state = ctx.load_checkpoint(default={"step": 0})     # {"step": 0} on the first attempt
    first = int(state["step"])
    ctx.log.info("attempt %d starts at step %d", ctx.attempt, first)
    for step in range(first, steps):
        time.sleep(step_s)                               # one unit of work
        ctx.save_checkpoint({"step": step + 1})          # stored by the next heartbeat
        ctx.progress(step + 1, steps)
        if ctx.attempt == 1 and step + 1 == crash_at:
            raise RuntimeError("simulated crash")        # the retry resumes from here
    return {"attempt": ctx.attempt, "resumed_from": first}
