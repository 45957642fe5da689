"""`plan_slots`: which pinned worker processes `e31 worker` runs, and what each consumes."""

from __future__ import annotations

import pytest

from e31.core.errors import ConfigError
from e31.core.sizeclasses import DEFAULT_SIZE_CLASSES
from e31_worker.node.gpus import parse_simulated
from e31_worker.node.launcher import WorkerSlot, plan_slots

CLASSES = DEFAULT_SIZE_CLASSES


def slots_for(simulated: str | None, *, cpu_slots: int = 0, spill: bool = True,
              group: int = 1) -> list[WorkerSlot]:
    gpus = parse_simulated(simulated) if simulated else []
    return plan_slots(gpus, cpu_slots=cpu_slots, spill=spill, group=group, classes=CLASSES,
                      host="h")


def test_each_gpu_and_cpu_slot_gets_its_own_pinned_worker_that_spills_to_smaller_classes() -> None:
    # Given a 24 GB GPU, a 48 GB GPU and one cpu slot
    # When the slots are planned with spill
    slots = slots_for("1x24,1x48", cpu_slots=1)

    # Then there is one worker per GPU, pinned by index, and one cpu worker with no GPU
    assert [(s.node, s.queues, s.gpus) for s in slots] == [
        ("gpu0@h", ("e31.gpu24",), "0"),
        ("gpu1@h", ("e31.gpu48", "e31.gpu24"), "1"),
        ("cpu0@h", ("e31.cpu",), ""),
    ]
    assert [(s.size_class, s.gpu_count) for s in slots] == [("gpu24", 1), ("gpu48", 1), ("cpu", 0)]


def test_without_spill_a_worker_consumes_only_its_own_class() -> None:
    # Given a 24 GB and a 48 GB GPU
    # When the slots are planned with --no-spill
    slots = slots_for("1x24,1x48", spill=False)

    # Then each consumes its own queue only
    assert [(s.node, s.queues) for s in slots] == [("gpu0@h", ("e31.gpu24",)),
                                                   ("gpu1@h", ("e31.gpu48",))]


def test_reported_memory_a_little_under_the_class_still_serves_it() -> None:
    # Given an H200 as NVML reports it
    # When the slots are planned without spill
    [slot] = slots_for("1x140.4", spill=False)

    # Then it serves gpu141
    assert slot.queues == ("e31.gpu141",)


def test_gpus_in_groups_of_two_give_one_worker_per_pair_on_the_x2_queue() -> None:
    # Given four 24 GB GPUs
    # When the slots are planned in groups of 2
    slots = slots_for("4x24", group=2)

    # Then two workers, each holding a pair, consume e31.gpu24.x2
    assert [(s.gpus, s.queues, s.gpu_count) for s in slots] == [
        ("0,1", ("e31.gpu24.x2",), 2),
        ("2,3", ("e31.gpu24.x2",), 2),
    ]
    assert len({s.node for s in slots}) == 2


def test_a_group_of_mixed_gpus_serves_the_class_of_its_smallest_member() -> None:
    # Given an 80 GB and a 24 GB GPU grouped together
    # When the slots are planned without spill
    [slot] = slots_for("1x80,1x24", group=2, spill=False)

    # Then the pair serves only what the 24 GB GPU can
    assert slot.size_class == "gpu24"
    assert slot.queues == ("e31.gpu24.x2",)


def test_a_group_that_does_not_divide_the_gpus_is_a_config_error() -> None:
    # Given three GPUs
    # When they are planned in groups of 2
    # Then it is refused, naming the flag
    with pytest.raises(ConfigError, match="--group 2"):
        slots_for("3x24", group=2)


def test_a_group_below_one_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--group"):
        slots_for("2x24", group=0)


def test_no_gpus_and_no_cpu_slots_is_a_config_error() -> None:
    # Given a machine without GPUs and no cpu slots asked for
    # When the slots are planned
    # Then it is refused, saying how to serve something
    with pytest.raises(ConfigError, match="--cpu-slots"):
        slots_for(None, cpu_slots=0)


def test_cpu_slots_alone_serve_the_cpu_queue() -> None:
    # Given no GPUs and two cpu slots
    # When the slots are planned
    slots = slots_for(None, cpu_slots=2)

    # Then two cpu workers with distinct node names and no GPUs
    assert [(s.node, s.queues, s.gpus) for s in slots] == [
        ("cpu0@h", ("e31.cpu",), ""), ("cpu1@h", ("e31.cpu",), "")]


def test_cpu_slots_without_a_cpu_class_are_a_config_error() -> None:
    # Given a configuration without a cpu class
    gpu_only = [c for c in CLASSES if c.gpu_mem_gb > 0]

    # When cpu slots are asked for
    # Then it is refused
    with pytest.raises(ConfigError, match="cpu"):
        plan_slots([], cpu_slots=1, spill=True, group=1, classes=gpu_only, host="h")


def test_a_worker_killed_from_outside_comes_back_at_once_but_a_crash_loop_backs_off() -> None:
    import signal

    from e31_worker.node.launcher import RESTART_BACKOFF_S, Launcher
    backoff = {"gpu0@h": RESTART_BACKOFF_S}

    # A process that dies on its own right after starting, three times: 1, 2, 4 s
    crashes = [Launcher._restart_delay(1, 0.5, backoff, "gpu0@h") for _ in range(3)]
    # then one SIGKILLed (an operator, the OOM killer) soon after its start: back at once
    killed = Launcher._restart_delay(-signal.SIGKILL, 0.5, backoff, "gpu0@h")
    # and the next crash starts the back-off over
    after = Launcher._restart_delay(1, 0.5, backoff, "gpu0@h")

    assert crashes == [1.0, 2.0, 4.0]
    assert killed == RESTART_BACKOFF_S
    assert after == RESTART_BACKOFF_S
