"""GPU telemetry (`e31_worker.node.telemetry`): NVML read through a fake at its boundary (an
object with pynvml's function names), XID errors told apart from the job's own, and the
simulated GPUs' values."""

from __future__ import annotations

from collections import deque

import pytest

from e31.edge.settings import Settings
from e31_worker.attempt.services import HeldGpus
from e31_worker.node.celery_process import gpu_monitor
from e31_worker.node.gpus import Gpu, parse_simulated
from e31_worker.node.launcher import plan_slots
from e31_worker.node.telemetry import (
    SIM_JOB_MEM_FRACTION,
    SIM_WORKING_UTIL_PCT,
    GpuFault,
    GpuMonitor,
    GpuView,
    NvmlSource,
    open_monitor,
)
from tests.unit.fake_nvml import GIB, FakeGpu, FakeNvml, FakeNvmlError


def nvml_monitor(fake: FakeNvml, indexes: list[int]) -> GpuMonitor:
    monitor = open_monitor(indexes, max_age_s=60.0, nvml=fake)
    assert monitor is not None
    return monitor


def test_nvml_values_are_read_per_pinned_gpu_in_the_heartbeats_units() -> None:
    # Given two GPUs of a host, the worker pinned to GPU 1 only
    fake = FakeNvml({0: FakeGpu(util_pct=99), 1: FakeGpu(util_pct=87, used=11 * GIB,
                                                          temperature_c=61, power_mw=312_500,
                                                          ecc=2)})
    monitor = nvml_monitor(fake, [1])

    # When it samples
    [sample] = monitor.sample(True)

    # Then it read GPU 1, in bytes, degrees and watts, and not simulated
    assert sample.index == 1
    assert (sample.util_pct, sample.mem_used_bytes, sample.mem_total_bytes) == (
        87.0, 11 * GIB, 80 * GIB)
    assert (sample.temperature_c, sample.power_w, sample.ecc_errors) == (61.0, 312.5, 2)
    assert (sample.xid_errors, sample.last_xid, sample.simulated) == (0, None, False)
    monitor.close()
    assert not fake.initialised


def test_a_value_the_gpu_does_not_report_is_none_not_zero() -> None:
    # Given a board without power or ECC readings, nor XID events
    fake = FakeNvml({0: FakeGpu(util_pct=5, unsupported={"power", "ecc", "events"})})

    # When it is sampled
    [sample] = nvml_monitor(fake, [0]).sample(None)

    # Then those values are unknown and the others there
    assert sample.power_w is None and sample.ecc_errors is None
    assert sample.util_pct == 5.0


def test_an_xid_error_is_counted_and_a_hardware_one_is_a_fault_once() -> None:
    # Given a GPU that reports a page fault of the job's kernel (31) and then fell off the
    # bus (79)
    gpu = FakeGpu()
    monitor = nvml_monitor(FakeNvml({0: gpu}), [0])
    gpu.xids.extend([31, 79])

    # When it is sampled
    [sample] = monitor.sample(True)

    # Then both count, the last is known, and only the hardware one is a fault, reported once
    assert (sample.xid_errors, sample.last_xid) == (2, 79)
    assert monitor.faults() == [GpuFault(index=0, xid=79)]
    assert str(GpuFault(index=0, xid=79)) == "XID 79 on GPU 0"
    assert monitor.faults() == []
    assert monitor.sample(True)[0].xid_errors == 2   # counts keep, nothing new


def test_an_application_xid_alone_is_no_fault() -> None:
    gpu = FakeGpu(xids=deque([13, 43]))
    monitor = nvml_monitor(FakeNvml({0: gpu}), [0])
    assert monitor.sample(True)[0].xid_errors == 2
    assert monitor.faults() == []


def test_the_current_reading_is_reused_while_fresh_and_read_again_when_stale() -> None:
    # Given a monitor whose readings stay fresh for a minute
    fake = FakeNvml({0: FakeGpu(util_pct=10)})
    monitor = nvml_monitor(fake, [0])
    monitor.sample(True)
    fake.gpus[0].util_pct = 70

    # Then the heartbeat reuses the attempt's reading, and a stale one is read again
    assert monitor.current(busy=True)[0].util_pct == 10.0
    stale = GpuMonitor(NvmlSource.open([0], fake), max_age_s=0.0)
    assert stale.current(busy=True)[0].util_pct == 70.0


def test_a_machine_without_nvml_runs_without_telemetry() -> None:
    class NoDriver(FakeNvml):
        def nvmlInit(self) -> None:
            raise FakeNvmlError(9)   # NVML_ERROR_DRIVER_NOT_LOADED

    assert open_monitor([0], max_age_s=1.0, nvml=NoDriver({})) is None
    assert open_monitor([], max_age_s=1.0) is None   # a cpu slot has no GPUs


def test_simulated_gpus_say_so_and_follow_the_workers_state() -> None:
    # Given two simulated GPUs of 24 GB
    monitor = open_monitor([2, 3], simulated_mem_gb=[24.0, 24.0], max_age_s=1.0)
    assert monitor is not None

    # When read idle, under a job that shows nothing, and under a job at work
    idle, still, working = monitor.sample(None), monitor.sample(False), monitor.sample(True)

    # Then every reading is marked simulated, with values that follow from the state
    assert [s.index for s in idle] == [2, 3]
    assert all(s.simulated for s in (*idle, *still, *working))
    assert [(s.util_pct, s.mem_used_bytes) for s in idle] == [(0.0, 0)] * 2
    held = int(24 * GIB * SIM_JOB_MEM_FRACTION)
    assert [(s.util_pct, s.mem_used_bytes) for s in still] == [(0.0, held)] * 2
    assert [(s.util_pct, s.mem_used_bytes) for s in working] == [(SIM_WORKING_UTIL_PCT, held)] * 2
    assert working[0].temperature_c > idle[0].temperature_c
    assert working[0].power_w > still[0].power_w > idle[0].power_w
    assert monitor.faults() == []
    assert monitor.sample(True) == working   # deterministic


@pytest.mark.parametrize("mem", [[24.0], [24.0, 24.0, 80.0]])
def test_simulated_memories_must_match_the_gpus(mem: list[float]) -> None:
    with pytest.raises(ValueError):
        open_monitor([0, 1], simulated_mem_gb=mem, max_age_s=1.0)


def test_simulated_gpus_reach_their_worker_process_as_their_memories() -> None:
    # Given a machine simulating a 24 GB and an 80 GB GPU, and one with a real GPU
    simulated = plan_slots(parse_simulated("1x24,1x80"), cpu_slots=1, spill=False, group=1,
                           classes=Settings().size_classes, host="h")
    real = plan_slots([Gpu(index=0, mem_gb=80.0, name="NVIDIA H100")], cpu_slots=0, spill=False,
                      group=1, classes=Settings().size_classes, host="h")

    # Then each simulated slot carries its GPU's memory, a real or cpu slot nothing
    assert [s.simulated_mem_gb for s in simulated] == [(24.0,), (80.0,), ()]
    assert real[0].simulated_mem_gb == ()

    # And its worker process reads them as simulated GPUs
    monitor = gpu_monitor("1", "80", Settings())
    assert monitor is not None and monitor.sample(None)[0].simulated
    assert gpu_monitor("", "", Settings()) is None


def test_a_gang_worker_relays_its_own_gpu_and_its_attempt_watches_the_gpus_it_holds() -> None:
    # Given a 4-GPU gang host: the worker watching GPU 2 reads all four (its jobs may be
    # given any of them), and GPU 3 fell off the bus
    planned = plan_slots(parse_simulated("4x80"), cpu_slots=0, spill=False, group=1,
                         classes=Settings().size_classes, host="h", gangs=True)
    assert planned[2].gpus == "2" and planned[2].simulated_mem_gb == (80.0,) * 4
    gpus = {i: FakeGpu(util_pct=10 * i) for i in range(4)}
    monitor = nvml_monitor(FakeNvml(gpus), [0, 1, 2, 3])
    gpus[3].xids.append(79)
    own = GpuView(monitor, "2")

    # Then its heartbeat relays GPU 2 alone, and GPU 3's fault is not its to act on
    assert [s.index for s in own.current(busy=False)] == [2]
    assert own.faults() == []
    # And an attempt it runs on GPUs 0-1 is watched on those two only
    assert [s.util_pct for s in HeldGpus(monitor, "0,1").sample(True)] == [0.0, 10.0]
    # while the worker watching GPU 3 (its own monitor) takes the fault
    gpus_3 = {i: FakeGpu() for i in range(4)}
    watching_3 = GpuView(nvml_monitor(FakeNvml(gpus_3), [0, 1, 2, 3]), "3")
    gpus_3[3].xids.append(79)
    watching_3.sample(True)
    assert watching_3.faults() == [GpuFault(index=3, xid=79)]


def test_a_gang_hosts_simulated_gpus_are_held_as_its_ledger_says() -> None:
    # Given a simulated 2-GPU gang host whose ledger says GPU 1 is held (by any worker's job)
    monitor = open_monitor([0, 1], simulated_mem_gb=[24.0, 24.0], max_age_s=1.0,
                           simulated_held=lambda: [1])
    assert monitor is not None
    # Then GPU 1 reads as under a job and GPU 0 as idle, whatever this worker holds
    free, held = monitor.sample(None)
    assert (free.mem_used_bytes, free.util_pct) == (0, 0.0)
    assert held.mem_used_bytes == int(24 * GIB * SIM_JOB_MEM_FRACTION)
    assert held.util_pct == SIM_WORKING_UTIL_PCT
    # and an attempt that showed no work since its last reading reads its GPU at 0 %
    assert monitor.sample(False)[1].util_pct == 0.0
