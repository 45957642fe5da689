"""Entrypoints of tests/e2e/test_placement.py (on the workers' PYTHONPATH)."""

from __future__ import annotations

import os
from typing import Any


class OutOfMemoryError(RuntimeError):
    """Stands for torch.cuda.OutOfMemoryError, which the runner knows by its name: the
    attempt ends with reason oom, as a real CUDA OOM's does (e31_worker.child.runner)."""


def needs_more_than(ctx: Any, small_gpus: str = "0") -> dict[str, Any]:
    """A job that does not fit the memory of the GPUs `small_gpus` (the stack's 24 GB GPU): a
    CUDA OOM there, success on any other."""
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if gpu in small_gpus.split(","):
        raise OutOfMemoryError(f"CUDA out of memory. Tried to allocate 30.00 GiB (GPU {gpu}; "
                               "23.99 GiB total capacity)")
    return {"cuda_visible_devices": gpu, "attempt": ctx.attempt}
