"""Discrete-event simulation of the fair-share scheduler against FIFO (docs/scheduling.md).

    pip install matplotlib   # for the plot; bench-only, not a dependency of e31
    python bench/fairness/sim.py              # writes into a new temporary directory
    python bench/fairness/sim.py --refresh    # rewrites the tracked figures the docs show

Drives the real policy, `e31.scheduling.admission.decide` with `e31.core.usage.UsageState`
(imported, not copied), and a FIFO baseline (below) over the same trace (`workload.py`):
tenants a (weight 2, with an x4 job every 40 min), b and c (weight 1; c floods 10,000 jobs
first) and d, light. Each policy runs on two pools of
16 gpu80 GPUs: `shared` (a node's one-GPU slots and x4 slots overlap: a big job needs 4 free
GPUs of one node) and `static` (the live launcher: 12 one-GPU workers and one x4 worker that
spills). Prints the figures, writes them as JSON (`--json`) and plots each tenant's share of
GPU-seconds over time (`--png`): by default into a new temporary directory it names, so a
reader's run leaves the repository as it was; `--refresh` writes the tracked
`bench/fairness/results.json` and `docs/img/fairness_share.png` instead (issue 32). The
scheduler ticks on every submit and job end and every `--tick-s`; jobs start when published.
Runs in about a minute on two cores.

    python bench/fairness/sim.py --smoke --out sim.json   # the suite's run (tests/bench)

`--smoke`: the shared pool, a flood of 1,000 jobs, neither results.json nor the plot
written; `--out FILE` writes the figures there.

Worker slots only: placement of 1-8 GPU jobs on real-shaped nodes, exact reservations and
preemption are simulated by `nodesim.py` beside it (its figures go under "nodes" in the
same JSON, which this script keeps).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import statistics
import sys
import tempfile
import time
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from e31.core.records import Candidate
from e31.core.usage import UsageState
from e31.scheduling.admission import AdmissionConfig, Slot, decide
from e31.scheduling.fairshare import Tenant

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))   # bench/: its report module

from report import parse, save
from workload import (
    BACKLOGGED,
    FLOOD_JOBS,
    HORIZON_S,
    LIGHT,
    OTHERS_START_S,
    POOLS,
    WEIGHTS,
    SimJob,
    trace,
)

HEAD_K = 16              # candidates per queue, tenant and band the store hands over
FIFO_HEAD = 64           # FIFO: the oldest per queue, whoever submitted them
BIN_S = 60.0             # accounting resolution
PLOT_BIN_S = 600.0       # share-over-time plot resolution
SIZE_CLASS = "gpu80"
PRIORITY = 5
ROOT = Path(__file__).resolve().parents[2]
SMOKE = {"pools": "shared", "flood_jobs": 1000, "json": None, "png": None}
TRACKED = {"json": ROOT / "bench/fairness/results.json",
           "png": ROOT / "docs/img/fairness_share.png"}
FILE_NAMES = {"json": "results.json", "png": "fairness_share.png"}
# `--json` and `--png` when not given: a new temporary directory, or with --refresh TRACKED
# (a Path, not a string, so that argparse hands it back as it is and `is` tells it apart).
UNSAID = Path("<a new temporary directory>")


def fifo_decide(slots: Sequence[Slot],
                heads: Mapping[str, Sequence[Candidate]]) -> list[tuple[str, str]]:
    """FIFO baseline: oldest first, each free slot serving its own queue before spill ones."""
    held = {g for s in slots if s.busy for g in s.gpu_ids}
    taken = {s.node for s in slots if s.busy}
    jobs = sorted((j for q in heads.values() for j in q), key=lambda j: (j.submitted_at_s, j.id))
    placed: list[tuple[str, str]] = []
    done: set[str] = set()
    for level in range(max(len(s.queues) for s in slots)):
        for j in jobs:
            if j.id in done:
                continue
            for s in slots:
                if (len(s.queues) > level and s.queues[level] == j.queue
                        and s.node not in taken and not s.gpu_ids & held):
                    taken.add(s.node)
                    held |= s.gpu_ids
                    done.add(j.id)
                    placed.append((j.id, s.node))
                    break
    return placed


def accrue(usage: UsageState, running_gpus: float, now_s: float,
           half_life_s: float) -> UsageState:
    """Charge `running_gpus` held since `usage.at_s` until `now_s`, decaying as it accrues.

    Exact for a constant rate r: v(t) = v0·e^(−λΔ) + r·(1 − e^(−λΔ))/λ, λ = ln 2 / half-life,
    so the result does not depend on how often the simulation calls it. (The live store bills
    each attempt as a lump when it ends, `UsageState.plus`.)
    """
    lam = math.log(2.0) / half_life_s
    keep = math.exp(-lam * max(0.0, now_s - usage.at_s))
    return UsageState(usage.value_gpu_s * keep + running_gpus * (1.0 - keep) / lam,
                      max(now_s, usage.at_s))


class Sim:
    """One run: a policy on a pool over the trace."""

    def __init__(self, policy: str, pool: list[Slot], jobs: list[SimJob], *,
                 half_life_s: float, reserve_after_s: float, spill_max_s: float | None,
                 tick_s: float) -> None:
        self.policy, self.pool, self.jobs = policy, pool, jobs
        self.cfg = AdmissionConfig(half_life_s=half_life_s, reserve_after_s=reserve_after_s,
                                   spill_max_s=spill_max_s)
        self.tick_s = tick_s
        self.usage: dict[str, UsageState] = defaultdict(UsageState)   # tenant -> decayed
        self.by_id = {j.id: j for j in jobs}
        self.as_job = {j.id: Candidate(j.id, j.tenant, j.queue, SIZE_CLASS, j.gpus, PRIORITY,
                                       j.submitted_at_s, j.timeout_s) for j in jobs}
        self.queued: dict[tuple[str, str], deque[SimJob]] = defaultdict(deque)
        self.running: dict[str, tuple[SimJob, float]] = {}   # slot node -> job, started at
        self.started: dict[str, float] = {}
        self.gpu_s_bins: dict[str, list[float]] = {t: [0.0] * (int(HORIZON_S / BIN_S) + 1)
                                                   for t in WEIGHTS}
        self.backlog_end_s = HORIZON_S
        self.used_while_queued_gpu_s = self.capacity_while_queued_gpu_s = 0.0
        self.reserved: set[str] = set()
        self.max_steps = self.decisions = 0

    # -- state -----------------------------------------------------------------------------

    def running_gpus(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for job, _ in self.running.values():
            out[job.tenant] += job.gpus
        return out

    def n_queued(self, tenant: str | None = None) -> int:
        return sum(len(q) for (_, t), q in self.queued.items() if tenant in (None, t))

    def slots_now(self) -> list[Slot]:
        return [replace(s, busy=True, free_at_s=self.running[s.node][1]
                        + self.running[s.node][0].timeout_s) if s.node in self.running else s
                for s in self.pool]

    def account(self, t0_s: float, t1_s: float) -> None:
        """Integrate GPU use over [t0, t1): per tenant per bin, and pool use while queued."""
        if t1_s <= t0_s:
            return
        running = self.running_gpus()
        if self.n_queued():
            self.used_while_queued_gpu_s += sum(running.values()) * (t1_s - t0_s)
            self.capacity_while_queued_gpu_s += self.pool_gpus() * (t1_s - t0_s)
        a_s = t0_s
        while a_s < t1_s:
            b = int(a_s // BIN_S)
            b_end_s = min(t1_s, (b + 1) * BIN_S)
            for tenant, gpus in running.items():
                self.gpu_s_bins[tenant][b] += gpus * (b_end_s - a_s)
            a_s = b_end_s
        for tenant in WEIGHTS:
            self.usage[tenant] = accrue(self.usage[tenant], running.get(tenant, 0), t1_s,
                                        self.cfg.half_life_s)

    def pool_gpus(self) -> int:
        return len({g for s in self.pool for g in s.gpu_ids})

    # -- decisions -------------------------------------------------------------------------

    def heads(self) -> dict[str, list[Candidate]]:
        heads: dict[str, list[Candidate]] = defaultdict(list)
        for (queue, _), q in self.queued.items():
            heads[queue] += [self.as_job[j.id] for j in list(q)[:HEAD_K]]
        if self.policy == "fifo":
            return {queue: sorted(h, key=lambda j: j.submitted_at_s)[:FIFO_HEAD]
                    for queue, h in heads.items()}
        return heads

    def dispatch(self, now_s: float) -> list[tuple[str, str]]:
        slots, heads = self.slots_now(), self.heads()
        if self.policy == "fifo":
            return fifo_decide(slots, heads)
        running = self.running_gpus()
        tenants = {t: Tenant(t, weight=w, usage_gpu_s=self.usage[t].at(now_s, self.cfg.half_life_s),
                             running_gpus={SIZE_CLASS: running.get(t, 0)})
                   for t, w in WEIGHTS.items()}
        decision = decide(now_s=now_s, slots=slots, tenants=tenants, heads=heads,
                          config=self.cfg)
        self.decisions += 1
        self.max_steps = max(self.max_steps, decision.steps)
        if decision.reservation is not None:
            self.reserved.add(decision.reservation.job_id)
        return [(d.job_id, d.node) for d in decision.publish]

    def start(self, job_id: str, node: str, now_s: float, ends: list[tuple[float, str]]) -> None:
        job = self.by_id[job_id]
        self.queued[(job.queue, job.tenant)].remove(job)
        self.running[node] = (job, now_s)
        self.started[job_id] = now_s
        heapq.heappush(ends, (now_s + job.duration_s, node))

    # -- the loop --------------------------------------------------------------------------

    def run(self) -> dict[str, object]:
        ends: list[tuple[float, str]] = []
        arrivals = iter(self.jobs)
        nxt: SimJob | None = next(arrivals, None)
        now_s, next_tick_s = 0.0, 0.0
        while now_s < HORIZON_S:
            t_s = min(next_tick_s, ends[0][0] if ends else math.inf,
                      nxt.submitted_at_s if nxt else math.inf, HORIZON_S)
            self.account(now_s, t_s)
            now_s = t_s
            if now_s >= HORIZON_S:
                break
            while ends and ends[0][0] <= now_s:
                _, node = heapq.heappop(ends)
                del self.running[node]
            while nxt is not None and nxt.submitted_at_s <= now_s:
                self.queued[(nxt.queue, nxt.tenant)].append(nxt)
                nxt = next(arrivals, None)
            if now_s >= next_tick_s:
                next_tick_s = now_s + self.tick_s
            for job_id, node in self.dispatch(now_s):
                self.start(job_id, node, now_s, ends)
            if (self.backlog_end_s == HORIZON_S and now_s > OTHERS_START_S
                    and any(self.n_queued(t) == 0 for t in BACKLOGGED)):
                self.backlog_end_s = now_s
        return self.figures()

    # -- figures ---------------------------------------------------------------------------

    def waits(self, pick: Sequence[SimJob]) -> dict[str, float | int]:
        """Queue waits; a job not started by the end counts as waiting until the end."""
        waits = sorted(self.started.get(j.id, HORIZON_S) - j.submitted_at_s for j in pick)
        if not waits:
            return {}
        return {"jobs": len(waits), "not_started": sum(j.id not in self.started for j in pick),
                "p50_s": round(statistics.median(waits), 1),
                "p99_s": round(waits[min(len(waits) - 1, int(0.99 * len(waits)))], 1),
                "max_s": round(waits[-1], 1)}

    def figures(self) -> dict[str, object]:
        lo, hi = math.ceil(OTHERS_START_S / BIN_S), int(self.backlog_end_s // BIN_S)
        used = {t: sum(self.gpu_s_bins[t][lo:hi]) for t in BACKLOGGED}
        total_w = sum(WEIGHTS[t] for t in BACKLOGGED)
        x = [(used[t] / sum(used.values())) / (WEIGHTS[t] / total_w) for t in BACKLOGGED]
        jain = sum(x) ** 2 / (len(x) * sum(v * v for v in x))
        light = [j for j in self.jobs if j.tenant == LIGHT and j.submitted_at_s < HORIZON_S]
        big = [j for j in self.jobs if j.gpus > 1 and j.submitted_at_s < HORIZON_S]
        return {
            "jain_index": round(jain, 4),
            "share_vs_weight": {t: round(v, 3) for t, v in zip(BACKLOGGED, x, strict=True)},
            "backlogged_window_s": [lo * BIN_S, hi * BIN_S],
            "utilisation_while_queued": round(self.used_while_queued_gpu_s
                                              / self.capacity_while_queued_gpu_s, 4),
            "light_tenant_wait": self.waits(light),
            "big_job_wait": self.waits(big),
            "reservations": len(self.reserved),
            "max_decision_steps": self.max_steps,
        }

    def share_series(self) -> dict[str, list[float]]:
        """Each tenant's share of the GPU-seconds used, per plot bin."""
        per = int(PLOT_BIN_S / BIN_S)
        n = len(self.gpu_s_bins["a"]) // per
        sums = {t: [sum(b[i * per:(i + 1) * per]) for i in range(n)]
                for t, b in self.gpu_s_bins.items()}
        totals = [sum(sums[t][i] for t in sums) or 1.0 for i in range(n)]
        return {t: [s[i] / totals[i] for i in range(n)] for t, s in sums.items()}


def plot(series: Mapping[tuple[str, str], Mapping[str, list[float]]], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        sys.exit("the plot needs matplotlib: pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pools = sorted({p for p, _ in series})
    fig, axes = plt.subplots(len(pools), 2, figsize=(12, 4 * len(pools)), sharey=True,
                             squeeze=False)
    total_w = sum(WEIGHTS[t] for t in BACKLOGGED)
    for row, pool in enumerate(pools):
        for col, policy in enumerate(("fair", "fifo")):
            ax = axes[row][col]
            for tenant, shares in series[(pool, policy)].items():
                hours = [(i + 0.5) * PLOT_BIN_S / 3600 for i in range(len(shares))]
                line, = ax.plot(hours, shares, label=f"{tenant} (weight {WEIGHTS[tenant]:g})")
                if tenant in BACKLOGGED:
                    ax.axhline(WEIGHTS[tenant] / total_w, ls=":", color=line.get_color())
            ax.set_title(f"{policy.upper()} on the {pool} pool")
            ax.set_xlabel("hours")
            ax.set_ylabel("share of GPU-seconds (10-min bins)")
            ax.set_ylim(0, 1.05)
            ax.legend(loc="upper right", fontsize=8)
    fig.suptitle("Each tenant's share of GPU-seconds over time (dotted: weight / total weight)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def place_outputs(args: argparse.Namespace, tracked: dict[str, Path] = TRACKED,
                  file_names: dict[str, str] = FILE_NAMES,
                  prefix: str = "e31-fairness-") -> argparse.Namespace:
    """The output options of `tracked` (`--json` and `--png` here; nodesim.py's `--json`)
    where they were not given: the tracked files with `--refresh`, else one new temporary
    directory for all (so a plain run never rewrites tracked files)."""
    where: Path | None = None
    for name in tracked:
        if getattr(args, name) is not UNSAID:
            continue
        if args.refresh:
            setattr(args, name, tracked[name])
            continue
        where = where or Path(tempfile.mkdtemp(prefix=prefix))
        setattr(args, name, where / file_names[name])
    return args


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--half-life-s", type=float, default=2 * 3600.0)
    ap.add_argument("--reserve-after-s", type=float, default=600.0)
    ap.add_argument("--spill-max-s", type=float, default=1800.0,
                    help="fair policy: most timeout_s a worker takes from a spill queue (0: none)")
    ap.add_argument("--tick-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=31)
    ap.add_argument("--pools", default="shared,static")
    ap.add_argument("--json", type=Path, default=UNSAID,
                    help="write the figures here [default: results.json in a new temporary "
                         "directory; with --refresh, bench/fairness/results.json]")
    ap.add_argument("--png", type=Path, default=UNSAID,
                    help="write the plot here [default: fairness_share.png in a new temporary "
                         "directory; with --refresh, docs/img/fairness_share.png]")
    ap.add_argument("--refresh", action="store_true",
                    help="write the tracked figures docs/scheduling.md shows")
    ap.add_argument("--flood-jobs", type=int, default=FLOOD_JOBS, help="c's flood at t=0")
    args = place_outputs(parse(ap, SMOKE))

    jobs = trace(args.seed, flood_jobs=args.flood_jobs)
    results: dict[str, object] = {"command": " ".join(["python", "bench/fairness/sim.py",
                                                       *sys.argv[1:]]),
                                  "half_life_s": args.half_life_s,
                                  "reserve_after_s": args.reserve_after_s,
                                  "spill_max_s": args.spill_max_s, "runs": {}}
    runs: dict[str, dict[str, object]] = {}
    series = {}
    for pool in args.pools.split(","):
        for policy in ("fair", "fifo"):
            started = time.perf_counter()
            sim = Sim(policy, POOLS[pool](), jobs, half_life_s=args.half_life_s,
                      reserve_after_s=args.reserve_after_s,
                      spill_max_s=args.spill_max_s or None, tick_s=args.tick_s)
            figures = sim.run()
            figures["wall_s"] = round(time.perf_counter() - started, 1)
            runs[f"{pool}/{policy}"] = figures
            series[(pool, policy)] = sim.share_series()
            print(f"{pool}/{policy}: {json.dumps(figures)}", flush=True)
    results["runs"] = runs
    save(args, results)
    if args.json is not None:
        if args.json.exists():   # the node-level figures (nodesim.py) stay
            results |= {k: v for k, v in json.loads(args.json.read_text()).items()
                        if k == "nodes"}
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.png is not None:
        plot(series, args.png)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
