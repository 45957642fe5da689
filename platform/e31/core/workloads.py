"""Short names for the built-in workloads (control plane: no torch, no e31_worker import).

A job spec's `workload: train` stands for the entrypoint this table gives (`e31.core.spec`); the
workloads themselves live in `e31_worker.workloads` and are described in docs/workloads.md.
"""

from __future__ import annotations

WORKLOADS: dict[str, str] = {
    "batch-inference": "e31_worker.workloads.batch_inference:run",
    "train": "e31_worker.workloads.training:run",
    "footage": "e31_worker.workloads.footage:run",
    "llm": "e31_worker.workloads.llm:run",
}

