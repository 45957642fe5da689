"""The trace and the pools for the fairness simulation (bench/fairness/sim.py).

Times are seconds of simulated time. Durations run from 10 s to two hours; every job's
timeout_s is its duration times 1.1-2.0 (users over-estimate), the bound backfill uses.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from e31.scheduling.admission import Slot

GPU80, GPU80X4 = "e31.gpu80", "e31.gpu80.x4"
HORIZON_S = 12 * 3600.0
FLOOD_JOBS = 10_000          # tenant c dumps these at t=0
OTHERS_START_S = 60.0        # a and b submit their backlog a minute after the flood
WEIGHTS = {"a": 2.0, "b": 1.0, "c": 1.0, "d": 1.0}
BACKLOGGED = ("a", "b", "c")
LIGHT = "d"
TIMEOUT_FACTOR = (1.1, 2.0)


@dataclass(frozen=True)
class SimJob:
    id: str
    tenant: str
    queue: str
    gpus: int
    submitted_at_s: float
    duration_s: float
    timeout_s: float


def _log_uniform(rng: random.Random, low_s: float, high_s: float) -> float:
    return math.exp(rng.uniform(math.log(low_s), math.log(high_s)))


def trace(seed: int = 31, *, flood_jobs: int = FLOOD_JOBS) -> list[SimJob]:
    """a (weight 2) 400 jobs of 1 min-2 h plus an x4 job every 40 min; b 400 jobs of
    10 s-1 h; c floods `flood_jobs` (10,000) jobs of 10 s-30 min first; d, light, a 10-120 s
    job about every 3 minutes."""
    rng = random.Random(seed)
    jobs: list[SimJob] = []

    def add(tenant: str, at_s: float, low_s: float, high_s: float, gpus: int = 1) -> None:
        duration_s = _log_uniform(rng, low_s, high_s)
        jobs.append(SimJob(f"{tenant}{len(jobs)}", tenant, GPU80X4 if gpus == 4 else GPU80,
                           gpus, at_s, duration_s, duration_s * rng.uniform(*TIMEOUT_FACTOR)))

    for i in range(flood_jobs):
        add("c", i * 1e-3, 10, 1800)
    for i in range(400):
        add("a", OTHERS_START_S + i * 1e-3, 60, 7200)
        add("b", OTHERS_START_S + i * 1e-3, 10, 3600)
    at_s = 600.0
    while at_s < HORIZON_S:
        add("a", at_s, 600, 3600, gpus=4)
        at_s += 2400.0
    at_s = 300.0
    while at_s < HORIZON_S:
        add("d", at_s, 10, 120)
        at_s += rng.expovariate(1 / 180.0)
    return sorted(jobs, key=lambda j: j.submitted_at_s)


def shared_pool() -> list[Slot]:
    """2 nodes × 8 gpu80: n0 one-GPU slots; n1 one-GPU slots plus two x4 slots over the
    same GPUs, so a 4-GPU job needs 4 free GPUs of n1 at once."""
    slots = [Slot(f"gpu{i}@n0", (GPU80,), frozenset({f"n0:{i}"})) for i in range(8)]
    slots += [Slot(f"gpu{i}@n1", (GPU80,), frozenset({f"n1:{i}"})) for i in range(8)]
    slots += [Slot(f"gpu{g}-{g + 3}@n1", (GPU80X4,), frozenset(f"n1:{i}" for i in range(g, g + 4)))
              for g in (0, 4)]
    return slots


def static_pool() -> list[Slot]:
    """The live launcher today: 12 one-GPU workers and one x4 group worker that spills
    onto the one-GPU queue (a one-GPU job there holds all four GPUs)."""
    slots = [Slot(f"gpu{i}@n0", (GPU80,), frozenset({f"n0:{i}"})) for i in range(8)]
    slots += [Slot(f"gpu{i}@n1", (GPU80,), frozenset({f"n1:{i}"})) for i in range(4)]
    slots.append(Slot("gpu4-7@n1", (GPU80X4, GPU80), frozenset(f"n1:{i}" for i in range(4, 8))))
    return slots


POOLS = {"shared": shared_pool, "static": static_pool}


# -- node level (bench/fairness/nodesim.py) ------------------------------------------------
#
# Real-shaped nodes: GPUs are allocated k at a time on one node, not as worker slots.

@dataclass(frozen=True)
class NodeShape:
    """One node: `gpus` GPUs of one size class (`mem_gb` orders the classes for spill)."""

    name: str
    size_class: str
    mem_gb: int
    gpus: int


@dataclass(frozen=True)
class NodeJob:
    """A job of the node-level trace. `duration_s` is its work; a preemptible job saves a
    checkpoint every `checkpoint_every_s` of work and resumes from the last one."""

    id: str
    tenant: str
    size_class: str
    gpus: int
    submitted_at_s: float
    duration_s: float
    timeout_s: float
    priority: int = 5
    preemptible: bool = False
    checkpoint_every_s: float = math.inf


CLASS_MEM_GB = {"gpu48": 48, "gpu80": 80}
NODE_WEIGHTS = {"a": 2.0, "b": 1.0, "c": 1.0, "d": 1.0}
NODE_LIGHT = "d"        # a 1-GPU job of 10-120 s about every 3 min
NODE_BIG = "b"          # an 8-GPU job every 30 min
CHECKPOINT_EVERY_S = 600.0   # a's training saves every 10 min of work


def node_pool(n80: int = 6, n48: int = 4) -> list[NodeShape]:
    """`n80` nodes of 8 × gpu80 and `n48` of 4 × gpu48 (64 GPUs by default)."""
    return ([NodeShape(f"h80-{i}", "gpu80", 80, 8) for i in range(n80)]
            + [NodeShape(f"h48-{i}", "gpu48", 48, 4) for i in range(n48)])


def node_trace(seed: int = 31, *, horizon_s: float = HORIZON_S, scale: float = 1.0,
               steady: bool = False) -> list[NodeJob]:
    """a (weight 2): 300 checkpointing training jobs of 1, 2 or 4 gpu80 GPUs, 20 min-4 h,
    preemptible; b: an 8 × gpu80 job of 20-90 min every 30 min, not preemptible; c: floods
    4,000 gpu48 jobs of 1 or 2 GPUs, 1-30 min, at t=0 (short ones spill onto gpu80); d, light:
    a 1 × gpu80 job of 10-120 s about every 3 min. `scale` shrinks the backlogs (tests).

    `steady`: no backlogs; a and c submit the same kinds of jobs as they go, a about every
    6.5 min and c about every 50 s: the default pool is about 70 % busy (measured), so
    the pool has idle GPUs and where they are decides whether an 8-GPU job fits."""
    rng = random.Random(seed)
    jobs: list[NodeJob] = []

    def add(tenant: str, at_s: float, size_class: str, gpus: int, low_s: float, high_s: float,
            preemptible: bool = False) -> None:
        duration_s = _log_uniform(rng, low_s, high_s)
        jobs.append(NodeJob(f"{tenant}{len(jobs)}", tenant, size_class, gpus, at_s, duration_s,
                            duration_s * rng.uniform(*TIMEOUT_FACTOR), preemptible=preemptible,
                            checkpoint_every_s=CHECKPOINT_EVERY_S if preemptible else math.inf))

    def c_job(at_s: float) -> None:
        add("c", at_s, "gpu48", rng.choices((1, 2), (0.8, 0.2))[0], 60, 1800)

    def a_job(at_s: float) -> None:
        add("a", at_s, "gpu80", rng.choices((1, 2, 4), (0.5, 0.3, 0.2))[0], 1200, 4 * 3600,
            preemptible=True)

    if steady:
        for every_s, submit in ((390.0, a_job), (50.0, c_job)):
            at_s = rng.expovariate(1 / every_s)
            while at_s < horizon_s:
                submit(at_s)
                at_s += rng.expovariate(1 / every_s)
    else:
        for i in range(int(4000 * scale)):
            c_job(i * 1e-3)
        for i in range(int(300 * scale)):
            a_job(OTHERS_START_S + i * 1e-3)
    at_s = 600.0
    while at_s < horizon_s:
        add(NODE_BIG, at_s, "gpu80", 8, 1200, 5400)
        at_s += 1800.0
    at_s = 300.0
    while at_s < horizon_s:
        add(NODE_LIGHT, at_s, "gpu80", 1, 10, 120)
        at_s += rng.expovariate(1 / 180.0)
    return sorted(jobs, key=lambda j: j.submitted_at_s)
