"""Frame models for the footage fan-out's end-to-end tests (on the workers' PYTHONPATH)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from e31_worker.workloads.models import frame_classifier


def killed_once_frame_classifier(kill_at_call: int) -> Any:
    """`frame_classifier` whose process is SIGKILLed at forward call `kill_at_call`, on the
    first attempt only: a chunk killed mid-way, as by the OOM killer or a lost node."""
    model = frame_classifier()
    if os.environ.get("E31_ATTEMPT") != "1":
        return model
    calls = [0]

    def hook(module: Any, args: Any) -> None:
        calls[0] += 1
        if calls[0] == kill_at_call:
            os.kill(os.getpid(), signal.SIGKILL)

    model.register_forward_pre_hook(hook)
    return model


def frame_classifier_failing_while(path: str) -> Any:
    """`frame_classifier` that fails to build while `path` exists: items that fail until
    someone mends the cause (removes the file)."""
    if Path(path).exists():
        raise RuntimeError(f"{path} exists: this item fails")
    return frame_classifier()
