"""Model factories for the workload end-to-end tests (on the workers' PYTHONPATH)."""

from __future__ import annotations

import os
import signal
from typing import Any

from e31_worker.workloads.models import digits_mlp


def killed_once_digits_mlp(kill_at_call: int, **kwargs: Any) -> Any:
    """`digits_mlp` whose process is SIGKILLed at forward call `kill_at_call`, on the first
    attempt only: a job killed mid-way, as by the kernel's OOM killer or a lost node."""
    return killed_once(digits_mlp(**kwargs), kill_at_call)


def killed_once(model: Any, kill_at_call: int) -> Any:
    """`model`, whose process is SIGKILLed at its forward call `kill_at_call` on the first
    attempt only."""
    if os.environ.get("E31_ATTEMPT") != "1":
        return model
    calls = [0]

    def hook(module: Any, args: Any) -> None:
        calls[0] += 1
        if calls[0] == kill_at_call:
            os.kill(os.getpid(), signal.SIGKILL)

    model.register_forward_pre_hook(hook)
    return model


def slow_digits_mlp(step_s: float, **kwargs: Any) -> Any:
    """`digits_mlp` that sleeps `step_s` before each forward call in training mode: a run long
    enough to be stopped part-way (its weights are those of `digits_mlp`)."""
    import time
    model = digits_mlp(**kwargs)

    def hook(module: Any, args: Any) -> None:
        if module.training:
            time.sleep(step_s)

    model.register_forward_pre_hook(hook)
    return model
