"""Size classes: routing a spec to a queue, classing a GPU, spill order, Redis priority."""

from __future__ import annotations

from typing import Any

import pytest

from e31.core.errors import ConfigError, SpecError
from e31.core.sizeclasses import (
    DEFAULT_SIZE_CLASSES,
    Route,
    SizeClass,
    class_for_gpu,
    queue_name,
    redis_priority,
    route,
    spill_queues,
)
from e31.core.spec import JobSpec

CLASSES = DEFAULT_SIZE_CLASSES
BY_NAME = {c.name: c for c in CLASSES}


def routed(**resources: Any) -> Route:
    return route(JobSpec.parse({"entrypoint": "m:f", "resources": resources}), CLASSES)


def refused(**resources: Any) -> dict[str, str]:
    with pytest.raises(SpecError) as caught:
        routed(**resources)
    [entry] = caught.value.errors
    return entry


# -- route ---------------------------------------------------------------------------------


def test_a_job_without_gpu_mem_goes_to_the_smallest_gpu_class() -> None:
    # Given a one-GPU job that says nothing about memory
    # When it is routed
    r = routed()

    # Then it waits in the smallest GPU class, not the cpu class
    assert r == Route(size_class="gpu24", queue="e31.gpu24", gpus=1)


@pytest.mark.parametrize(("gpu_mem_gb", "expected"), [
    (1, "gpu24"), (24, "gpu24"), (24.5, "gpu48"), (40, "gpu48"), (48, "gpu48"),
    (80, "gpu80"), (100, "gpu141"), (141, "gpu141"),
])
def test_a_job_goes_to_the_smallest_class_that_fits_its_gpu_memory(gpu_mem_gb: float,
                                                                   expected: str) -> None:
    # Given a job asking for this much memory per GPU
    # When it is routed
    r = routed(gpus=1, gpu_mem_gb=gpu_mem_gb)

    # Then it goes to the smallest class with at least that much
    assert (r.size_class, r.queue, r.gpus) == (expected, f"e31.{expected}", 1)


def test_a_job_needing_more_memory_than_any_class_is_refused_on_gpu_mem_gb() -> None:
    # Given a job asking for more memory than the biggest class
    # When it is routed
    entry = refused(gpu_mem_gb=200)

    # Then the error names resources.gpu_mem_gb and the largest class
    assert entry["field"] == "resources.gpu_mem_gb"
    assert "200" in entry["reason"] and "141" in entry["reason"]


def test_a_job_with_zero_gpus_goes_to_the_cpu_class() -> None:
    # Given a job that needs no GPU
    # When it is routed
    r = routed(gpus=0)

    # Then it waits in the cpu queue and holds no GPU
    assert r == Route(size_class="cpu", queue="e31.cpu", gpus=0)


def test_a_cpu_job_is_refused_when_the_pool_has_no_cpu_class() -> None:
    # Given a pool of GPU classes only
    classes = [c for c in CLASSES if c.gpu_mem_gb > 0]
    spec = JobSpec.parse({"entrypoint": "m:f", "resources": {"gpus": 0}})

    # When a cpu job is routed
    with pytest.raises(SpecError) as caught:
        route(spec, classes)

    # Then it is refused on resources.gpus
    assert caught.value.errors[0]["field"] == "resources.gpus"


def test_a_job_naming_a_size_class_goes_to_that_class() -> None:
    # Given a job naming gpu80 although it needs little memory
    # When it is routed
    r = routed(size_class="gpu80")

    # Then it goes to gpu80
    assert r == Route(size_class="gpu80", queue="e31.gpu80", gpus=1)


def test_a_job_naming_the_cpu_class_with_zero_gpus_goes_to_cpu() -> None:
    # Given a job naming the cpu class and asking for no GPU
    # When it is routed
    # Then it goes to cpu
    assert routed(size_class="cpu", gpus=0) == Route("cpu", "e31.cpu", 0)


def test_an_unknown_size_class_is_refused_listing_the_known_ones() -> None:
    # Given a job naming a class the pool does not have
    # When it is routed
    entry = refused(size_class="gpu999")

    # Then the error names resources.size_class and the known classes
    assert entry["field"] == "resources.size_class"
    assert "gpu999" in entry["reason"]
    assert all(c.name in entry["reason"] for c in CLASSES)


def test_the_cpu_size_class_with_a_gpu_is_refused() -> None:
    # Given a job naming the cpu class but asking for one GPU
    # When it is routed
    entry = refused(size_class="cpu", gpus=1)

    # Then it is refused on resources.gpus
    assert entry["field"] == "resources.gpus"
    assert "gpus: 0" in entry["reason"]


def test_a_gpu_size_class_with_zero_gpus_is_refused() -> None:
    # Given a job naming gpu48 but asking for no GPU
    # When it is routed
    entry = refused(size_class="gpu48", gpus=0)

    # Then it is refused on resources.gpus
    assert entry["field"] == "resources.gpus"


def test_a_named_size_class_too_small_for_the_gpu_memory_is_refused() -> None:
    # Given a job naming gpu24 but asking for 40 GB
    # When it is routed
    entry = refused(size_class="gpu24", gpu_mem_gb=40)

    # Then it is refused on resources.gpu_mem_gb
    assert entry["field"] == "resources.gpu_mem_gb"
    assert "gpu24" in entry["reason"]


def test_a_two_gpu_job_goes_to_the_two_gpu_queue_of_its_class() -> None:
    # Given a job asking for two GPUs
    # When it is routed
    r = routed(gpus=2)

    # Then it waits in the x2 queue of the smallest class
    assert r == Route(size_class="gpu24", queue="e31.gpu24.x2", gpus=2)


def test_a_multi_gpu_job_naming_a_class_goes_to_that_class_group_queue() -> None:
    # Given a job naming gpu80 with four GPUs
    # When it is routed
    r = routed(size_class="gpu80", gpus=4)

    # Then it waits in e31.gpu80.x4
    assert r == Route(size_class="gpu80", queue="e31.gpu80.x4", gpus=4)


def test_queue_names_carry_the_group_size_only_for_groups() -> None:
    # Given class names and group sizes
    # When queue names are built
    # Then one GPU has no suffix and a group has .xN
    assert queue_name("gpu48") == "e31.gpu48"
    assert queue_name("gpu48", 1) == "e31.gpu48"
    assert queue_name("gpu48", 8) == "e31.gpu48.x8"


# -- class_for_gpu -------------------------------------------------------------------------


@pytest.mark.parametrize(("mem_gb", "expected"), [
    (23.99, "gpu24"),    # a "24 GB" card as NVML reports it
    (40, "gpu24"),       # an A100 40 GB serves only the 24 GB class
    (47.99, "gpu48"),
    (80, "gpu80"),
    (79.6, "gpu80"),     # an H100 80 GB
    (140.4, "gpu141"),   # an H200
    (192, "gpu141"),     # bigger than every class: the biggest
])
def test_a_gpu_serves_the_largest_class_its_reported_memory_allows(mem_gb: float,
                                                                    expected: str) -> None:
    # Given a GPU reporting this much memory
    # When its class is chosen
    cls = class_for_gpu(mem_gb, CLASSES)

    # Then it is the largest class it can serve, never the cpu class
    assert cls.name == expected


def test_a_gpu_smaller_than_every_class_is_refused() -> None:
    # Given a 16 GB GPU and a smallest class of 24 GB
    # When its class is chosen
    with pytest.raises(ConfigError) as caught:
        class_for_gpu(16, CLASSES)

    # Then it is refused, naming the smallest class
    assert "gpu24" in caught.value.message


# -- spill_queues --------------------------------------------------------------------------


def test_a_spilling_worker_consumes_its_own_queue_first_then_smaller_ones_biggest_first() -> None:
    # Given a gpu141 worker
    # When its spill queues are listed
    queues = spill_queues(BY_NAME["gpu141"], 1, CLASSES)

    # Then its own queue leads, then each smaller GPU class in descending size
    assert queues == ["e31.gpu141", "e31.gpu80", "e31.gpu48", "e31.gpu24"]


def test_the_smallest_gpu_class_spills_nowhere_and_never_to_cpu() -> None:
    # Given a gpu24 worker
    # When its spill queues are listed
    queues = spill_queues(BY_NAME["gpu24"], 1, CLASSES)

    # Then it consumes only its own queue
    assert queues == ["e31.gpu24"]


@pytest.mark.parametrize("own", ["gpu24", "gpu48", "gpu80", "gpu141"])
def test_no_gpu_worker_spills_onto_the_cpu_queue(own: str) -> None:
    # Given any GPU worker
    # When its spill queues are listed
    queues = spill_queues(BY_NAME[own], 1, CLASSES)

    # Then the cpu queue is not among them, and its own class is first
    assert "e31.cpu" not in queues
    assert queues[0] == f"e31.{own}"


def test_a_group_worker_spills_onto_group_queues_of_the_same_size() -> None:
    # Given a worker holding two gpu48 GPUs
    # When its spill queues are listed
    queues = spill_queues(BY_NAME["gpu48"], 2, CLASSES)

    # Then it consumes only x2 queues
    assert queues == ["e31.gpu48.x2", "e31.gpu24.x2"]


def test_spill_order_does_not_depend_on_the_order_classes_are_listed() -> None:
    # Given the classes listed out of order
    shuffled = [BY_NAME[name] for name in ("gpu48", "cpu", "gpu141", "gpu24", "gpu80")]

    # When spill queues are listed
    # Then they are still biggest first
    assert spill_queues(BY_NAME["gpu80"], 1, shuffled) == ["e31.gpu80", "e31.gpu48", "e31.gpu24"]


# -- redis_priority ------------------------------------------------------------------------


def test_the_biggest_class_has_redis_priority_zero_and_smaller_classes_come_after() -> None:
    # Given the default classes
    # When their Redis priorities are computed
    prio = {c.name: redis_priority(c.name, CLASSES) for c in CLASSES}

    # Then the biggest is 0 (popped first by Kombu) and each smaller one is later
    assert prio["gpu141"] == 0
    assert prio["gpu141"] < prio["gpu80"] < prio["gpu48"] < prio["gpu24"] < prio["cpu"] <= 9


def test_an_unknown_class_gets_the_lowest_redis_priority() -> None:
    # Given a class name not in the table
    # When its Redis priority is computed
    # Then it is popped last
    assert redis_priority("gpu999", CLASSES) == 9


def test_redis_priority_never_exceeds_kombus_last_step() -> None:
    # Given twelve GPU classes
    many = [SizeClass(name=f"g{i}", gpu_mem_gb=i) for i in range(1, 13)]

    # When the smallest one's priority is computed
    # Then it is clamped to 9
    assert redis_priority("g1", many) == 9
    assert redis_priority("g12", many) == 0
