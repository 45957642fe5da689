"""Node-level placement for the fairness simulation (bench/fairness/nodesim.py).

The model the next build of gangs on demand and preemption follows (docs/scheduling.md,
"Design for gangs on demand and preemption"): a job of k GPUs takes k idle GPUs of one node
of its class or a bigger one (spill, bounded by `spill_max_s` as today); the scheduler picks
the node *and the GPU indexes*, so a reservation names exact GPUs and backfill is checked
against them; a `Ledger` per node says which job holds each GPU and refuses a second owner.
Pure and clock-free like `e31.scheduling.admission`: one `Tick` is one decision's view.

Policies (`PlaceConfig.policy`): `pack` (best fit: the node left with the fewest idle GPUs,
so small jobs fill partly busy nodes and whole nodes stay free for 8-GPU jobs), `first-fit`
(the first node in name order that fits) and `spread` (the node with the most idle GPUs, the
default of Kubernetes' LeastAllocated scoring). Every policy tries a job's own class first
and a bigger class only after (the smallest fitting class first).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from workload import CLASS_MEM_GB, NodeJob, NodeShape

POLICIES = ("pack", "first-fit", "spread")


class InvariantBroken(RuntimeError):
    """Raised when the simulation breaks a placement invariant (a GPU given twice, a
    non-preemptible or too young job preempted, a reservation backfilled)."""


class Ledger:
    """Which job holds each GPU of each node: the node-local allocation ledger (in the real
    worker a flock'd file per host that a claim checks and writes)."""

    def __init__(self, nodes: Iterable[NodeShape]) -> None:
        self.owner: dict[str, list[str | None]] = {n.name: [None] * n.gpus for n in nodes}

    def allocate(self, job_id: str, node: str, gpus: Sequence[int]) -> None:
        held = self.owner[node]
        if len(set(gpus)) != len(gpus):
            raise InvariantBroken(f"{job_id}: GPU listed twice in {list(gpus)} on {node}")
        for g in gpus:
            if held[g] is not None:
                raise InvariantBroken(f"GPU {node}:{g} given to {job_id} while {held[g]} holds it")
        for g in gpus:
            held[g] = job_id

    def release(self, job_id: str, node: str, gpus: Sequence[int]) -> None:
        held = self.owner[node]
        for g in gpus:
            if held[g] != job_id:
                raise InvariantBroken(f"{job_id} releases {node}:{g}, held by {held[g]}")
            held[g] = None

    def busy(self) -> int:
        return sum(o is not None for gpus in self.owner.values() for o in gpus)


@dataclass(frozen=True)
class PlaceConfig:
    """`exact`: the scheduler chooses the node and GPU indexes. Off, it only checks that the
    job has a place, and the job lands on the idle GPUs of any node that has k of them (as
    when Celery picks which idle worker of a class queue takes the message): the baseline
    that shows why the scheduler must choose."""

    policy: str = "pack"
    spill_max_s: float | None = 1800.0
    exact: bool = True

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: {self.policy!r} is not one of {', '.join(POLICIES)}")


@dataclass(frozen=True)
class Reservation:
    """GPUs `gpus` of `node` held for one big job from now until `start_s`; the job then
    holds them until `until_s` at the latest (its start + timeout_s)."""

    job_id: str
    node: str
    gpus: frozenset[int]
    start_s: float
    until_s: float


@dataclass(frozen=True)
class Running:
    """A running attempt as preemption sees it. `lost_s`: the work lost if stopped now (since
    its last checkpoint)."""

    job: NodeJob
    node: str
    gpus: tuple[int, ...]
    started_s: float
    lost_s: float


@dataclass(frozen=True)
class Preemption:
    """Stop `victims` so that `job_id` runs on `gpus` of `node` when they have exited."""

    job_id: str
    node: str
    victims: tuple[Running, ...]
    gpus: tuple[int, ...]


@dataclass
class Tick:
    """One decision's view: per node and GPU, None when idle, else when it should be free
    (its job's start + timeout_s). Placing a job fills its GPUs until now + its timeout_s."""

    now_s: float
    shapes: Mapping[str, NodeShape]
    until: dict[str, list[float | None]]
    cfg: PlaceConfig
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    reservations: list[Reservation] = field(default_factory=list)
    held: set[tuple[str, int]] = field(default_factory=set)   # held for a preemptor

    def reserved(self, node: str, job: NodeJob, *, backfill: bool = True) -> set[int]:
        """GPUs of `node` reserved for other jobs that `job` may not take: with `backfill`,
        only those whose reservation starts before the job would end."""
        return {g for r in self.reservations if r.node == node and r.job_id != job.id
                and not (backfill and self.now_s + job.timeout_s <= r.start_s) for g in r.gpus}

    def eligible(self, shape: NodeShape, job: NodeJob) -> bool:
        """The node's class is the job's or bigger (spill, if short enough), with k GPUs."""
        if shape.gpus < job.gpus or shape.mem_gb < CLASS_MEM_GB[job.size_class]:
            return False
        spill = shape.size_class != job.size_class
        return not (spill and self.cfg.spill_max_s is not None
                    and job.timeout_s > self.cfg.spill_max_s)

    def idle(self, node: str) -> list[int]:
        return [g for g, u in enumerate(self.until[node]) if u is None]

    def usable(self, node: str, job: NodeJob) -> list[int]:
        """Idle GPUs of `node` the job may take: reserved ones only if it ends before the
        reservation starts (backfill)."""
        reserved = self.reserved(node, job)
        return [g for g in self.idle(node) if g not in reserved]

    def _prefer(self, shape: NodeShape, job: NodeJob, order: int) -> tuple[float, ...]:
        spill = shape.mem_gb - CLASS_MEM_GB[job.size_class]      # own class first
        idle = len(self.idle(shape.name))
        if self.cfg.policy == "pack":
            return (spill, idle - job.gpus, order)
        if self.cfg.policy == "spread":
            return (spill, -idle, order)
        return (spill, order)

    def choose(self, job: NodeJob) -> tuple[str, tuple[int, ...]] | None:
        """The node and GPU indexes for `job` now, or None when none fits."""
        best: tuple[tuple[float, ...], str, list[int]] | None = None
        anywhere: list[str] = []          # nodes with k idle GPUs, reserved or not
        for order, (name, shape) in enumerate(self.shapes.items()):
            if not self.eligible(shape, job):
                continue
            if len(self.idle(name)) >= job.gpus:
                anywhere.append(name)
            ok = self.usable(name, job)
            if len(ok) < job.gpus:
                continue
            key = self._prefer(shape, job, order)
            if best is None or key < best[0]:
                best = (key, name, ok)
        if best is None:
            return None
        _, name, ok = best
        if not self.cfg.exact:   # the scheduler counted a place; any idle worker takes the job
            name = self.rng.choice(anywhere)
            return name, tuple(sorted(self.rng.sample(self.idle(name), job.gpus)))
        reserved = self.reserved(name, job, backfill=False)
        return name, tuple(sorted(sorted(ok, key=lambda g: (g in reserved, g))[:job.gpus]))

    def fill(self, node: str, gpus: Iterable[int], until_s: float) -> None:
        for g in gpus:
            self.until[node][g] = until_s

    def reserve(self, job: NodeJob) -> Reservation | None:
        """The k GPUs of one eligible node that should all be free earliest (a GPU reserved
        already is free when that reservation's job ends at the latest)."""
        best: Reservation | None = None
        for name, shape in self.shapes.items():
            if not self.eligible(shape, job):
                continue
            after = {g: r.until_s for r in self.reservations if r.node == name for g in r.gpus}
            bounds = sorted((max(self.now_s if u is None else u, after.get(g, -math.inf)), g)
                            for g, u in enumerate(self.until[name]))[:job.gpus]
            start_s = bounds[-1][0]
            if best is None or start_s < best.start_s:
                best = Reservation(job.id, name, frozenset(g for _, g in bounds), start_s,
                                   start_s + job.timeout_s)
        return best

    def plan_preemption(self, job: NodeJob, running_on: Mapping[str, Sequence[Running]],
                        over_by: Mapping[str, float], *, min_runtime_s: float,
                        lower_band_only: bool, soon_s: float = 0.0) -> Preemption | None:
        """The fewest preemptible jobs of tenants over their share (by `over_by`, GPUs held
        beyond the share) whose GPUs, with the node's idle ones and those that should be
        free within `soon_s`, make k on one node; ties: fewer GPUs stopped, less work lost.
        Never a reserved GPU, a job younger than `min_runtime_s` or one of the job's own
        tenant. `lower_band_only`: the job is not under its share, so only jobs of a lower
        priority band may go. With `soon_s`, the job holds the GPUs that free up soon as an
        exact reservation and starts when the last one is free."""
        best: tuple[tuple[float, ...], Preemption] | None = None
        for name, shape in self.shapes.items():
            if not self.eligible(shape, job):
                continue
            reserved = self.reserved(name, job, backfill=False)
            idle = [g for u, g in sorted((self.now_s if u is None else u, g)
                                         for g, u in enumerate(self.until[name]))
                    if g not in reserved and (name, g) not in self.held
                    and u <= self.now_s + soon_s]                        # idle ones first
            need = job.gpus - len(idle)
            if need <= 0:
                continue
            candidates = sorted(
                (v for v in running_on.get(name, ()) if v.job.preemptible
                 and not set(v.gpus) & set(idle)
                 and v.job.tenant != job.tenant and self.now_s - v.started_s >= min_runtime_s
                 and over_by.get(v.job.tenant, 0.0) > 0 and not set(v.gpus) & reserved
                 and (not lower_band_only or v.job.priority < job.priority)),
                key=lambda v: (-len(v.gpus), v.lost_s, v.job.id))
            over = dict(over_by)
            chosen: list[Running] = []
            freed = 0
            for v in candidates:     # largest first: the fewest jobs that free `need` GPUs
                if freed >= need:
                    break
                if over[v.job.tenant] > 0:
                    chosen.append(v)
                    freed += len(v.gpus)
                    over[v.job.tenant] -= len(v.gpus)
            if freed < need:
                continue
            gpus = tuple(sorted(([g for v in chosen for g in v.gpus] + idle)[:job.gpus]))
            key = (len(chosen), freed, sum(v.lost_s * len(v.gpus) for v in chosen))
            if best is None or key < best[0]:
                best = (key, Preemption(job.id, name, tuple(chosen), gpus))
        return None if best is None else best[1]


def fair_gpus(weights: Mapping[str, float], active: Iterable[str],
              total_gpus: int) -> dict[str, float]:
    """Each active tenant's share of the pool's GPUs, by weight (inactive ones: 0)."""
    names = set(active)
    total_w = sum(weights[t] for t in names) or 1.0
    return {t: (weights[t] / total_w * total_gpus if t in names else 0.0) for t in weights}


def lost_work_s(job: NodeJob, ran_s: float) -> float:
    """Work since the last checkpoint after `ran_s` of this attempt (all of it: none saved)."""
    if math.isinf(job.checkpoint_every_s):
        return ran_s
    return ran_s % job.checkpoint_every_s
