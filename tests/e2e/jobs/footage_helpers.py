"""Frame models for the footage fan-out's end-to-end tests (on the workers' PYTHONPATH)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workload_helpers import killed_once

from e31_worker.workloads.models import frame_classifier


def killed_once_frame_classifier(kill_at_call: int) -> Any:
    """`frame_classifier` whose process is SIGKILLed at forward call `kill_at_call`, on the
    first attempt only: a chunk killed mid-way, as by the OOM killer or a lost node."""
    return killed_once(frame_classifier(), kill_at_call)


def frame_classifier_failing_while(path: str) -> Any:
    """`frame_classifier` that fails to build while `path` exists: items that fail until
    someone mends the cause (removes the file)."""
    if Path(path).exists():
        raise RuntimeError(f"{path} exists: this item fails")
    return frame_classifier()
