"""The live inputs of admission: slots from heartbeats and running jobs, headroom, heads' K.

(`plan` and `order` were replaced by `e31.scheduling.admission.decide`; its own tests are in
test_fairshare.py. These check what the scheduler hands it.)
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from e31.core.records import Candidate, RunningJob
from e31.ops.heartbeat import WorkerInfo
from e31.scheduling.admission import AdmissionConfig, decide
from e31.scheduling.fairshare import Tenant
from e31.scheduling.inputs import heads_per_queue, per_queue, shared_queues, slots

GPU24, GPU48, GPU80 = "e31.gpu24", "e31.gpu48", "e31.gpu80"
T0 = datetime(2025, 1, 1, tzinfo=UTC)


def worker(node: str, *queues: str, gpus: str = "0", busy_job: str | None = None) -> WorkerInfo:
    return WorkerInfo(node=node, queues=tuple(queues), gpus=gpus, busy_job=busy_job)


def job(job_id: str, queue: str, *, gpus: int = 1, age_s: float = 0.0) -> Candidate:
    return Candidate(id=job_id, tenant_id="t", queue=queue, size_class=queue.split(".")[1],
                     gpus=gpus, priority=5, submitted_at_s=T0.timestamp() - age_s, timeout_s=60)


def published(workers: list[WorkerInfo], jobs: list[Candidate], *, headroom: int = 0,
              running: list[RunningJob] | None = None) -> list[str]:
    d = decide(now_s=T0.timestamp(), slots=slots(workers, running or [], headroom=headroom),
               tenants={"t": Tenant("t")}, heads=per_queue(jobs), config=AdmissionConfig())
    return [p.job_id for p in d.publish]


def test_an_idle_gpu48_worker_that_spills_to_gpu24_takes_gpu48_work_first() -> None:
    # Given one idle gpu48 worker that also takes gpu24, and older work waiting in gpu24
    workers = [worker("gpu0@h", GPU48, GPU24)]

    # When the policy decides
    sent = published(workers, [job("small", GPU24, age_s=60), job("big", GPU48)])

    # Then its one slot goes to the gpu48 job
    assert sent == ["big"]


def test_a_spilling_worker_takes_smaller_work_when_its_own_class_has_none() -> None:
    assert published([worker("gpu0@h", GPU80, GPU48, GPU24)], [job("a", GPU24)]) == ["a"]


def test_each_idle_worker_counts_once_across_the_queues_it_consumes() -> None:
    # Given a gpu24 worker and a gpu48 worker that spills to gpu24, on different GPUs
    workers = [worker("a@h", GPU24, gpus="0"), worker("b@h", GPU48, GPU24, gpus="1")]
    jobs = [job(f"s{i}", GPU24) for i in range(5)] + [job(f"b{i}", GPU48) for i in range(5)]

    # When both queues have plenty of work, then one job each
    sent = published(workers, jobs)
    assert len(sent) == 2 and sum(s.startswith("b") for s in sent) == 1


def test_a_worker_reporting_a_busy_job_gets_nothing() -> None:
    assert published([worker("gpu0@h", GPU24, busy_job="j-x")], [job("a", GPU24)]) == []


def test_a_worker_holding_a_live_lease_is_busy_until_its_job_times_out() -> None:
    # Given a worker whose heartbeat says idle but whose job's lease lives
    running = [RunningJob(id="j-r", tenant_id="t", node="gpu0@h", size_class="gpu24", gpus=1,
                          started_at=T0 - timedelta(seconds=10), timeout_s=100, lease_live=True)]

    # When its slot is built
    [slot] = slots([worker("gpu0@h", GPU24)], running, headroom=0)

    # Then it is busy, free at the job's start + timeout_s
    assert slot.busy and slot.free_at_s == T0.timestamp() + 90


def test_a_busy_worker_without_a_known_job_is_free_at_an_unknown_time() -> None:
    [slot] = slots([worker("gpu0@h", GPU24, busy_job="j-x")], [], headroom=0)
    assert slot.busy and slot.free_at_s == math.inf


def test_headroom_is_added_for_a_queue_with_a_consumer_even_when_it_is_busy() -> None:
    # Given one busy gpu24 worker and a headroom of one
    # When the policy decides, then one message is published to wait for it
    assert published([worker("gpu0@h", GPU24, busy_job="j-x")], [job("a", GPU24)],
                     headroom=1) == ["a"]


def test_a_queue_without_any_consumer_gets_no_headroom() -> None:
    assert published([worker("gpu0@h", GPU24)], [job("a", GPU80)], headroom=2) == []


def test_workers_of_one_host_that_pin_the_same_gpu_share_it() -> None:
    # Given four one-GPU workers and a --group 4 worker over the same GPUs of host h
    workers = [worker(f"gpu{i}@h", GPU24, gpus=str(i)) for i in range(4)]
    workers.append(worker("gpu0-1-2-3@h", "e31.gpu24.x4", gpus="0,1,2,3"))

    # Then the queues are of the shared layout: no headroom, and a one-GPU job blocks the group
    assert shared_queues(workers) == {GPU24, "e31.gpu24.x4"}
    assert not any(s.node.startswith("~") for s in slots(workers, [], headroom=1))
    sent = published(workers, [job("one", GPU24, age_s=60), job("four", "e31.gpu24.x4", gpus=4)])
    assert sent == ["one"]


def test_gpus_of_different_hosts_with_the_same_index_are_different_gpus() -> None:
    workers = [worker("gpu0@a", GPU24), worker("gpu0@b", GPU24)]
    assert shared_queues(workers) == set()
    assert len(published(workers, [job("x", GPU24), job("y", GPU24)])) == 2


def test_heads_are_read_deep_enough_to_fill_every_free_slot() -> None:
    # Given 40 idle gpu24 workers and one busy gpu80 worker
    workers = [worker(f"gpu{i}@h", GPU24, gpus=str(i)) for i in range(40)]
    workers.append(worker("gpu99@h", GPU80, gpus="99", busy_job="j-x"))

    # When K is chosen per queue with 16 per tenant at least and 5 messages outstanding
    k = heads_per_queue(slots(workers, [], headroom=0), {GPU24: 5}, per_tenant=16)

    # Then a lone tenant's heads can fill the 35 slots left, and a busy queue reads 16
    assert k == {GPU24: 35, GPU80: 16}
