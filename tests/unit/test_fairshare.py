"""Fair share: decayed usage, the admission decision, reservation, pending reasons.

Every test runs on a simulated clock: times are plain seconds, nothing reads the wall clock.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

import pytest

from e31.core.records import Candidate
from e31.core.usage import UsageState
from e31.scheduling.admission import AdmissionConfig, Decision, Slot, decide
from e31.scheduling.fairshare import Pending, Reason, Tenant, estimated_start_s, position_in_queue

GPU80, GPU80X4 = "e31.gpu80", "e31.gpu80.x4"
HOUR_S = 3600.0
NOW_S = 1_000_000.0
CFG = AdmissionConfig(half_life_s=HOUR_S, reserve_after_s=600.0)
_ids = itertools.count()


def job(tenant: str, *, queue: str = GPU80, gpus: int = 1, priority: int = 5,
        submitted_at_s: float = NOW_S - 60, timeout_s: float = 600.0) -> Candidate:
    return Candidate(id=f"{tenant}-{next(_ids)}", tenant_id=tenant, queue=queue,
                     size_class="gpu80", gpus=gpus, priority=priority,
                     submitted_at_s=submitted_at_s, timeout_s=timeout_s)


def single_slots(n: int, *, host: str = "h") -> list[Slot]:
    return [Slot(node=f"gpu{i}@{host}", queues=(GPU80,), gpu_ids=frozenset({f"{host}:{i}"}))
            for i in range(n)]


def heads_of(jobs: Iterable[Candidate], k: int) -> dict[str, list[Candidate]]:
    """What the store hands over: per queue, each tenant's oldest k per priority band."""
    groups: dict[tuple[str, str, int], list[Candidate]] = defaultdict(list)
    for j in jobs:
        groups[(j.queue, j.tenant_id, j.priority)].append(j)
    heads: dict[str, list[Candidate]] = defaultdict(list)
    for (queue, _, _), group in groups.items():
        heads[queue] += sorted(group, key=lambda j: j.submitted_at_s)[:k]
    return dict(heads)


def tenants_of(*tenants: Tenant) -> dict[str, Tenant]:
    return {t.name: t for t in tenants}


def published_by_tenant(decision: Decision, jobs: Sequence[Candidate]) -> dict[str, int]:
    owner = {j.id: j.tenant_id for j in jobs}
    counts: dict[str, int] = defaultdict(int)
    for d in decision.publish:
        counts[owner[d.job_id]] += 1
    return dict(counts)


# -- decayed usage ---------------------------------------------------------------------------

def test_usage_halves_every_half_life_and_is_only_decayed_when_read() -> None:
    # Given 1000 GPU-seconds billed at t=0 with a one-hour half-life (as the store bills them)
    usage = UsageState().plus(1000.0, now_s=0.0, half_life_s=HOUR_S)

    # Then the value halves per half-life, and the stored state has not moved
    assert usage.at(HOUR_S, HOUR_S) == pytest.approx(500.0)
    assert usage.at(3 * HOUR_S, HOUR_S) == pytest.approx(125.0)
    assert usage == UsageState(1000.0, 0.0)
    # And a second bill decays the first one to its own time before adding
    usage = usage.plus(100.0, now_s=HOUR_S, half_life_s=HOUR_S)
    assert usage.value_gpu_s == pytest.approx(600.0)
    assert usage.at_s == HOUR_S


def test_a_clock_that_goes_back_reads_usage_as_of_its_last_update() -> None:
    # Given usage last updated at t=100 s
    usage = UsageState(50.0, 100.0)

    # When it is read or billed at an earlier time (another host's clock)
    # Then it is not inflated, and the update time does not go back
    assert usage.at(10.0, HOUR_S) == 50.0
    assert usage.plus(1.0, now_s=10.0, half_life_s=HOUR_S) == UsageState(51.0, 100.0)


# -- admission order -------------------------------------------------------------------------

def test_a_lone_tenant_gets_every_idle_slot_whatever_its_usage() -> None:
    # Given 16 idle GPUs and one tenant far over any share, with 100 jobs queued
    jobs = [job("c") for _ in range(100)]
    tenants = tenants_of(Tenant("c", usage_gpu_s=1e9))

    # When the policy decides
    decision = decide(now_s=NOW_S, slots=single_slots(16), tenants=tenants,
                      heads=heads_of(jobs, 32), config=CFG)

    # Then all 16 are published: fairness never leaves a GPU idle
    assert len(decision.publish) == 16
    assert {d.node for d in decision.publish} == {s.node for s in single_slots(16)}


def test_one_tick_splits_idle_slots_by_weight_between_tenants_with_no_history() -> None:
    # Given 12 idle GPUs and three backlogged tenants of weight 2, 1, 1 and no usage yet
    jobs = [job(name) for name in "abc" for _ in range(50)]
    tenants = tenants_of(Tenant("a", weight=2), Tenant("b"), Tenant("c"))

    # When the policy decides
    decision = decide(now_s=NOW_S, slots=single_slots(12), tenants=tenants,
                      heads=heads_of(jobs, 32), config=CFG)

    # Then each admitted job counts at once: 6, 3, 3
    assert published_by_tenant(decision, jobs) == {"a": 6, "b": 3, "c": 3}


def test_a_tenant_under_its_share_goes_first_even_behind_a_10000_job_backlog() -> None:
    # Given tenant c flooded 10,000 jobs an hour ago and holds 15 of 16 GPUs
    flood = [job("c", submitted_at_s=NOW_S - HOUR_S + i * 0.01) for i in range(10_000)]
    light = job("d", submitted_at_s=NOW_S - 1)
    busy = [Slot(s.node, s.queues, s.gpu_ids, busy=True, free_at_s=NOW_S + 60)
            for s in single_slots(15)]
    slots = busy + [single_slots(16)[15]]
    tenants = tenants_of(Tenant("c", usage_gpu_s=15 * HOUR_S, running_gpus={"gpu80": 15}),
                         Tenant("d"))

    # When the one free GPU is handed out
    decision = decide(now_s=NOW_S, slots=slots, tenants=tenants,
                      heads=heads_of([*flood, light], 32), config=CFG)

    # Then the light tenant's newest job gets it, and c's oldest waits for a GPU
    assert [d.job_id for d in decision.publish] == [light.id]
    assert decision.pending[flood[0].id] == Pending(Reason.NO_CAPACITY, "gpu80", 1)


def test_a_higher_priority_band_beats_a_better_share() -> None:
    # Given one free GPU, a heavy tenant's priority-9 job and a fresh tenant's priority-5 job
    urgent = job("heavy", priority=9, submitted_at_s=NOW_S - 1)
    normal = job("fresh", priority=5, submitted_at_s=NOW_S - 999)
    tenants = tenants_of(Tenant("heavy", usage_gpu_s=1e9), Tenant("fresh"))

    # When the policy decides
    decision = decide(now_s=NOW_S, slots=single_slots(1), tenants=tenants,
                      heads=heads_of([urgent, normal], 32), config=CFG)

    # Then the band wins
    assert [d.job_id for d in decision.publish] == [urgent.id]


def test_age_orders_jobs_of_equal_band_and_share() -> None:
    # Given two tenants with equal standing, the older job goes first
    old, new = job("a", submitted_at_s=NOW_S - 100), job("b", submitted_at_s=NOW_S - 10)
    decision = decide(now_s=NOW_S, slots=single_slots(1), tenants={},
                      heads=heads_of([new, old], 32), config=CFG)
    assert [d.job_id for d in decision.publish] == [old.id]


# -- quotas ----------------------------------------------------------------------------------

def test_a_quota_holds_with_5000_jobs_queued_at_once_and_the_rest_go_to_others() -> None:
    # Given a tenant with a gpu80 quota of 3 that already runs 1, submitting 5,000 jobs
    flood = [job("q", submitted_at_s=NOW_S - 5000 + i) for i in range(5000)]
    other = [job("r") for _ in range(20)]
    tenants = tenants_of(Tenant("q", quotas={"gpu80": 3}, running_gpus={"gpu80": 1}),
                         Tenant("r", usage_gpu_s=1e9))

    # When 16 GPUs are idle and all 5,000 are handed over
    decision = decide(now_s=NOW_S, slots=single_slots(16), tenants=tenants,
                      heads={GPU80: flood + other}, config=CFG)

    # Then q gets 2 (1 + 2 = 3), the other tenant the other 14, q's rest waits on its quota
    assert published_by_tenant(decision, flood + other) == {"q": 2, "r": 14}
    waiting = [decision.pending[j.id] for j in flood if j.id in decision.pending]
    assert len(waiting) == 4998
    assert set(waiting) == {Pending(Reason.QUOTA, "gpu80", 1)}
    assert waiting[0].text() == "tenant quota for gpu80 reached"


def test_a_big_job_that_would_pass_the_quota_waits_but_a_small_one_still_fits() -> None:
    # Given a quota of 4 with 2 running, a 4-GPU job and a 1-GPU job
    big = job("q", queue=GPU80X4, gpus=4, submitted_at_s=NOW_S - 10)
    small = job("q")
    slots = [Slot("x4@h", (GPU80X4,), frozenset({"h:0", "h:1", "h:2", "h:3"})),
             *single_slots(2, host="g")]
    tenants = tenants_of(Tenant("q", quotas={"gpu80": 4}, running_gpus={"gpu80": 2}))

    # When the policy decides
    decision = decide(now_s=NOW_S, slots=slots, tenants=tenants,
                      heads=heads_of([big, small], 32), config=CFG)

    # Then only the small one goes
    assert [d.job_id for d in decision.publish] == [small.id]
    assert decision.pending[big.id].reason is Reason.QUOTA


# -- spill, outstanding ----------------------------------------------------------------------

def test_a_group_worker_serves_its_own_queue_before_spilled_one_gpu_work() -> None:
    # Given an idle x4 worker that spills onto one-GPU gpu80, and work in both queues
    group = Slot("x4@h", (GPU80X4, GPU80), frozenset({"h:0", "h:1", "h:2", "h:3"}))
    big, small = job("a", queue=GPU80X4, gpus=4), job("b", submitted_at_s=NOW_S - 999)

    # When the policy decides, then the big job gets it although the small job is older
    decision = decide(now_s=NOW_S, slots=[group], tenants={},
                      heads=heads_of([big, small], 32), config=CFG)
    assert [d.job_id for d in decision.publish] == [big.id]

    # And with no big job queued, it takes the one-GPU job (work-conserving)
    decision = decide(now_s=NOW_S, slots=[group], tenants={}, heads=heads_of([small], 32),
                      config=CFG)
    assert [(d.job_id, d.queue) for d in decision.publish] == [(small.id, GPU80)]


def test_a_group_worker_takes_only_spilled_work_short_enough_for_spill_max_s() -> None:
    # Given an idle x4 worker that spills, a spill bound of 30 min, a long and a short job
    group = Slot("x4@h", (GPU80X4, GPU80), frozenset({"h:0", "h:1", "h:2", "h:3"}))
    long_job = job("b", timeout_s=4 * HOUR_S, submitted_at_s=NOW_S - 100)
    short_job = job("b", timeout_s=HOUR_S / 4)
    cfg = AdmissionConfig(half_life_s=HOUR_S, spill_max_s=HOUR_S / 2)

    # When the policy decides
    decision = decide(now_s=NOW_S, slots=[group], tenants={},
                      heads=heads_of([long_job, short_job], 32), config=cfg)

    # Then the short one spills, the long one waits for a one-GPU worker
    assert [d.job_id for d in decision.publish] == [short_job.id]
    assert decision.pending[long_job.id].reason is Reason.NO_CAPACITY


def test_messages_published_and_not_yet_claimed_use_up_slots() -> None:
    # Given 3 idle GPUs and 2 messages already on the queue
    decision = decide(now_s=NOW_S, slots=single_slots(3), tenants={},
                      heads=heads_of([job("a") for _ in range(5)], 32),
                      outstanding={GPU80: 2}, config=CFG)

    # Then one more is published
    assert len(decision.publish) == 1


# -- reservation and backfill ----------------------------------------------------------------

def shared_node(free_at_s: Sequence[float | None]) -> list[Slot]:
    """One node of 4 GPUs with a one-GPU slot per GPU and an x4 slot over all four."""
    gpus = [f"n:{i}" for i in range(4)]
    singles = [Slot(f"gpu{i}@n", (GPU80,), frozenset({g}), busy=t is not None,
                    free_at_s=t if t is not None else math.inf)
               for i, (g, t) in enumerate(zip(gpus, free_at_s, strict=True))]
    return [*singles, Slot("x4@n", (GPU80X4,), frozenset(gpus))]


def test_a_big_job_waits_for_fairness_until_its_wait_passes_reserve_after() -> None:
    # Given a 4-GPU job waiting 5 minutes, and one of the node's GPUs free
    big = job("a", queue=GPU80X4, gpus=4, submitted_at_s=NOW_S - 300)
    long_small = job("b", timeout_s=5 * HOUR_S)
    slots = shared_node([None, NOW_S + 100, NOW_S + 200, NOW_S + 300])

    # When the policy decides, then no reservation yet: the small job takes the GPU
    decision = decide(now_s=NOW_S, slots=slots, tenants={},
                      heads=heads_of([big, long_small], 32), config=CFG)
    assert decision.reservation is None
    assert [d.job_id for d in decision.publish] == [long_small.id]
    assert decision.pending[big.id].text() == "waiting for 4 free gpu80 GPUs on one worker"


def test_an_overdue_big_job_reserves_the_earliest_gpus_and_only_short_work_backfills() -> None:
    # Given a 4-GPU job waiting 11 minutes, a node whose GPUs free at +0, +100, +200, +400 s,
    big = job("a", queue=GPU80X4, gpus=4, submitted_at_s=NOW_S - 660)
    # and a long and a short one-GPU job of a tenant far below its share
    long_small = job("b", timeout_s=1000, submitted_at_s=NOW_S - 900)
    short_small = job("b", timeout_s=300, submitted_at_s=NOW_S - 800)
    slots = shared_node([None, NOW_S + 100, NOW_S + 200, NOW_S + 400])
    tenants = tenants_of(Tenant("a", usage_gpu_s=1e6), Tenant("b"))

    # When the policy decides
    decision = decide(now_s=NOW_S, slots=slots, tenants=tenants,
                      heads=heads_of([big, long_small, short_small], 32), config=CFG)

    # Then the x4 slot is reserved from the last GPU's expected end, the short job
    # backfills, and the long one waits for the reservation
    assert decision.reservation is not None
    assert (decision.reservation.job_id, decision.reservation.node) == (big.id, "x4@n")
    assert decision.reservation.start_s == NOW_S + 400
    assert [d.job_id for d in decision.publish] == [short_small.id]
    assert decision.pending[long_small.id] == Pending(Reason.RESERVED_FOR, big.id, 1)
    assert big.id in decision.pending[long_small.id].text()


def test_a_reserved_big_job_starts_once_its_gpus_are_free_before_any_other_work() -> None:
    # Given the same big job and a stream of small jobs, and a simulated clock that runs
    # every job to its timeout
    big = job("a", queue=GPU80X4, gpus=4, submitted_at_s=NOW_S - 660)
    stream = [job("b", timeout_s=250, submitted_at_s=NOW_S - 2000 + i) for i in range(100)]
    ends: dict[int, float] = {1: NOW_S + 100, 2: NOW_S + 200, 3: NOW_S + 400}
    queued = [big, *stream]
    first_reservation: float | None = None
    started_at_s: float | None = None

    # When the scheduler ticks every 10 s
    for now_s in (NOW_S + 10.0 * i for i in range(100)):
        frees = [ends.get(i) if ends.get(i, 0.0) > now_s else None for i in range(4)]
        tenants = tenants_of(Tenant("a", usage_gpu_s=1e6), Tenant("b"))
        decision = decide(now_s=now_s, slots=shared_node(frees), tenants=tenants,
                          heads=heads_of(queued, 8), config=CFG)
        if first_reservation is None and decision.reservation is not None:
            first_reservation = decision.reservation.start_s
        for d in decision.publish:
            if d.job_id == big.id:
                started_at_s = now_s
                break
            ends[int(d.node[3])] = now_s + 250
        if started_at_s is not None:
            break
        queued = [j for j in queued if j.id in decision.pending]

    # Then the big job started, no later than its first reservation said
    assert first_reservation == NOW_S + 400
    assert started_at_s is not None and started_at_s <= first_reservation


# -- explain ---------------------------------------------------------------------------------

def test_pending_reasons_read_as_sentences() -> None:
    assert Pending(Reason.NO_CAPACITY, "gpu80").text() == "waiting for a free gpu80 GPU"
    assert Pending(Reason.DEPENDENCY, "J1").text() == "dependency J1 not finished"
    assert (Pending(Reason.BACKOFF, "2025-01-01T00:00:10+00:00").text()
            == "retry back-off until 2025-01-01T00:00:10+00:00")


def test_position_interleaves_by_weight_and_start_follows_throughput() -> None:
    # Given a queue with 10,000 of c's jobs and 40 of a's (weight 2), and a priority-9 job
    tenants = tenants_of(Tenant("a", weight=2), Tenant("c"), Tenant("d"))
    backlog = {("c", 5): 10_000, ("a", 5): 40, ("x", 9): 1}

    # When d's first job and c's 4th job ask where they stand
    d_first = position_in_queue(tenant="d", priority=5, older_own=0, backlog=backlog,
                                tenants=tenants, half_life_s=HOUR_S)
    c_fourth = position_in_queue(tenant="c", priority=5, older_own=3, backlog=backlog,
                                 tenants=tenants, half_life_s=HOUR_S)

    # Then d is behind only the higher band; c's 4th waits for its 3, a's 6 and the band
    assert d_first == 1
    assert c_fourth == 1 + 3 + 6
    assert estimated_start_s(0.0, c_fourth, starts_per_min=5.0) == pytest.approx(132.0)
    assert estimated_start_s(0.0, c_fourth, starts_per_min=0.0) is None


# -- cost ------------------------------------------------------------------------------------

def test_the_cost_of_a_decision_does_not_grow_with_the_backlog() -> None:
    # Given backlogs of 1k, 10k and 100k jobs over four tenants, two bands, two queues,
    # handed over as bounded heads (the oldest k per tenant, band and queue)
    k, steps, sizes = 16, [], []
    for backlog in (1_000, 10_000, 100_000):
        jobs = [job("abcd"[i % 4], priority=5 + (i // 4) % 2, submitted_at_s=float(i),
                    queue=GPU80X4 if (i // 8) % 5 == 0 else GPU80,
                    gpus=4 if (i // 8) % 5 == 0 else 1)
                for i in range(backlog)]
        heads = heads_of(jobs, k)
        slots = [*single_slots(12), Slot("x4@g", (GPU80X4, GPU80),
                                         frozenset({"g:0", "g:1", "g:2", "g:3"}))]

        # When one decision is made
        decision = decide(now_s=NOW_S, slots=slots, tenants={}, heads=heads, config=CFG)
        steps.append(decision.steps)
        sizes.append(sum(len(h) for h in heads.values()))
        assert len(decision.publish) == 13

    # Then the input and the work are the same at every backlog size
    assert sizes == [4 * 2 * 2 * k] * 3
    assert max(steps) == min(steps)
