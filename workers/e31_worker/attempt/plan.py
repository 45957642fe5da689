"""One attempt as the worker runs it: its plan (`AttemptPlan`: the spec, its GPUs, its
directories, its limits) and what the watch of a running child may ask for (`Directive`).

Every stage reads the plan; the setup's stages add to it (its secrets, its inputs' binds, its
environment) and the child's supervisor runs by it (e31_worker.attempt.stages).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from e31.core.spec import JobSpec
from e31.core.states import Start
from e31_worker.attempt.attemptlimits import AttemptLimits


class Directive(str, Enum):
    """What the supervisor's tick callback asks for."""

    CONTINUE = "continue"
    CANCEL = "cancel"         # the owner cancelled the job
    DRAIN = "drain"           # the worker is shutting down: stop and requeue
    PREEMPT = "preempt"       # the scheduler gives its GPUs to another job: stop and requeue
    LOST = "lost"             # the lease is gone: stop, record nothing
    IDLE = "idle"             # its watchdog: no sign of work for idle_timeout_s (on_idle: kill)
    GPU_FAULT = "gpu_fault"   # the node drains for its GPU's error: stop and requeue, the pool's


@dataclass(frozen=True)
class AttemptPlan:
    """One attempt as the supervisor runs it: the job's spec, its GPUs, its directory, limits."""

    job_id: str
    attempt: int
    spec: JobSpec
    gpus: str                 # CUDA_VISIBLE_DEVICES for the child ("" for the cpu class)
    root: Path                # fresh directory of this attempt
    kill_grace_s: float
    log_max_bytes: int        # this attempt's log
    tick_interval_s: float
    job_log_max_bytes: int | None = None  # all the job's attempts together; None: no such cap
    log_earlier_bytes: int = 0            # what the job's other attempts' logs hold already
    venv: Path | None = None              # the job's own environment (`python:`); None: the
    #                                       worker's (e31_worker.attempt.environment)
    # The job's secrets by name, decrypted at setup (e31_worker.attempt.secrets): the child's
    # environment only; never in a repr, a log line or a file.
    secret_env: dict[str, str] = dataclasses.field(default_factory=dict, repr=False)
    # What the job inherits of the worker's environment beyond e31_worker.attempt.jobenv's
    # allowlist: names or globs (settings `job_env_passthrough`).
    env_passthrough: tuple[str, ...] = ()
    # Local input files staged as links, bound read-only into the sandbox (attempt/inputs.py).
    input_binds: tuple[Path, ...] = ()
    # What it may use of processes, memory and disk (e31_worker.attempt.attemptlimits); a field left
    # None is not applied, but for memory, which then falls back to `resources.mem_gb`.
    limits: AttemptLimits = AttemptLimits()
    # The most one job's stored outputs may hold (settings `job_outputs_max_bytes`), told to the
    # job as E31_OUTPUTS_MAX_BYTES: a function job's value over it fails with that reason.
    outputs_max_bytes: int | None = None

    @property
    def python(self) -> str:
        """The interpreter of the job: its own environment's, else the worker's."""
        return str(self.venv / "bin" / "python") if self.venv else sys.executable

    def make_dirs(self) -> None:
        """The attempt's directories: its root, and the job's work, output and checkpoints."""
        for d in (self.work_dir, self.output_dir, self.checkpoint_dir):
            d.mkdir(parents=True, exist_ok=True)

    @property
    def log_limit(self) -> tuple[int, str]:
        """The most bytes this attempt's log may take, and the line that says where and why
        it was cut: the attempt's own cap, or what is left of the job's across attempts."""
        if self.job_log_max_bytes is not None:
            room = max(0, self.job_log_max_bytes - self.log_earlier_bytes)
            if room < self.log_max_bytes:
                return room, (f"\n[e31: log cut at {room} bytes: this job's logs reached "
                              f"job_log_max_bytes={self.job_log_max_bytes} across its attempts "
                              f"({self.log_earlier_bytes} bytes before this attempt); the rest "
                              f"was discarded]\n")
        return self.log_max_bytes, (f"\n[e31: log cut at {self.log_max_bytes} bytes; the rest "
                                    f"was discarded]\n")

    @property
    def memory_max_bytes(self) -> int | None:
        """The job's host-memory cap, enforced by its cgroup: its limits' (`resources.mem_gb`,
        else the pool's default), else `resources.mem_gb`."""
        mem_gb = self.limits.mem_gb or self.spec.resources.mem_gb
        return int(mem_gb * 1024 ** 3) if mem_gb else None

    @property
    def job_writes(self) -> tuple[Path, ...]:
        """The trees the job writes whose room its disk limit counts (docs/jobs.md)."""
        return (self.work_dir, self.output_dir, self.checkpoint_dir)

    @property
    def work_dir(self) -> Path:
        return self.root / "work"

    @property
    def output_dir(self) -> Path:
        return self.root / "output"

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / "checkpoints"

    @property
    def log_path(self) -> Path:
        return self.root / "attempt.log"

    @property
    def progress_path(self) -> Path:
        return self.root / "progress.json"

    @property
    def code_dir(self) -> Path:
        """The job's code bundle, unpacked read-only (only when its spec names one: `code`)."""
        return self.root / "code"

    @property
    def input_dir(self) -> Path:
        """Where the job's inputs are staged, one entry per name ($E31_INPUT_DIR)."""
        return self.root / "inputs"

    @property
    def cwd(self) -> Path:
        """Where the job starts: in its code when it brought some, else in its work dir."""
        return self.code_dir if self.spec.code is not None else self.work_dir


Tick = Callable[[tuple[float, float] | None], Directive]
OnStart = Callable[[float, Start], None]
OnLimits = Callable[[AttemptLimits], None]
