"""Admission policy: how many messages each queue may publish (`plan`), and in what order."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from e31.policy import WorkerInfo, order, plan
from e31.settings import DEFAULT_SIZE_CLASSES
from e31.sizeclasses import redis_priority
from e31.store.records import Candidate

GPU24, GPU48, GPU80 = "e31.gpu24", "e31.gpu48", "e31.gpu80"
T0 = datetime(2025, 1, 1, tzinfo=UTC)


def rank(queue: str) -> int:
    """The scheduler's rank: the class's Redis priority, biggest class first."""
    return redis_priority(queue.split(".")[1], DEFAULT_SIZE_CLASSES)


def worker(node: str, *queues: str, busy_job: str | None = None) -> WorkerInfo:
    return WorkerInfo(node=node, queues=tuple(queues), gpus="0", busy_job=busy_job)


def test_an_idle_gpu48_worker_that_spills_to_gpu24_is_used_for_gpu48_work_first() -> None:
    # Given one idle gpu48 worker that also takes gpu24, and work waiting in both queues
    workers = [worker("gpu0@h", GPU48, GPU24)]
    demand = {GPU24: 3, GPU48: 1}   # the smaller queue listed first on purpose

    # When the plan is made without headroom
    budget = plan(workers, set(), demand, {}, headroom=0, rank=rank)

    # Then its one slot goes to gpu48 work, none to gpu24
    assert budget == {GPU48: 1, GPU24: 0}


def test_a_spilling_worker_takes_smaller_work_when_its_own_class_has_none() -> None:
    # Given an idle gpu80 worker that spills, and work only in gpu24
    workers = [worker("gpu0@h", GPU80, GPU48, GPU24)]

    # When the plan is made
    budget = plan(workers, set(), {GPU24: 2}, {}, headroom=0, rank=rank)

    # Then it is used for gpu24
    assert budget == {GPU24: 1}


def test_each_idle_worker_counts_once_across_the_queues_it_consumes() -> None:
    # Given a gpu24 worker and a gpu48 worker that spills to gpu24
    workers = [worker("a@h", GPU24), worker("b@h", GPU48, GPU24)]

    # When both queues have plenty of work
    budget = plan(workers, set(), {GPU48: 5, GPU24: 5}, {}, headroom=0, rank=rank)

    # Then one slot each: the spilling worker is not promised twice
    assert budget == {GPU48: 1, GPU24: 1}


def test_a_worker_reporting_a_busy_job_gets_nothing() -> None:
    # Given a gpu24 worker whose heartbeat says it runs a job
    workers = [worker("gpu0@h", GPU24, busy_job="job-1")]

    # When the plan is made without headroom
    budget = plan(workers, set(), {GPU24: 3}, {}, headroom=0, rank=rank)

    # Then no message is published for it
    assert budget == {GPU24: 0}


def test_a_worker_the_store_lists_as_busy_gets_nothing() -> None:
    # Given a gpu24 worker whose heartbeat looks idle but that holds a lease in the store
    workers = [worker("gpu0@h", GPU24)]

    # When the plan is made with its node among the busy ones
    budget = plan(workers, {"gpu0@h"}, {GPU24: 3}, {}, headroom=0, rank=rank)

    # Then no message is published for it
    assert budget == {GPU24: 0}


def test_outstanding_messages_use_up_idle_slots() -> None:
    # Given two idle gpu24 workers and one message already published but not claimed
    workers = [worker("a@h", GPU24), worker("b@h", GPU24)]

    # When the plan is made
    budget = plan(workers, set(), {GPU24: 5}, {GPU24: 1}, headroom=0, rank=rank)

    # Then only one more message is published
    assert budget == {GPU24: 1}


def test_outstanding_messages_beyond_the_idle_slots_publish_nothing() -> None:
    # Given one idle worker and three unclaimed messages
    workers = [worker("a@h", GPU24)]

    # When the plan is made with headroom
    budget = plan(workers, set(), {GPU24: 5}, {GPU24: 3}, headroom=1, rank=rank)

    # Then nothing more is published (never a negative count)
    assert budget == {GPU24: 0}


def test_headroom_is_added_for_a_queue_with_a_consumer_even_when_it_is_busy() -> None:
    # Given one busy gpu24 worker
    workers = [worker("a@h", GPU24, busy_job="j1")]

    # When the plan is made with a headroom of 1
    budget = plan(workers, set(), {GPU24: 5}, {}, headroom=1, rank=rank)

    # Then one message waits for it
    assert budget == {GPU24: 1}


def test_a_queue_without_any_consumer_gets_no_headroom() -> None:
    # Given only a gpu24 worker, and work waiting for gpu80
    workers = [worker("a@h", GPU24)]

    # When the plan is made with headroom
    budget = plan(workers, set(), {GPU80: 4}, {}, headroom=2, rank=rank)

    # Then nothing is published into a queue nobody reads
    assert budget == {GPU80: 0}


def test_demand_caps_the_number_published() -> None:
    # Given three idle gpu24 workers and one queued job
    workers = [worker(f"gpu{i}@h", GPU24) for i in range(3)]

    # When the plan is made with headroom
    budget = plan(workers, set(), {GPU24: 1}, {}, headroom=2, rank=rank)

    # Then one message is published
    assert budget == {GPU24: 1}


def test_idle_slots_plus_headroom_are_published_when_demand_allows() -> None:
    # Given two idle gpu24 workers and ten queued jobs
    workers = [worker("a@h", GPU24), worker("b@h", GPU24)]

    # When the plan is made with a headroom of 1
    budget = plan(workers, set(), {GPU24: 10}, {}, headroom=1, rank=rank)

    # Then the two idle slots and the headroom are published
    assert budget == {GPU24: 3}


def test_a_queue_without_demand_is_left_out() -> None:
    # Given an idle worker and a queue with zero demand
    workers = [worker("a@h", GPU24)]

    # When the plan is made
    budget = plan(workers, set(), {GPU24: 0}, {}, headroom=1, rank=rank)

    # Then nothing is planned for it
    assert budget == {}


# -- order ---------------------------------------------------------------------------------


def candidate(job_id: str, priority: int, minutes: int) -> Candidate:
    return Candidate(id=job_id, tenant="t", name=job_id, queue=GPU24, size_class="gpu24",
                     priority=priority, submitted_at=T0 + timedelta(minutes=minutes))


def test_candidates_are_ordered_by_priority_then_submission_time() -> None:
    # Given jobs of mixed priority and age
    jobs = [candidate("old-low", 1, 0), candidate("new-high", 9, 30), candidate("new-mid", 5, 20),
            candidate("old-high", 9, 10), candidate("old-mid", 5, 5)]

    # When they are ordered
    ordered = [c.id for c in order(jobs)]

    # Then higher priority first, and the older first within a priority
    assert ordered == ["old-high", "new-high", "old-mid", "new-mid", "old-low"]


def test_candidates_submitted_at_once_are_ordered_by_id() -> None:
    # Given two jobs of equal priority and time
    jobs = [candidate("b", 5, 0), candidate("a", 5, 0)]

    # When they are ordered
    # Then the order is stable by id
    assert [c.id for c in order(jobs)] == ["a", "b"]
