"""The node-level placement simulation's invariants (bench/fairness/nodes.py, nodesim.py):
no GPU given twice, exact reservations, preemption only of preemptible jobs past their
minimum runtime. Small workloads: the full figures come from `python bench/fairness/nodesim.py`.
"""

from __future__ import annotations

import functools
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "fairness"))

from nodes import (
    InvariantBroken,
    Ledger,
    PlaceConfig,
    Preemption,
    Reservation,
    Running,
    Tick,
    lost_work_s,
)
from nodesim import NodeSim, SimConfig

from workload import NodeJob, NodeShape, node_pool, node_trace

HORIZON_S = 2 * 3600.0
SMALL = {"horizon_s": HORIZON_S, "min_runtime_s": 600.0, "preempt_grace_s": 300.0,
         "reserve_after_s": 300.0, "overdue_order": "fair", "max_reservations": 4,
         "tick_s": 30.0}


class RecordingSim(NodeSim):
    """Records every preemption as the sim carries it out, to check it from outside."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.preempted: list[tuple[Running, float]] = []

    def preempt(self, plan: Preemption, now_s: float, free_s: float) -> None:
        self.preempted += [(self.running[v.job.id], now_s) for v in plan.victims]
        super().preempt(plan, now_s, free_s)


@functools.cache
def small_run(policy: str = "pack", *,
              exact: bool = True) -> tuple[RecordingSim, dict[str, object]]:
    """2 h of a small trace on 4 nodes of 8 × gpu80 and one of 4 × gpu48, with preemption
    (about a second each; shared between the tests)."""
    cfg = SimConfig(place=PlaceConfig(policy=policy, exact=exact), preemption=exact,
                    strict=exact, **SMALL)  # type: ignore[arg-type]
    sim = RecordingSim(cfg, node_pool(n80=4, n48=1),
                       node_trace(1, horizon_s=HORIZON_S, scale=0.05), seed=1)
    return sim, sim.run()


def job(id_: str, gpus: int, *, tenant: str = "t", size_class: str = "gpu80",
        timeout_s: float = 3600.0, preemptible: bool = False, priority: int = 5) -> NodeJob:
    return NodeJob(id_, tenant, size_class, gpus, 0.0, timeout_s / 2, timeout_s,
                   priority=priority, preemptible=preemptible,
                   checkpoint_every_s=600.0 if preemptible else math.inf)


def tick(until: dict[str, list[float | None]], **cfg: object) -> Tick:
    shapes = {n: NodeShape(n, "gpu80", 80, len(g)) for n, g in until.items()}
    return Tick(1000.0, shapes, until, PlaceConfig(**cfg))  # type: ignore[arg-type]


def test_the_ledger_refuses_a_gpu_that_another_job_holds() -> None:
    # Given a node where job a holds GPUs 0 and 1
    ledger = Ledger([NodeShape("n", "gpu80", 80, 8)])
    ledger.allocate("a", "n", (0, 1))
    # When b asks for GPU 1, Then it is refused, and released GPUs can be given again
    with pytest.raises(InvariantBroken, match="n:1 given to b while a holds it"):
        ledger.allocate("b", "n", (1, 2))
    ledger.release("a", "n", (0, 1))
    ledger.allocate("b", "n", (1, 2))
    assert ledger.busy() == 2


@pytest.mark.parametrize("policy", ["pack", "first-fit", "spread"])
def test_no_gpu_is_given_to_two_jobs_under_a_random_workload(policy: str) -> None:
    # Given a mixed trace of 1-, 2-, 4- and 8-GPU jobs with preemption, When it runs
    # (every allocation goes through the ledger, which raises on a second owner)
    sim, _ = small_run(policy)
    # Then jobs of every size ran and nothing was given twice
    started = {sim.by_id[j].gpus for j in sim.first_start}
    assert started == {1, 2, 4, 8}
    assert sum(o is not None for g in sim.ledger.owner.values() for o in g) == sum(
        len(r.gpus) for r in sim.running.values())


def test_packing_picks_the_busiest_node_that_fits_and_spread_the_idlest() -> None:
    # Given one node with 2 idle GPUs and one all idle
    until: dict[str, list[float | None]] = {"n0": [5e3] * 6 + [None] * 2, "n1": [None] * 8}
    one = job("j", 1)
    # Then packing fills the partly busy node, keeping n1 whole; spread takes n1
    assert tick(until, policy="pack").choose(one) == ("n0", (6,))
    assert tick(until, policy="spread").choose(one) == ("n1", (0,))
    assert tick(until, policy="pack").choose(job("big", 8)) == ("n1", tuple(range(8)))


def test_a_reserved_big_jobs_gpus_are_never_backfilled() -> None:
    # Given exact GPU choice, When a trace with reservations runs
    _, exact = small_run("pack")
    # Then reservations were made, no job landed on reserved GPUs past their start, and
    # every job that held a reservation started by its reserved start
    assert exact["reservations"] > 0
    assert exact["reservation_violations"] == 0
    assert exact["reserved_jobs_started_late"] == 0
    # And when the scheduler only checks that a job has a place and it lands on any idle
    # GPUs (Celery's pick of a worker), backfill does land on reserved GPUs
    _, inexact = small_run("pack", exact=False)
    assert inexact["reservation_violations"] > 0


def test_backfill_takes_reserved_gpus_only_when_it_ends_before_the_reservation() -> None:
    # Given GPUs 0-3 of n idle and reserved for big from t=2000
    t = tick({"n": [None] * 4 + [9e3] * 4})
    t.reservations.append(Reservation("big", "n", frozenset(range(4)), 2000.0, 9e3))
    # Then a job ending after 2000 does not fit, one ending by then does
    assert t.choose(job("long", 1, timeout_s=1500.0)) is None
    assert t.choose(job("short", 1, timeout_s=1000.0)) == ("n", (0,))


def test_preemption_never_touches_non_preemptible_jobs_and_respects_min_runtime() -> None:
    # Given a trace with preemptible training and non-preemptible jobs, When it runs
    sim, figures = small_run("pack")
    # Then there were preemptions, each of a preemptible job that had run its minimum
    assert figures["preemptions"] > 0
    assert len(sim.preempted) == figures["preemptions"]
    for victim, at_s in sim.preempted:
        assert victim.job.preemptible
        assert at_s - victim.started_s >= sim.cfg.min_runtime_s


def test_preemption_picks_the_fewest_jobs_of_over_share_tenants() -> None:
    # Given node n (8 GPUs, all busy): a's 4-GPU job and four 1-GPU jobs (preemptible), and
    # node m: a non-preemptible 8-GPU job
    until: dict[str, list[float | None]] = {"n": [9e3] * 8, "m": [9e3] * 8}
    t = tick(until)
    four = Running(job("a4", 4, tenant="a", preemptible=True), "n", (0, 1, 2, 3), 0.0, 100.0)
    ones = [Running(job(f"a1-{g}", 1, tenant="a", preemptible=True), "n", (g,), 0.0, 10.0)
            for g in range(4, 8)]
    pinned = Running(job("c8", 8, tenant="c"), "m", tuple(range(8)), 0.0, 0.0)
    on = {"n": [four, *ones], "m": [pinned]}
    # When b's 4-GPU job preempts with a over its share
    plan = t.plan_preemption(job("b4", 4, tenant="b"), on, {"a": 10.0, "c": 10.0},
                             min_runtime_s=600.0, lower_band_only=False)
    # Then one job goes: the 4-GPU one
    assert plan is not None and [v.job.id for v in plan.victims] == ["a4"]
    assert plan.gpus == (0, 1, 2, 3)
    # And an 8-GPU job takes all of n, never the non-preemptible job on m
    plan8 = t.plan_preemption(job("b8", 8, tenant="b"), on, {"a": 10.0, "c": 10.0},
                              min_runtime_s=600.0, lower_band_only=False)
    assert plan8 is not None and plan8.node == "n" and len(plan8.victims) == 5


def test_preemption_spares_young_jobs_under_share_tenants_and_the_same_band() -> None:
    until: dict[str, list[float | None]] = {"n": [9e3] * 8}
    victim = Running(job("a8", 8, tenant="a", preemptible=True), "n", tuple(range(8)), 700.0, 0.0)
    on = {"n": [victim]}
    b8 = job("b8", 8, tenant="b")

    def plan(**kw: object) -> Preemption | None:
        args: dict[str, object] = {"min_runtime_s": 200.0, "lower_band_only": False} | kw
        over = args.pop("over", {"a": 4.0})
        return tick(until).plan_preemption(b8, on, over, **args)  # type: ignore[arg-type]

    assert plan() is not None                      # started 300 s ago, min 200 s: may go
    assert plan(min_runtime_s=600.0) is None       # too young
    assert plan(over={"a": -1.0}) is None          # a is not over its share
    assert plan(lower_band_only=True) is None      # b not under share: only lower bands


def test_a_preempted_job_loses_at_most_the_work_since_its_last_checkpoint() -> None:
    training = job("a", 1, preemptible=True)      # a checkpoint every 600 s
    assert lost_work_s(training, 1500.0) == 300.0
    assert lost_work_s(job("c", 1), 1500.0) == 1500.0   # no checkpoints: all of it


def test_a_preempted_job_resumes_and_finishes_redoing_at_most_one_interval_per_preemption() -> None:
    # Given the small trace with preemption, When it runs
    sim, _ = small_run("pack")
    # Then the preempted jobs that finished held GPUs for their work, plus at most one
    # checkpoint interval and the kill grace per preemption (work since the last checkpoint)
    finished = [j for j in sim.times_preempted if j in sim.finished]
    assert finished
    for job_id in finished:
        job, times = sim.by_id[job_id], sim.times_preempted[job_id]
        extra_s = sim.ran_s[job_id] - job.duration_s
        assert 0 <= extra_s <= times * (job.checkpoint_every_s + sim.cfg.kill_grace_s) + 1e-6
