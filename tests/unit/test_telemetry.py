"""GPU telemetry (`e31_worker.node.telemetry`): NVML read through a fake at its boundary (an
object with pynvml's function names), XID errors told apart from the job's own, and the
simulated GPUs' values."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from e31_worker.node.telemetry import (
    SIM_JOB_MEM_FRACTION,
    SIM_WORKING_UTIL_PCT,
    GpuFault,
    GpuMonitor,
    NvmlSource,
    open_monitor,
)

GIB = 1024 ** 3


class FakeNvmlError(Exception):
    """pynvml's NVMLError: carries the NVML return code as `value`."""

    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass
class FakeGpu:
    util_pct: int = 0
    used: int = 0
    total: int = 80 * GIB
    temperature_c: int = 40
    power_mw: int = 70_000
    ecc: int = 0
    xids: deque[int] = field(default_factory=deque)
    unsupported: set[str] = field(default_factory=set)


class FakeNvml:
    """The pynvml names telemetry uses, over a few fake GPUs; nothing else."""

    NVMLError = FakeNvmlError
    NVML_ERROR_TIMEOUT = 10
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_TEMPERATURE_GPU = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    nvmlEventTypeXidCriticalError = 8

    def __init__(self, gpus: dict[int, FakeGpu]) -> None:
        self.gpus = gpus
        self.initialised = False
        self.calls: list[str] = []

    def nvmlInit(self) -> None:
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.initialised = False

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        return self.gpus[index]

    def _check(self, gpu: FakeGpu, name: str) -> None:
        assert self.initialised, "NVML used before nvmlInit"
        self.calls.append(name)
        if name in gpu.unsupported:
            raise FakeNvmlError(self.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetUtilizationRates(self, gpu: FakeGpu) -> Any:
        self._check(gpu, "utilization")
        return SimpleNamespace(gpu=gpu.util_pct, memory=0)

    def nvmlDeviceGetMemoryInfo(self, gpu: FakeGpu) -> Any:
        self._check(gpu, "memory")
        return SimpleNamespace(used=gpu.used, total=gpu.total, free=gpu.total - gpu.used)

    def nvmlDeviceGetTemperature(self, gpu: FakeGpu, sensor: int) -> int:
        assert sensor == self.NVML_TEMPERATURE_GPU
        self._check(gpu, "temperature")
        return gpu.temperature_c

    def nvmlDeviceGetPowerUsage(self, gpu: FakeGpu) -> int:
        self._check(gpu, "power")
        return gpu.power_mw

    def nvmlDeviceGetTotalEccErrors(self, gpu: FakeGpu, kind: int, counter: int) -> int:
        assert (kind, counter) == (self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                   self.NVML_VOLATILE_ECC)
        self._check(gpu, "ecc")
        return gpu.ecc

    def nvmlEventSetCreate(self) -> list[FakeGpu]:
        return []

    def nvmlDeviceRegisterEvents(self, gpu: FakeGpu, types: int, events: list[FakeGpu]) -> None:
        assert types == self.nvmlEventTypeXidCriticalError
        self._check(gpu, "events")
        events.append(gpu)

    def nvmlEventSetWait_v2(self, events: list[FakeGpu], timeout_ms: int) -> Any:
        assert timeout_ms == 0, "a reading never waits for an event"
        for gpu in events:
            if gpu.xids:
                return SimpleNamespace(eventType=self.nvmlEventTypeXidCriticalError,
                                       eventData=gpu.xids.popleft())
        raise FakeNvmlError(self.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, events: list[FakeGpu]) -> None:
        events.clear()


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
