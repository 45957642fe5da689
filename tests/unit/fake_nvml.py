"""A fake NVML at the telemetry's boundary: an object with the pynvml names
`e31_worker.node.telemetry` calls, over a few fake GPUs whose values a test sets."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

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
