"""`AttemptServices`: what an attempt needs from the worker process that runs it.

The node layer (`e31_worker.node.celery_process`) builds it once per process; every stage
of an attempt reads it and nothing else of the process. It points down only: the attempt
layer never imports the node layer, and learns that the node is draining, or tells it
which job it holds, through the two members the node hands in (`draining`, `busy`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import redis

from e31.core.states import Isolation
from e31.edge.artifacts import ArtifactStore
from e31.edge.settings import Settings
from e31.ops.heartbeat import GpuSample, WorkerInfo
from e31.store import AttemptStore
from e31_worker.attempt.cgroups import JobCgroups
from e31_worker.attempt.gangs import GpuLedger, ledger_for
from e31_worker.attempt.groups import GroupRegistry
from e31_worker.attempt.sandbox import Sandbox
from e31_worker.attempt.spawn import Spawner
from e31_worker.attempt.warm import WarmPool, WarmStarter


class GpuSampler(Protocol):
    """The worker's GPUs as its attempts read them (`e31_worker.node.telemetry.GpuMonitor`)."""

    def sample(self, job_active: bool | None) -> tuple[GpuSample, ...]:
        """Read every GPU of the worker now; `job_active` says whether the job showed work
        since the last reading (simulated GPUs follow it; real ones report what they do)."""
        ...


class HeldGpus:
    """The readings of some GPUs of a sampler that reads more: those an attempt on a gang host
    holds, of its worker's monitor of all the host's GPUs (docs/scheduling.md, "Gangs on
    demand"). `gpus`: the indexes, "0,1"."""

    def __init__(self, sampler: GpuSampler, gpus: str) -> None:
        self._sampler = sampler
        self._indexes = frozenset(int(i) for i in gpus.split(",") if i.strip())

    def sample(self, job_active: bool | None) -> tuple[GpuSample, ...]:
        return self._only(self._sampler.sample(job_active))

    def _only(self, samples: tuple[GpuSample, ...]) -> tuple[GpuSample, ...]:
        return tuple(s for s in samples if s.index in self._indexes)


@dataclass(frozen=True)
class AttemptServices:
    """The worker process's settings, identity and connections, as its attempts see them."""

    settings: Settings
    identity: WorkerInfo            # the node name, its queues and its GPUs
    repo: AttemptStore
    artifacts: ArtifactStore
    redis: redis.Redis              # the broker's Redis: the scheduler's wake-up signal
    groups: GroupRegistry | None    # the job process groups running, for a successor to reap
    cgroups: JobCgroups | None      # None where this process may not create cgroups
    draining: threading.Event       # set when the node stops: a running job is requeued
    busy: Callable[[str | None], None]  # told the job in hand (None when idle), for heartbeats
    sandbox: Sandbox | None = None  # None: jobs run as the worker's user (`--isolation process`)
    gpus: GpuSampler | None = None  # None: a cpu slot, or GPUs without telemetry (no NVML)
    warm: WarmStarter | WarmPool | None = None  # warm processes; None: all start cold
    spawner: Spawner | None = None  # forks the cold children; None: the worker process does
    # The memory of an attempt that asks no resources.mem_gb, resolved at start
    # (e31_worker.attempt.attemptlimits.default_mem_gb); None: such attempts have no memory limit.
    default_mem_gb: float | None = None
    # When the worker's heartbeat last reached Redis (time.monotonic()); by default always
    # now: a worker without heartbeats never counts itself unheard (LeaseKeeper).
    last_beat: Callable[[], float] = time.monotonic
    # Set with `draining` when the node drains for its GPU's error (an XID): the running job
    # ends `gpu_fault`, the pool's, rather than `drained`.
    gpu_fault: threading.Event = field(default_factory=threading.Event)

    def gpu_ledger(self) -> GpuLedger:
        """A gang worker's host GPU ledger (`e31_worker.attempt.gangs`)."""
        return ledger_for(self.settings.resolved_work_dir, self.identity.host)

    @property
    def isolation(self) -> Isolation:
        """How this worker's attempts are kept apart, as each one records it."""
        return Isolation.SANDBOX if self.sandbox is not None else Isolation.PROCESS
