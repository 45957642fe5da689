"""Registered node shapes (e31.scheduling.placement) and the OOM ladder (e31.core.sizeclasses):
which jobs no node could ever run, and where an out-of-memory job goes next. Pure."""

from __future__ import annotations

from e31.core.sizeclasses import DEFAULT_SIZE_CLASSES, OomRule, Route
from e31.ops.heartbeat import WorkerInfo
from e31.scheduling.placement import missing, shapes


def worker(node: str, *queues: str, gpus: str) -> WorkerInfo:
    return WorkerInfo(node=node, queues=queues, gpus=gpus, gpu_count=len(gpus.split(",")))


def test_a_hosts_gpus_count_for_every_class_its_workers_serve_spill_included() -> None:
    # Given host a with two gpu80 workers that spill to gpu48, one gpu48 worker, and a cpu slot;
    # and host b with one gpu80 worker that does not spill
    known = shapes([worker("gpu0@a", "e31.gpu80", "e31.gpu48", gpus="0"),
                    worker("gpu1@a", "e31.gpu80", "e31.gpu48", gpus="1"),
                    worker("gpu2@a", "e31.gpu48", gpus="2"),
                    WorkerInfo(node="cpu0@a", queues=("e31.cpu",), gpus=""),
                    worker("gpu0@b", "e31.gpu80", gpus="0")])

    # Then gpu48 jobs may have all three GPUs of a, gpu80 jobs two; the cpu slot is no GPU
    assert known == {"gpu80": {"a": 2, "b": 1}, "gpu48": {"a": 3}}
    assert missing("gpu48", 3, known) is None
    assert missing("gpu80", 4, known) == \
        "no node with 4 × gpu80 is registered (largest: 2 × gpu80 on a)"


def test_a_group_worker_counts_its_gpus_once_and_a_shared_gpu_is_not_counted_twice() -> None:
    known = shapes([worker("gpu0-1@a", "e31.gpu80.x2", gpus="0,1"),
                    worker("gpu0@a", "e31.gpu80", gpus="0")])
    assert known == {"gpu80": {"a": 2}}


def test_nothing_is_impossible_for_a_class_no_node_serves_or_when_nothing_is_registered() -> None:
    known = shapes([worker("gpu0@a", "e31.gpu24", gpus="0")])
    assert missing("gpu141", 8, known) is None      # gpu141 is not up: it waits, no_workers
    assert missing("gpu24", 2, {}) is None          # a fresh pool
    assert missing("cpu", 0, known) is None


def test_an_oom_goes_to_the_next_bigger_class_only_when_asked_and_stops_at_the_biggest() -> None:
    rule = OomRule.of(DEFAULT_SIZE_CLASSES, "fail")
    assert rule.target("next_class", "gpu24", 2) == Route("gpu48", "e31.gpu48.x2", 2)
    assert rule.target("next_class", "gpu141", 1) is None
    assert rule.target(None, "gpu24", 1) is None          # the pool's default: fail
    assert rule.target("fail", "gpu24", 1) is None
    pool = OomRule.of(DEFAULT_SIZE_CLASSES, "next_class")
    assert pool.target(None, "gpu48", 1) == Route("gpu80", "e31.gpu80", 1)
    assert pool.target("fail", "gpu48", 1) is None        # the spec's own wins
