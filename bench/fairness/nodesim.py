"""Node-level simulation: gangs on demand on real-shaped nodes, packing, exact reservations
and preemption that resumes (docs/scheduling.md, "Node-level placement and preemption").

    python bench/fairness/nodesim.py              # writes into a new temporary directory
    python bench/fairness/nodesim.py --refresh    # rewrites the tracked figures the docs show

The pool (`workload.node_pool`): 6 nodes of 8 × gpu80 and 4 of 4 × gpu48. The trace
(`workload.node_trace`): a's checkpointing training jobs (1/2/4 GPUs, preemptible), b's
8-GPU jobs, c's short gpu48 jobs, d's light 1-GPU jobs; `flood` (backlogs: the pool is
always full) and `steady` (no backlogs, about 70 % busy). The fair order is the real one
(`e31.scheduling.fairshare.Tenant.key` over decayed usage, `sim.accrue`); the node and GPU
choice, the reservations and preemption are `nodes.Tick`. Runs the variants of `RUNS`
(placement policy, exact or inexact GPU choice, reservation rule, preemption) on the flood
trace and `STEADY_RUNS` on the steady one; prints the figures and stores them under
"nodes" of a results.json in a new temporary directory it names, so a reader's run leaves the
repository as it was (issue 32; `--json FILE` there, `--refresh` the tracked
bench/fairness/results.json that docs/scheduling.md quotes). Raises `InvariantBroken` if a
GPU is given twice, a non-preemptible or too young job is preempted, or (exact runs) a
reservation is broken.

    python bench/fairness/nodesim.py --smoke --out nodes.json   # the suite's run (tests/bench)

`--smoke`: 2 simulated hours of a trace with a twentieth of the backlogs, two variants with
preemption and exact reservations on it and one on the steady trace, results.json left as it
is; `--out FILE` writes the figures there.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import math
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from nodes import (
    InvariantBroken,
    Ledger,
    PlaceConfig,
    Preemption,
    Reservation,
    Running,
    Tick,
    fair_gpus,
    lost_work_s,
)
from sim import UNSAID, accrue, place_outputs

from e31.core.usage import UsageState
from e31.scheduling.fairshare import Tenant

from report import parse, save
from workload import (
    HORIZON_S,
    NODE_BIG,
    NODE_LIGHT,
    NODE_WEIGHTS,
    NodeJob,
    NodeShape,
    node_pool,
    node_trace,
)

ROOT = Path(__file__).resolve().parents[2]
HEAD_K = 16              # candidates per tenant per decision, as the live store's heads
PREEMPTORS_PER_TICK = 2  # bounds one tick's preemption work
ALL = "all"              # the fair key counts a tenant's GPUs of every class together


@dataclass(frozen=True)
class SimConfig:
    """`preempt_grace_s`: how long a qualifying job waits before it may preempt;
    `min_runtime_s`: how long a (re)started job runs before it may be preempted (again);
    `kill_grace_s`: SIGTERM to exit, the GPUs held meanwhile."""

    place: PlaceConfig = PlaceConfig()
    half_life_s: float = 2 * 3600.0
    reserve_after_s: float = 600.0
    big_job_min_gpus: int = 2
    max_reservations: int = 1  # today's policy: one at a time (EASY backfilling)
    overdue_order: str = "age"   # today's: oldest first; "fair": band, share key, age
    preemption: bool = False
    preempt_grace_s: float = 900.0
    min_runtime_s: float = 1800.0
    kill_grace_s: float = 60.0
    preempt_soon_s: float = 900.0   # a preemptor also waits this long for other jobs to end
    tick_s: float = 10.0
    horizon_s: float = HORIZON_S
    strict: bool = True        # raise on a broken reservation instead of counting it


class NodeSim:
    """One run of a configuration over a trace."""

    def __init__(self, cfg: SimConfig, pool: Sequence[NodeShape], jobs: Sequence[NodeJob],
                 *, seed: int = 0) -> None:
        self.cfg, self.jobs = cfg, list(jobs)
        self.shapes = {n.name: n for n in pool}
        self.total_gpus = sum(n.gpus for n in pool)
        self.ledger = Ledger(pool)
        self.rng = random.Random(seed)
        self.queued: dict[str, list[tuple[int, float, str]]] = defaultdict(list)  # sorted keys
        self.by_id = {j.id: j for j in jobs}
        self.work_left = {j.id: j.duration_s for j in jobs}
        self.running: dict[str, Running] = {}
        self.attempt: dict[str, int] = defaultdict(int)
        self.stopping: dict[str, float] = {}                 # victim -> when it has exited
        self.holds: dict[str, tuple[str, tuple[int, ...], set[str], float]] = {}
        self.usage: dict[str, UsageState] = defaultdict(UsageState)
        self.events: list[tuple[float, int, str, str, int]] = []
        self.seq = 0
        self.first_start: dict[str, float] = {}
        self.finished: dict[str, float] = {}
        self.reserved_first: dict[str, float] = {}           # big job -> its first reserved start
        self.reservations: list[Reservation] = []            # this (or the last) decision's
        self.reserved_before: dict[str, float] = {}          # job -> start, last decision
        self.n: dict[str, float] = defaultdict(float)  # counters, integrals
        self.victims_on: dict[str, list[Running]] | None = None   # per decision, when needed
        self.ran_s: dict[str, float] = defaultdict(float)    # job -> time held GPUs (billed)
        self.times_preempted: dict[str, int] = defaultdict(int)

    # -- state -------------------------------------------------------------------------------

    def queue(self, job: NodeJob) -> None:
        bisect.insort(self.queued[job.tenant], (-job.priority, job.submitted_at_s, job.id))

    def unqueue(self, job: NodeJob) -> None:
        q = self.queued[job.tenant]
        q.pop(bisect.bisect_left(q, (-job.priority, job.submitted_at_s, job.id)))

    def running_gpus(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for r in self.running.values():
            out[r.job.tenant] += len(r.gpus)
        return out

    def holding_gpus(self) -> dict[str, int]:
        """GPUs per tenant as fairness sees them: running jobs not being stopped, and the
        GPUs held for its preemptors."""
        out: dict[str, int] = defaultdict(int)
        for r in self.running.values():
            if r.job.id not in self.stopping:
                out[r.job.tenant] += len(r.gpus)
        for job_id, (_, gpus, _, _) in self.holds.items():
            out[self.by_id[job_id].tenant] += len(gpus)
        return out

    def waiting(self) -> bool:
        return bool(self.holds) or any(self.queued.values())

    def push(self, at_s: float, kind: str, job_id: str) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at_s, self.seq, kind, job_id, self.attempt[job_id]))

    def account(self, t0_s: float, t1_s: float) -> None:
        if t1_s <= t0_s:
            return
        dt = t1_s - t0_s
        running = self.running_gpus()
        busy = sum(running.values())
        if self.waiting():
            self.n["busy_while_waiting_gpu_s"] += busy * dt
            self.n["capacity_while_waiting_gpu_s"] += self.total_gpus * dt
        self.n["busy_gpu_s"] += busy * dt
        big_waits = any(self.by_id[k[2]].gpus >= 8 for k in self.queued[NODE_BIG])
        if big_waits:
            self.n["big_wait_s"] += dt
            self.n["idle_while_big_waits_gpu_s"] += (self.total_gpus - busy) * dt
        for tenant in NODE_WEIGHTS:
            self.usage[tenant] = accrue(self.usage[tenant], running.get(tenant, 0), t1_s,
                                        self.cfg.half_life_s)

    # -- start, end, preempt -----------------------------------------------------------------

    def start(self, job: NodeJob, node: str, gpus: tuple[int, ...], now_s: float) -> None:
        self.check_reservation(job, node, gpus, now_s)
        self.ledger.allocate(job.id, node, gpus)
        self.attempt[job.id] += 1
        self.running[job.id] = Running(job, node, gpus, now_s, 0.0)
        self.first_start.setdefault(job.id, now_s)
        self.push(now_s + self.work_left[job.id], "end", job.id)

    def check_reservation(self, job: NodeJob, node: str, gpus: Sequence[int], now_s: float) -> None:
        """Independent of the policy: a job on reserved GPUs must end before the reservation,
        and a job that held a reservation in the last decision starts by its start."""
        if now_s > self.reserved_before.get(job.id, math.inf) + 1e-6:
            self.n["reserved_jobs_started_late"] += 1
        for r in self.reservations:
            if (r.job_id == job.id or r.node != node or not set(gpus) & r.gpus
                    or now_s + job.timeout_s <= r.start_s):
                continue
            self.n["reservation_violations"] += 1
            if self.cfg.strict:
                raise InvariantBroken(f"{job.id} (ends by {now_s + job.timeout_s:.0f}) backfilled "
                                      f"onto {node}:{sorted(set(gpus) & r.gpus)} reserved for "
                                      f"{r.job_id} from {r.start_s:.0f}")

    def release(self, job_id: str, now_s: float) -> Running:
        """Free the job's GPUs; its attempt ran (and is billed) until now."""
        r = self.running.pop(job_id)
        self.ledger.release(job_id, r.node, r.gpus)
        self.ran_s[job_id] += now_s - r.started_s
        return r

    def preempt(self, plan: Preemption, now_s: float, free_s: float) -> None:
        job = self.by_id[plan.job_id]
        for v in plan.victims:
            if not v.job.preemptible:
                raise InvariantBroken(f"{v.job.id} is not preemptible")
            if now_s - v.started_s < self.cfg.min_runtime_s:
                raise InvariantBroken(f"{v.job.id} preempted {now_s - v.started_s:.0f} s after "
                                      f"its start (min {self.cfg.min_runtime_s:.0f} s)")
            self.stopping[v.job.id] = now_s + self.cfg.kill_grace_s
            self.push(now_s + self.cfg.kill_grace_s, "stopped", v.job.id)
            self.n["preemptions"] += 1
        self.unqueue(job)
        self.holds[job.id] = (plan.node, plan.gpus, {v.job.id for v in plan.victims}, free_s)
        self.n["preemptors"] += 1

    def stopped(self, job_id: str, now_s: float) -> None:
        """A victim has exited after its grace: requeued, resuming from its last checkpoint."""
        r = self.release(job_id, now_s)
        self.times_preempted[job_id] += 1
        stop_s = self.stopping.pop(job_id) - self.cfg.kill_grace_s
        ran_s = stop_s - r.started_s
        lost_s = lost_work_s(r.job, ran_s)
        self.work_left[job_id] -= ran_s - lost_s
        self.n["lost_gpu_s"] += (lost_s + self.cfg.kill_grace_s) * len(r.gpus)
        self.attempt[job_id] += 1       # its pending end event is stale now
        self.queue(r.job)
        self.release_holds(now_s)

    def release_holds(self, now_s: float) -> None:
        for job_id, (node, gpus, _, _) in list(self.holds.items()):
            if all(self.ledger.owner[node][g] is None for g in gpus):   # victims have exited
                del self.holds[job_id]
                self.start(self.by_id[job_id], node, gpus, now_s)

    # -- one decision --------------------------------------------------------------------------

    def view(self, now_s: float) -> Tick:
        until: dict[str, list[float | None]] = {}
        for node, owners in self.ledger.owner.items():
            until[node] = [None if o is None else self.stopping.get(
                o, self.running[o].started_s + self.running[o].job.timeout_s) for o in owners]
        for job_id, (node, gpus, _, free_s) in self.holds.items():
            for g in gpus:       # the preemptor's bound once it starts there
                until[node][g] = free_s + self.by_id[job_id].timeout_s
        held = {(node, g) for node, gpus, _, _ in self.holds.values() for g in gpus}
        return Tick(now_s, self.shapes, until, self.cfg.place, self.rng, held=held)

    def decide(self, now_s: float) -> None:
        t = self.view(now_s)
        running = self.holding_gpus()
        self.victims_on = None
        tenants = {name: Tenant(name, weight=w,
                                usage_gpu_s=self.usage[name].at(now_s, self.cfg.half_life_s),
                                running_gpus={ALL: running.get(name, 0)})
                   for name, w in NODE_WEIGHTS.items()}
        active = {n for n in NODE_WEIGHTS if running.get(n) or self.queued[n]}
        share = fair_gpus(NODE_WEIGHTS, active, self.total_gpus)
        over_by = {n: running.get(n, 0) - share[n] for n in NODE_WEIGHTS}
        preemptors = self.serve_overdue(t, now_s, tenants, over_by, share)
        self.serve_fair(t, now_s, tenants)
        if self.cfg.preemption:
            self.preempt_for_waiting(t, now_s, tenants, over_by, share, preemptors)

    def heads(self, tenant: str) -> list[NodeJob]:
        return [self.by_id[k[2]] for k in self.queued[tenant][:HEAD_K]]

    def place(self, t: Tick, job: NodeJob, now_s: float, tenants: dict[str, Tenant]) -> bool:
        where = t.choose(job)
        if where is None:
            return False
        node, gpus = where
        self.unqueue(job)
        self.start(job, node, gpus, now_s)
        t.fill(node, gpus, now_s + job.timeout_s)
        tenants[job.tenant] = tenants[job.tenant].with_admitted(ALL, job.gpus)
        return True

    def serve_overdue(self, t: Tick, now_s: float, tenants: dict[str, Tenant],
                      over_by: dict[str, float], share: dict[str, float]) -> int:
        """Overdue big jobs first, oldest first; one that cannot start may preempt (past its
        grace, when its reservation is further off than that), or else reserves while fewer
        than `max_reservations` are held. Reservations made in this decision hold for the
        rest of it (`start` checks every placement against them)."""
        self.reserved_before = {r.job_id: r.start_s for r in self.reservations}
        self.reservations = t.reservations = []
        preemptors = 0
        fair = self.cfg.overdue_order == "fair"
        overdue = sorted((j for n in NODE_WEIGHTS for j in self.heads(n)
                          if j.gpus >= self.cfg.big_job_min_gpus
                          and now_s - j.submitted_at_s >= self.cfg.reserve_after_s),
                         key=lambda j: (-j.priority, tenants[j.tenant].key(
                                            self.cfg.half_life_s) if fair else 0.0,
                                        j.submitted_at_s, j.id))
        failed: set[tuple[str, int]] = set()
        no_plan: set[tuple[str, str, int, bool]] = set()
        for job in overdue:
            if (job.size_class, job.gpus) not in failed and self.place(t, job, now_s, tenants):
                continue
            failed.add((job.size_class, job.gpus))
            may_reserve = len(t.reservations) < self.cfg.max_reservations
            may_preempt = (self.cfg.preemption and preemptors < PREEMPTORS_PER_TICK
                           and now_s - job.submitted_at_s >= self.cfg.preempt_grace_s)
            spill = job.timeout_s <= (self.cfg.place.spill_max_s or math.inf)
            shape = (job.tenant, job.size_class, job.gpus, spill)
            may_preempt = may_preempt and shape not in no_plan
            if not (may_reserve or may_preempt):
                continue
            r = t.reserve(job)
            if may_preempt and r is not None and r.start_s > now_s + self.cfg.preempt_grace_s:
                if self.try_preempt(t, job, now_s, tenants, over_by, share):
                    preemptors += 1
                    continue
                no_plan.add(shape)
            if r is not None and may_reserve:
                t.reservations.append(r)
                self.reserved_first.setdefault(job.id, r.start_s)
        return preemptors

    def serve_fair(self, t: Tick, now_s: float, tenants: dict[str, Tenant]) -> None:
        """Each tenant's head in fair order (band, share key, age), re-ranked after each start."""
        streams = {n: self.heads(n) for n in NODE_WEIGHTS}
        failed: set[tuple[str, int, bool, bool]] = set()
        first = min((r.start_s for r in t.reservations), default=math.inf)
        while True:
            live = [n for n, s in streams.items() if s]
            if not live:
                return
            name = min(live, key=lambda n: (-streams[n][0].priority,
                                            tenants[n].key(self.cfg.half_life_s),
                                            streams[n][0].submitted_at_s))
            job = streams[name].pop(0)
            shape = (job.size_class, job.gpus,
                     job.timeout_s <= (self.cfg.place.spill_max_s or math.inf),
                     now_s + job.timeout_s <= first)
            if shape in failed:
                continue
            if not self.place(t, job, now_s, tenants):
                failed.add(shape)

    def try_preempt(self, t: Tick, job: NodeJob, now_s: float, tenants: dict[str, Tenant],
                    over_by: dict[str, float], share: dict[str, float]) -> bool:
        under = tenants[job.tenant].running_total() + job.gpus <= share[job.tenant]
        if not any(v > 0 for v in over_by.values()):
            return False
        if not under and not any(r.job.preemptible and r.job.priority < job.priority
                                 for r in self.running.values()):
            return False
        if self.victims_on is None:
            self.victims_on = defaultdict(list)
            for r in self.running.values():
                if r.job.id not in self.stopping and r.job.preemptible:
                    lost = lost_work_s(r.job, now_s - r.started_s)
                    self.victims_on[r.node].append(Running(r.job, r.node, r.gpus, r.started_s,
                                                           lost))
        plan = t.plan_preemption(job, self.victims_on, over_by,
                                 min_runtime_s=self.cfg.min_runtime_s, lower_band_only=not under,
                                 soon_s=self.cfg.preempt_soon_s)
        if plan is None:
            return False
        chosen = {v.job.id for v in plan.victims}
        self.victims_on[plan.node] = [v for v in self.victims_on[plan.node]
                                      if v.job.id not in chosen]
        free_s = max([now_s + self.cfg.kill_grace_s,
                      *(u for g in plan.gpus if (u := t.until[plan.node][g]) is not None
                        and self.ledger.owner[plan.node][g] not in chosen)])
        self.preempt(plan, now_s, free_s)
        t.fill(plan.node, plan.gpus, free_s + job.timeout_s)
        t.held |= {(plan.node, g) for g in plan.gpus}
        for v in plan.victims:
            over_by[v.job.tenant] -= len(v.gpus)
        tenants[job.tenant] = tenants[job.tenant].with_admitted(ALL, job.gpus)
        return True

    def preempt_for_waiting(self, t: Tick, now_s: float, tenants: dict[str, Tenant],
                            over_by: dict[str, float], share: dict[str, float],
                            preemptors: int) -> None:
        """Jobs past their grace, in fair order, may preempt while the tick allows."""
        waiting = sorted((j for n in NODE_WEIGHTS for j in self.heads(n)   # big ones: above
                          if j.gpus < self.cfg.big_job_min_gpus
                          and now_s - j.submitted_at_s >= self.cfg.preempt_grace_s),
                         key=lambda j: (-j.priority, tenants[j.tenant].key(self.cfg.half_life_s),
                                        j.submitted_at_s))
        for job in waiting:
            if preemptors >= PREEMPTORS_PER_TICK:
                return
            if self.try_preempt(t, job, now_s, tenants, over_by, share):
                preemptors += 1

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> dict[str, object]:
        arrivals = iter(self.jobs)
        nxt = next(arrivals, None)
        now_s, next_tick_s = 0.0, 0.0
        horizon_s = self.cfg.horizon_s
        while now_s < horizon_s:
            t_s = min(next_tick_s, self.events[0][0] if self.events else math.inf,
                      nxt.submitted_at_s if nxt else math.inf, horizon_s)
            self.account(now_s, t_s)
            now_s = t_s
            if now_s >= horizon_s:
                break
            ended = False
            while self.events and self.events[0][0] <= now_s:
                _, _, kind, job_id, attempt = heapq.heappop(self.events)
                if attempt != self.attempt[job_id]:
                    continue                        # an attempt stopped early: stale end
                ended = True
                if kind == "stopped":
                    self.stopped(job_id, now_s)
                    continue
                if self.stopping.pop(job_id, None) is not None:
                    self.attempt[job_id] += 1       # it finished in its grace: nothing to stop
                self.release(job_id, now_s)
                self.finished[job_id] = now_s
                self.release_holds(now_s)
            while nxt is not None and nxt.submitted_at_s <= now_s:
                self.queue(nxt)
                nxt = next(arrivals, None)
            if now_s >= next_tick_s or ended:
                if now_s >= next_tick_s:
                    next_tick_s = now_s + self.cfg.tick_s
                self.decide(now_s)
        return self.figures()

    # -- figures -------------------------------------------------------------------------------

    def waits(self, pick: Sequence[NodeJob]) -> dict[str, float | int]:
        """Queue waits to the first start; not started by the end: waiting until the end."""
        horizon_s = self.cfg.horizon_s
        waits = sorted(self.first_start.get(j.id, horizon_s) - j.submitted_at_s for j in pick)
        if not waits:
            return {}
        return {"jobs": len(waits), "not_started": sum(j.id not in self.first_start for j in pick),
                "p50_s": round(statistics.median(waits), 1),
                "p99_s": round(waits[min(len(waits) - 1, int(0.99 * len(waits)))], 1),
                "max_s": round(waits[-1], 1)}

    def figures(self) -> dict[str, object]:
        jobs = [j for j in self.jobs if j.submitted_at_s < self.cfg.horizon_s]
        n = self.n
        return {
            "utilisation": round(n["busy_gpu_s"] / (self.total_gpus * self.cfg.horizon_s), 4),
            "utilisation_while_queued": round(n["busy_while_waiting_gpu_s"]
                                              / max(1.0, n["capacity_while_waiting_gpu_s"]), 4),
            "big_job_wait": self.waits([j for j in jobs if j.gpus == 8]),
            "light_tenant_wait": self.waits([j for j in jobs if j.tenant == NODE_LIGHT]),
            "idle_gpus_while_8gpu_job_waits": round(n["idle_while_big_waits_gpu_s"]
                                                    / max(1.0, n["big_wait_s"]), 2),
            "reservations": len(self.reserved_first),
            "reserved_jobs_started_late": int(n["reserved_jobs_started_late"]),
            "reservation_violations": int(n["reservation_violations"]),
            "preemptions": int(n["preemptions"]),
            "lost_gpu_h": round(n["lost_gpu_s"] / 3600, 1),
            "a_jobs_finished": sum(1 for j in self.finished if self.by_id[j].tenant == "a"),
            "c_jobs_finished": sum(1 for j in self.finished if self.by_id[j].tenant == "c"),
        }


# name -> SimConfig fields (policy, exact: PlaceConfig). "fair-res": overdue big jobs in fair
# order (band, share key, age) and up to 4 reservations; without it, today's rule (oldest
# first, one reservation).
FAIR_RES = {"overdue_order": "fair", "max_reservations": 4}
RUNS: dict[str, dict[str, object]] = {
    "pack": {"policy": "pack"},
    "first-fit": {"policy": "first-fit"},
    "spread": {"policy": "spread"},
    "pack inexact": {"policy": "pack", "exact": False, "strict": False},
    "pack fair-res": {"policy": "pack", **FAIR_RES},
    "first-fit fair-res": {"policy": "first-fit", **FAIR_RES},
    "spread fair-res": {"policy": "spread", **FAIR_RES},
    "pack fair-res inexact": {"policy": "pack", "exact": False, "strict": False, **FAIR_RES},
    "pack preempt": {"policy": "pack", "preemption": True},
    "pack fair-res preempt": {"policy": "pack", "preemption": True, **FAIR_RES},
    "spread fair-res preempt": {"policy": "spread", "preemption": True, **FAIR_RES},
}


STEADY_RUNS = ("pack", "first-fit", "spread", "pack fair-res", "spread fair-res")
SMOKE = {"runs": "pack fair-res preempt,spread fair-res preempt", "steady_runs": "pack",
         "horizon_h": 2.0, "scale": 0.05, "json": None}
TRACKED = {"json": ROOT / "bench/fairness/results.json"}   # --refresh writes it


def config(name: str, **over: object) -> SimConfig:
    fields = dict(RUNS[name]) | over
    place = PlaceConfig(policy=str(fields.pop("policy")), exact=bool(fields.pop("exact", True)))
    return SimConfig(place=place, **fields)  # type: ignore[arg-type]


def run_one(name: str, jobs: Sequence[NodeJob], pool: Sequence[NodeShape],
            **over: object) -> dict[str, object]:
    return NodeSim(config(name, **over), pool, jobs).run()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=31)
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated: " + ", ".join(RUNS))
    ap.add_argument("--steady-runs", default=",".join(STEADY_RUNS),
                    help="the same on the steady trace (no backlogs, about 70 %% busy)")
    ap.add_argument("--json", type=Path, default=UNSAID,
                    help="store the figures under \"nodes\" here [default: results.json in a "
                         "new temporary directory; with --refresh, bench/fairness/results.json]")
    ap.add_argument("--refresh", action="store_true",
                    help="store them in the tracked results.json docs/scheduling.md quotes")
    ap.add_argument("--horizon-h", type=float, default=HORIZON_S / 3600, help="simulated hours")
    ap.add_argument("--scale", type=float, default=1.0, help="the flood trace's backlogs, scaled")
    args = parse(ap, SMOKE)
    place_outputs(args, TRACKED, {"json": "results.json"}, prefix="e31-nodesim-")
    pool = node_pool()
    horizon_s = args.horizon_h * 3600
    traces = {"flood": (node_trace(args.seed, horizon_s=horizon_s, scale=args.scale), args.runs),
              "steady": (node_trace(args.seed, horizon_s=horizon_s, steady=True),
                         args.steady_runs)}
    out: dict[str, object] = {"command": " ".join(["python", "bench/fairness/nodesim.py",
                                                   *sys.argv[1:]]),
                              "config": {k: v for k, v in vars(SimConfig()).items()
                                         if k != "place"},
                              "variants": RUNS, "runs": {}}
    runs: dict[str, object] = {}
    for trace, (jobs, names) in traces.items():
        for name in filter(None, names.split(",")):
            started = time.perf_counter()
            figures = run_one(name, jobs, pool, horizon_s=horizon_s)
            figures["wall_s"] = round(time.perf_counter() - started, 1)
            runs[f"{trace}/{name}"] = figures
            print(f"{trace}/{name}: {json.dumps(figures)}", flush=True)
    out["runs"] = runs
    save(args, out)
    if args.json is not None:
        results = json.loads(args.json.read_text()) if args.json.exists() else {}
        results["nodes"] = out
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json} (under \"nodes\")")


if __name__ == "__main__":
    main()
