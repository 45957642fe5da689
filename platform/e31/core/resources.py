"""`Resources`: what a job needs of a node (GPUs and their memory, host memory, disk), and
what it asks when it runs out of memory."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from e31.core.strict import Strict, Whole

MAX_GPUS_PER_JOB = 8          # one node's worth; multi-node jobs are out of scope
MAX_HOST_MEM_GB = 16384       # host memory per job: more than any node has, so a typo is caught
MAX_DISK_GB = 1024 * 1024     # disk per attempt (a PiB): the pool's attempt_disk_max_gb is the
#                               real cap


class Resources(Strict):
    """What a job needs: GPUs and their memory, or a size class by name."""

    gpus: Whole = Field(default=1, ge=0, le=MAX_GPUS_PER_JOB,
                      description="GPUs on one node; 0 means the cpu class")
    gpu_mem_gb: float | None = Field(
        default=None, gt=0, description="memory per GPU; picks the smallest class that fits")
    size_class: str | None = Field(
        default=None, description="a size class by name, instead of gpu_mem_gb")
    mem_gb: float | None = Field(
        default=None, gt=0, le=MAX_HOST_MEM_GB,
        description="host memory the job may use; past it the kernel OOM-kills the job "
                    "(reason oom) where workers have cgroups")
    disk_gb: float | None = Field(
        default=None, gt=0, le=MAX_DISK_GB,
        description="disk the attempt's scratch, outputs and checkpoints may fill together; "
                    "past it the attempt ends with reason disk_quota; default: the pool's "
                    "attempt_disk_gb, at most its attempt_disk_max_gb")
    on_oom: Literal["fail", "next_class"] | None = Field(
        default=None,
        description="after an attempt that ran out of memory (reason oom): 'next_class' queues "
                    "the job again in the next bigger size class, 'fail' retries it in its own "
                    "class like any failure; default: the pool's on_oom_default")

    @model_validator(mode="after")
    def _consistent(self) -> Resources:
        if self.gpus == 0 and self.gpu_mem_gb is not None:
            raise ValueError("gpu_mem_gb needs gpus >= 1")
        return self
