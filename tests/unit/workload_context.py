"""What the in-process workload tests share: a JobContext laid out as the worker lays it
out, and torch kept to one thread."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from e31_worker.child.context import JobContext


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread, and the test machine's cores are shared."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_ctx(root: Path, attempt: int = 1, gpus: str = "") -> JobContext:
    """A context like the worker's: a fresh output dir per attempt, the job's checkpoints."""
    dirs = {name: root / name for name in (f"output-{attempt}", "checkpoints", f"work-{attempt}")}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    return JobContext(job_id="j-test", attempt=attempt, params={},
                      output_dir=dirs[f"output-{attempt}"], checkpoint_dir=dirs["checkpoints"],
                      work_dir=dirs[f"work-{attempt}"], progress_path=root / "progress.json",
                      gpus=gpus)
