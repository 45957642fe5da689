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


def trace(seed: int = 31) -> list[SimJob]:
    """a (weight 2) 400 jobs of 1 min-2 h plus an x4 job every 40 min; b 400 jobs of
    10 s-1 h; c floods 10,000 jobs of 10 s-30 min first; d, light, a 10-120 s job about
    every 3 minutes."""
    rng = random.Random(seed)
    jobs: list[SimJob] = []

    def add(tenant: str, at_s: float, low_s: float, high_s: float, gpus: int = 1) -> None:
        duration_s = _log_uniform(rng, low_s, high_s)
        jobs.append(SimJob(f"{tenant}{len(jobs)}", tenant, GPU80X4 if gpus == 4 else GPU80,
                           gpus, at_s, duration_s, duration_s * rng.uniform(*TIMEOUT_FACTOR)))

    for i in range(FLOOD_JOBS):
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
