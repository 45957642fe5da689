"""`JobContext`: what a job's code gets as `ctx` (runs in the job's child process)."""

from __future__ import annotations

import json
import logging
import os
import pickle
import time
from pathlib import Path
from typing import Any

PROGRESS_MIN_INTERVAL_S = 0.2  # progress writes faster than this are coalesced
CHECKPOINT_FILE = "checkpoint.pt"


class JobContext:
    """The in-job SDK: params, device, output, checkpoint and input directories, progress.

    `input_dir` holds the spec's inputs, each as `input_dir / NAME`; `work_dir` is the
    attempt's scratch directory (the job starts in its code instead when it brought some)."""

    def __init__(self, *, job_id: str, attempt: int, params: dict[str, Any], output_dir: Path,
                 checkpoint_dir: Path, work_dir: Path, progress_path: Path | None,
                 gpus: str, input_dir: Path | None = None,
                 outputs_max_bytes: int | None = None) -> None:
        self.job_id = job_id
        self.attempt = attempt
        self.params = params
        self.output_dir = output_dir
        self.checkpoint_dir = checkpoint_dir
        self.work_dir = work_dir
        self.input_dir = input_dir if input_dir is not None else work_dir / "inputs"
        self.gpus = gpus
        # The most the job's stored outputs may hold (the pool's `job_outputs_max_bytes`);
        # None where the worker did not say
        self.outputs_max_bytes = outputs_max_bytes
        self.log = logging.getLogger(f"e31.job.{job_id}")
        self._progress_path = progress_path
        self._last_progress = 0.0
        self._device: str | None = None

    @classmethod
    def from_env(cls, params: dict[str, Any]) -> JobContext:
        env = os.environ
        return cls(job_id=env["E31_JOB_ID"], attempt=int(env.get("E31_ATTEMPT", "1")),
                   params=params, output_dir=Path(env["E31_OUTPUT_DIR"]),
                   checkpoint_dir=Path(env["E31_CHECKPOINT_DIR"]),
                   work_dir=Path(env.get("E31_SCRATCH_DIR") or Path.cwd()),
                   progress_path=(Path(env["E31_PROGRESS_PATH"])
                                  if env.get("E31_PROGRESS_PATH") else None),
                   gpus=env.get("CUDA_VISIBLE_DEVICES", ""),
                   input_dir=Path(env["E31_INPUT_DIR"]) if env.get("E31_INPUT_DIR") else None,
                   outputs_max_bytes=(int(env["E31_OUTPUTS_MAX_BYTES"])
                                      if env.get("E31_OUTPUTS_MAX_BYTES", "").isdigit()
                                      else None))

    @property
    def device(self) -> str:
        """`cuda` when this job was given a real GPU, else `cpu`. Initialises CUDA here, in the
        job."""
        if self._device is None:
            self._device = "cpu"
            if self.gpus:
                try:
                    import torch
                    if torch.cuda.is_available():
                        self._device = "cuda"
                except ImportError:
                    pass
        return self._device

    def input_path(self, path: str) -> str:
        """Where the job reads `path`: a URL (`s3://…`) or an absolute path as given, a relative
        one among its inputs (`input_dir / path`), which the worker staged for it. A sandboxed
        job sees no other file of its submitter's machine (docs/security.md)."""
        if "://" in path or os.path.isabs(path):
            return path
        return str(self.input_dir / path)

    def progress(self, done: float, total: float | None = None) -> None:
        """Report progress; the worker relays it to `e31 status` / `e31 wait`."""
        now = time.monotonic()
        final = total is not None and done >= total
        if self._progress_path is None or (now - self._last_progress < PROGRESS_MIN_INTERVAL_S
                                           and not final):
            return
        self._last_progress = now
        _atomic_write(self._progress_path, json.dumps({"done": done, "total": total}).encode())

    def save_checkpoint(self, obj: Any, name: str = CHECKPOINT_FILE) -> Path:
        """Save `obj` atomically (torch.save when torch is installed, else pickle)."""
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        path = self.checkpoint_dir / name
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            try:
                import torch
                torch.save(obj, f)
            except ImportError:
                pickle.dump(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path

    def load_checkpoint(self, name: str = CHECKPOINT_FILE, default: Any = None) -> Any:
        """The last saved checkpoint of this job (from any earlier attempt), or `default`."""
        path = self.checkpoint_dir / name
        if not path.is_file():
            return default
        try:
            import torch
            return torch.load(path, weights_only=False)
        except ImportError:
            with open(path, "rb") as f:
                return pickle.load(f)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
