"""The preemption plan (e31.scheduling.preemption): who is stopped for whom, and who never is."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

from e31.core.records import RunningJob
from e31.core.sizeclasses import DEFAULT_SIZE_CLASSES
from e31.ops.heartbeat import WorkerInfo
from e31.scheduling import inputs
from e31.scheduling.admission import Slot
from e31.scheduling.preemption import PreemptConfig, Preemption, Waiter, plan
from e31_worker.node.gpus import parse_simulated
from e31_worker.node.launcher import gang_sets

NOW = 10_000.0
CONFIG = PreemptConfig(grace_s=60, min_runtime_s=300)
Q = "e31.gpu80"
Q2 = "e31.gpu80.x2"


def slot(name: str, *gpus: int, queue: str = Q) -> Slot:
    return Slot(node=name, queues=(queue,), gpu_ids=frozenset(f"h:{g}" for g in gpus))


def running(job_id: str, tenant: str, node: str, *, gpus: int = 1, ran_s: float = 600,
            preemptible: bool = True, priority: int = 5, asked: bool = False) -> RunningJob:
    return RunningJob(id=job_id, tenant_id=tenant, node=node, size_class="gpu80", gpus=gpus,
                      started_at=datetime.fromtimestamp(NOW - ran_s, UTC), timeout_s=86400,
                      lease_live=True, priority=priority, preemptible=preemptible,
                      preempt_requested=asked)


def waiter(job_id: str, tenant: str, *, waited_s: float = 120, gpus: int = 1,
           priority: int = 5, queue: str = Q) -> Waiter:
    return Waiter(job_id, tenant, queue, gpus, priority, NOW - waited_s)


def plan_of(slots: list[Slot], jobs: list[RunningJob], waiting: list[Waiter],
            weights: dict[str, float] | None = None,
            config: PreemptConfig = CONFIG) -> list[Preemption]:
    return plan(now_s=NOW, slots=slots, running=jobs, waiting=waiting,
                weights=weights or {}, config=config)


def test_a_tenant_below_its_share_preempts_a_preemptible_job_of_one_over_it() -> None:
    # Given one GPU held by a's preemptible job, and b's job waiting past the grace
    slots = [slot("gpu0@h", 0)]
    # Then a's job is stopped for b's
    assert plan_of(slots, [running("ja", "a", "gpu0@h")], [waiter("jb", "b")]) == [
        Preemption("jb", "gpu0@h", ("ja",))]


def test_a_job_that_is_not_preemptible_is_never_stopped() -> None:
    slots = [slot("gpu0@h", 0)]
    assert plan_of(slots, [running("ja", "a", "gpu0@h", preemptible=False)],
                   [waiter("jb", "b")]) == []


def test_nothing_is_stopped_before_the_grace_or_the_minimum_runtime() -> None:
    slots = [slot("gpu0@h", 0)]
    assert plan_of(slots, [running("ja", "a", "gpu0@h")], [waiter("jb", "b", waited_s=30)]) == []
    assert plan_of(slots, [running("ja", "a", "gpu0@h", ran_s=100)], [waiter("jb", "b")]) == []
    assert plan_of(slots, [running("ja", "a", "gpu0@h")], [waiter("jb", "b")],
                   config=PreemptConfig(grace_s=None)) == []


def test_a_tenant_never_preempts_itself_and_a_free_slot_needs_no_preemption() -> None:
    slots = [slot("gpu0@h", 0), slot("gpu1@h", 1)]
    assert plan_of(slots[:1], [running("ja", "a", "gpu0@h")], [waiter("ja2", "a")]) == []
    assert plan_of(slots, [running("ja", "a", "gpu0@h")], [waiter("jb", "b")]) == []


def test_at_its_share_a_tenant_preempts_only_a_lower_band() -> None:
    # Given two GPUs, a and b holding one each (each at its share), b's next job waiting
    slots = [slot("gpu0@h", 0), slot("gpu1@h", 1)]
    jobs = [running("ja", "a", "gpu0@h"), running("jb", "b", "gpu1@h")]
    # Then a job of b's own band preempts nothing: a is not over its share either
    assert plan_of(slots, jobs, [waiter("jb2", "b")]) == []
    # And a tenant over its share keeps its job against an equal band, but not a lower one
    jobs = [running("ja", "a", "gpu0@h", priority=3), running("ja2", "a", "gpu1@h")]
    assert plan_of(slots, jobs, [waiter("jb", "b", priority=5)]) == [
        Preemption("jb", "gpu0@h", ("ja",))]


def test_weights_set_the_shares() -> None:
    # Given a of weight 3 holding 3 of 4 GPUs and b one: a is at its share
    slots = [slot(f"gpu{g}@h", g) for g in range(4)]
    jobs = [running(f"ja{g}", "a", f"gpu{g}@h") for g in range(3)] + [
        running("jb", "b", "gpu3@h")]
    assert plan_of(slots, jobs, [waiter("jb2", "b")], weights={"a": 3.0, "b": 1.0}) == []
    # With equal weights a is one over, and gives up one job, not two
    out = plan_of(slots, jobs, [waiter("jb2", "b"), waiter("jb3", "b", waited_s=100)])
    assert len(out) == 1 and out[0].for_job == "jb2" and len(out[0].victims) == 1


def test_a_slot_being_freed_serves_the_next_waiter_without_a_second_preemption() -> None:
    # Given a's two jobs over its share, one of them asked to stop already
    slots = [slot(f"gpu{g}@h", g) for g in range(3)]
    jobs = [running("ja0", "a", "gpu0@h", asked=True), running("ja1", "a", "gpu1@h"),
            running("ja2", "a", "gpu2@h")]
    # Then b's first waiting job waits for that slot, and only its second one preempts
    out = plan_of(slots, jobs, [waiter("jb1", "b", waited_s=200), waiter("jb2", "b")])
    assert out == [Preemption("jb2", "gpu1@h", ("ja1",))]


def test_the_fewest_jobs_are_stopped_for_a_multi_gpu_job() -> None:
    # Given a node with one-GPU slots and .x2 slots over the same GPUs: a runs two one-GPU
    # jobs on GPUs 0 and 1 and one two-GPU job on GPUs 2 and 3
    slots = [slot(f"gpu{g}@h", g) for g in range(4)] + [
        slot("x2a@h", 0, 1, queue=Q2), slot("x2b@h", 2, 3, queue=Q2)]
    jobs = [running("ja0", "a", "gpu0@h"), running("ja1", "a", "gpu1@h"),
            running("ja23", "a", "x2b@h", gpus=2)]
    # When b's two-GPU job has waited past the grace
    out = plan_of(slots, jobs, [waiter("jb", "b", gpus=2, queue=Q2)])
    # Then the one two-GPU job is stopped, not the two one-GPU ones
    assert out == [Preemption("jb", "x2b@h", ("ja23",))]


def test_on_a_gang_host_the_fewest_jobs_holding_a_set_are_stopped() -> None:
    # Given two 4-GPU gang hosts full of a's jobs: one per GPU on h (each run by a worker
    # that watches another GPU), and on k one two-GPU job on GPUs 0-1 and one job per GPU
    # on 2 and 3
    workers = [WorkerInfo(node=f"gpu{i}@{h}", queues=(f"e31.node.{h}",), gpus=str(i),
                          gpu_count=1, gang=gang_sets(parse_simulated("4x80"), spill=False,
                                                      classes=DEFAULT_SIZE_CLASSES))
               for h in ("h", "k") for i in range(4)]
    jobs = [held(f"ja{g}", f"gpu{3 - g}@h", str(g)) for g in range(4)] + [
        held("jk", "gpu0@k", "0,1"), held("jk2", "gpu2@k", "2"), held("jk3", "gpu3@k", "3")]
    all_slots = inputs.slots(workers, jobs, headroom=0)
    # When b's two-GPU job has waited past the grace
    out = plan_of(all_slots, jobs, [waiter("jb", "b", gpus=2, queue=Q2)])
    # Then the one job holding a whole aligned pair is stopped, not two one-GPU jobs
    assert out == [Preemption("jb", "gang[0,1]@k", ("jk",))]
    # and where a pair is free, nothing is stopped: admission places the job there
    rest = [j for j in jobs if j.id != "jk"]
    assert plan_of(inputs.slots(workers, rest, headroom=0), rest,
                   [waiter("jb", "b", gpus=2, queue=Q2)]) == []


def held(job_id: str, node: str, gpus: str) -> RunningJob:
    return dataclasses.replace(running(job_id, "a", node, gpus=len(gpus.split(","))),
                               held_gpus=gpus)


def test_at_most_max_per_tick_jobs_start_a_preemption() -> None:
    slots = [slot(f"gpu{g}@h", g) for g in range(6)]
    jobs = [running(f"ja{g}", "a", f"gpu{g}@h") for g in range(6)]
    waiting = [waiter(f"jb{i}", "b", waited_s=100 + i) for i in range(3)]
    out = plan_of(slots, jobs, waiting)
    assert [p.for_job for p in out] == ["jb2", "jb1"]   # the longest waiting first


def test_cpu_slots_take_no_part_a_cpu_job_neither_preempts_nor_is_preempted() -> None:
    # Given a GPU and two cpu slots (no GPUs): the GPU is the whole of the shares
    cpu = [Slot(node=f"cpu{i}@h", queues=("e31.cpu",)) for i in range(2)]
    slots = [slot("gpu0@h", 0), *cpu]
    jobs = [running("ja", "a", "gpu0@h"), running("jc", "a", "cpu0@h", gpus=0),
            running("jc2", "a", "cpu1@h", gpus=0)]
    # Then b's GPU job preempts a's GPU job
    assert plan_of(slots, jobs, [waiter("jb", "b")]) == [Preemption("jb", "gpu0@h", ("ja",))]
    # And b's cpu job stops nothing
    assert plan_of(slots, jobs, [waiter("jbc", "b", gpus=0, queue="e31.cpu")]) == []


def test_the_training_workload_is_preemptible_by_default_and_others_are_not() -> None:
    from e31.core.spec import JobSpec
    assert JobSpec.parse({"workload": "train"}).is_preemptible
    assert not JobSpec.parse({"workload": "train", "preemptible": False}).is_preemptible
    assert not JobSpec.parse({"entrypoint": "m:f"}).is_preemptible
    assert JobSpec.parse({"entrypoint": "m:f", "preemptible": True}).is_preemptible
