"""Short names for the built-in workloads (control plane: no torch, no e31_worker import).

`resolve("batch-inference")` gives the entrypoint a job spec names; the workloads
themselves live in `e31_worker.workloads` and are described in docs/workloads.md.
"""

from __future__ import annotations

from e31.errors import SpecError

WORKLOADS: dict[str, str] = {
    "batch-inference": "e31_worker.workloads.batch_inference:run",
    "train": "e31_worker.workloads.training:run",
    "footage": "e31_worker.workloads.footage:run",
}


def resolve(name: str) -> str:
    """The entrypoint of the built-in workload `name`; SpecError naming the known ones else."""
    try:
        return WORKLOADS[name]
    except KeyError:
        known = ", ".join(sorted(WORKLOADS))
        raise SpecError.one("workload", f"unknown workload {name!r}; known: {known}") from None
