"""GPU telemetry in the worker process: each pinned GPU's utilisation, memory, temperature,
power and XID / ECC error counts, read through NVML, or made up for `--simulate-gpus`.

NVML is the driver's management library, not CUDA: reading it initialises no CUDA context,
so the worker process still never touches CUDA (only the job's child does). One
`GpuMonitor` per worker process serves two readers: the heartbeat (the latest reading of
each GPU travels in `WorkerInfo.gpus_telemetry`; docs/operations.md, "Monitoring") and the
running attempt's watchdog, which samples every beat while a job runs
(`e31_worker.attempt.watchdog`). An XID error that the job's own code cannot have caused
takes the worker out of service (`GpuMonitor.faults`, acted on by the node's heartbeat).
Telemetry has no thread of its own: a reading that raises is the heartbeat's to survive
(`heartbeat_error`) or the watchdog's (`gpu_sample_failed`, the beat counted as work).

Simulated GPUs report the same series, marked `simulated`, with values that follow from the
worker's state alone, so tests and demos see them move: an idle GPU reads 0 % and no memory;
a GPU under a job holds `SIM_JOB_MEM_FRACTION` of its memory and reads `SIM_WORKING_UTIL_PCT`
while the job shows signs of work (its log or progress moved since the last reading), else 0 %.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from e31.ops.heartbeat import GpuSample
from e31_worker.attempt.services import HeldGpus

log = logging.getLogger(__name__)

# XIDs the job's own code causes (an illegal memory access, a faulting kernel, a context torn
# down when its process died): counted and exported, but no sign of a broken GPU, so they do
# not take the worker out of service; a user could otherwise drain the pool at will.
# NVIDIA's XID catalogue: 13 graphics engine exception, 31 GPU memory page fault,
# 43 GPU stopped processing, 45 preemptive cleanup.
APPLICATION_XIDS = frozenset({13, 31, 43, 45})
XID_EVENTS_PER_READ = 64      # events taken from a GPU's queue per reading; the rest next time

SIM_JOB_MEM_FRACTION = 0.5    # of a simulated GPU's memory that a job holds
SIM_WORKING_UTIL_PCT = 60.0   # a simulated GPU's utilisation while its job shows work
SIM_IDLE_TEMPERATURE_C = 30.0
SIM_TEMPERATURE_C_PER_PCT = 0.4   # degrees over idle per percent of utilisation
SIM_IDLE_POWER_W = 25.0
SIM_JOB_POWER_W = 60.0            # a job holding memory, not computing
SIM_POWER_W_PER_PCT = 2.5
BYTES_PER_GB = 1024 ** 3
MW_PER_W = 1000


@dataclass(frozen=True)
class GpuFault:
    """An XID error that is not the job's own doing: the GPU needs an operator."""

    index: int
    xid: int

    def __str__(self) -> str:
        return f"XID {self.xid} on GPU {self.index}"


class NvmlSource:
    """Readings of `indexes` through NVML (`pynvml`, from the nvidia-ml-py package, or any
    object with its function names: the unit tests hand in a fake). XID errors arrive as NVML
    events, one event set per GPU, taken without waiting at each reading."""

    def __init__(self, nvml: Any, indexes: Sequence[int]) -> None:
        self._nvml = nvml
        self._indexes = list(indexes)
        self._handles: dict[int, Any] = {}
        self._events: dict[int, Any] = {}
        self._xids: dict[int, int] = dict.fromkeys(self._indexes, 0)
        self._last_xid: dict[int, int | None] = dict.fromkeys(self._indexes, None)
        self._new: list[GpuFault] = []

    @classmethod
    def open(cls, indexes: Sequence[int], nvml: Any = None) -> NvmlSource:
        """Initialise NVML and find the GPUs; raises what NVML raises (no driver, no GPU)."""
        if nvml is None:
            import pynvml
            nvml = pynvml
        nvml.nvmlInit()
        source = cls(nvml, indexes)
        try:
            source._open()
        except Exception:
            nvml.nvmlShutdown()
            raise
        return source

    def _open(self) -> None:
        nvml = self._nvml
        for i in self._indexes:
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            self._handles[i] = handle
            try:
                events = nvml.nvmlEventSetCreate()
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
            except nvml.NVMLError as exc:  # a GPU without XID events (some consumer boards)
                log.warning("gpu_xid_events_unavailable gpu=%d: %s", i, exc)
                continue
            self._events[i] = events

    def read(self, job_active: bool | None) -> tuple[GpuSample, ...]:
        """Read every GPU now (`job_active` is the simulation's business; NVML sees for
        itself). A value the GPU does not report is None."""
        del job_active
        return tuple(self._read_one(i) for i in self._indexes)

    def _read_one(self, index: int) -> GpuSample:
        nvml, handle = self._nvml, self._handles[index]
        self._take_xids(index)
        util = self._value(lambda: float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu))
        mem = self._value(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        temperature = self._value(lambda: float(nvml.nvmlDeviceGetTemperature(
            handle, nvml.NVML_TEMPERATURE_GPU)))
        power = self._value(lambda: nvml.nvmlDeviceGetPowerUsage(handle) / MW_PER_W)
        ecc = self._value(lambda: int(nvml.nvmlDeviceGetTotalEccErrors(
            handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)))
        return GpuSample(index=index, util_pct=util,
                         mem_used_bytes=int(mem.used) if mem is not None else None,
                         mem_total_bytes=int(mem.total) if mem is not None else None,
                         temperature_c=temperature, power_w=power, xid_errors=self._xids[index],
                         last_xid=self._last_xid[index], ecc_errors=ecc)

    def _value(self, read: Any) -> Any:
        try:
            return read()
        except self._nvml.NVMLError:   # not supported on this GPU, or a transient failure
            return None

    def _take_xids(self, index: int) -> None:
        events = self._events.get(index)
        if events is None:
            return
        nvml = self._nvml
        for _ in range(XID_EVENTS_PER_READ):
            try:
                event = nvml.nvmlEventSetWait_v2(events, 0)
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) != nvml.NVML_ERROR_TIMEOUT:
                    # Not "no event waiting": this GPU's events cannot be read; said once.
                    log.warning("gpu_xid_events_unavailable gpu=%d: %s", index, exc)
                    self._free(self._events.pop(index))
                return
            if not event.eventType & nvml.nvmlEventTypeXidCriticalError:
                continue
            xid = int(event.eventData)
            self._xids[index] += 1
            self._last_xid[index] = xid
            self._new.append(GpuFault(index, xid))

    def take_faults(self) -> list[GpuFault]:
        """The XID errors seen since the last call, in order."""
        new, self._new = self._new, []
        return new

    def _free(self, events: Any) -> None:
        try:
            self._nvml.nvmlEventSetFree(events)
        except self._nvml.NVMLError:
            pass

    def close(self) -> None:
        for events in self._events.values():
            self._free(events)
        self._events.clear()
        self._nvml.nvmlShutdown()


class SimulatedSource:
    """Made-up readings of simulated GPUs (`--simulate-gpus`), each marked `simulated`:
    deterministic, from whether a job holds the worker and shows work (module docstring).
    A gang worker's GPUs are held by whichever attempt of its host was given them: `held`
    then names the GPUs held now (the host's ledger), and a GPU another worker's job holds
    reads as working."""

    def __init__(self, mem_gb: dict[int, float],
                 held: Callable[[], Collection[int]] | None = None) -> None:
        self._mem_gb = dict(mem_gb)
        self._held = held

    def read(self, job_active: bool | None) -> tuple[GpuSample, ...]:
        taken = set(self._held()) if self._held is not None else None
        out = []
        for index, mem_gb in self._mem_gb.items():
            held = job_active is not None if taken is None else index in taken
            util = SIM_WORKING_UTIL_PCT if held and job_active is not False else 0.0
            base_w = SIM_JOB_POWER_W if held else SIM_IDLE_POWER_W
            total = int(mem_gb * BYTES_PER_GB)
            out.append(GpuSample(
                index=index, util_pct=util,
                mem_used_bytes=int(total * SIM_JOB_MEM_FRACTION) if held else 0,
                mem_total_bytes=total,
                temperature_c=SIM_IDLE_TEMPERATURE_C + SIM_TEMPERATURE_C_PER_PCT * util,
                power_w=base_w + SIM_POWER_W_PER_PCT * util,
                xid_errors=0, last_xid=None, ecc_errors=0, simulated=True))
        return tuple(out)

    def take_faults(self) -> list[GpuFault]:
        return []

    def close(self) -> None:
        pass


Source = NvmlSource | SimulatedSource


class GpuMonitor:
    """The worker process's GPU readings, shared by its heartbeat thread and its running
    attempt: `sample` reads now, `current` gives a reading no older than `max_age_s`,
    `faults` the XID errors that take the worker out of service. Thread-safe."""

    def __init__(self, source: Source, *, max_age_s: float) -> None:
        self._source = source
        self._max_age_s = max_age_s
        self._lock = threading.Lock()
        self._latest: tuple[GpuSample, ...] = ()
        self._read_at = float("-inf")
        self._faults: list[GpuFault] = []

    def sample(self, job_active: bool | None) -> tuple[GpuSample, ...]:
        """Read every GPU now. `job_active`: None when no job holds the worker, else whether
        the job showed work since the last reading (only simulated GPUs use it)."""
        with self._lock:
            self._latest = self._source.read(job_active)
            self._read_at = time.monotonic()
            for fault in self._source.take_faults():
                if fault.xid in APPLICATION_XIDS:
                    log.warning("gpu_xid gpu=%d xid=%d: caused by the job's own code; the GPU "
                                "stays in service", fault.index, fault.xid)
                else:
                    self._faults.append(fault)
            return self._latest

    def current(self, *, busy: bool) -> tuple[GpuSample, ...]:
        """The latest reading, read again when older than `max_age_s` (a busy worker's
        attempt samples every beat; one in its setup, or an idle one, does not)."""
        with self._lock:
            if time.monotonic() - self._read_at <= self._max_age_s:
                return self._latest
        return self.sample(False if busy else None)

    def faults(self) -> list[GpuFault]:
        """The XID errors outside `APPLICATION_XIDS` seen since the last call."""
        with self._lock:
            faults, self._faults = self._faults, []
            return faults

    def close(self) -> None:
        with self._lock:
            self._source.close()


class GpuView(HeldGpus):
    """Some of a monitor's GPUs. A gang worker's monitor reads every GPU of its host: its
    heartbeat relays (and its XID drain watches) only its own GPU, as its running attempt
    watches only the GPUs it was given (`HeldGpus`; docs/scheduling.md, "Gangs on demand")."""

    def __init__(self, monitor: GpuMonitor, gpus: str) -> None:
        super().__init__(monitor, gpus)
        self._monitor = monitor

    def current(self, *, busy: bool) -> tuple[GpuSample, ...]:
        return self._only(self._monitor.current(busy=busy))

    def faults(self) -> list[GpuFault]:
        """Its GPUs' faults; another GPU's are its own worker's to act on."""
        return [f for f in self._monitor.faults() if f.index in self._indexes]


def open_monitor(indexes: Sequence[int], *, simulated_mem_gb: Sequence[float] = (),
                 max_age_s: float, nvml: Any = None,
                 simulated_held: Callable[[], Collection[int]] | None = None
                 ) -> GpuMonitor | None:
    """The monitor of the worker's GPUs: simulated ones when `simulated_mem_gb` gives their
    memories, else through NVML; None for a CPU slot, or where NVML cannot be read (the
    worker then runs without telemetry, and says so)."""
    if not indexes:
        return None
    if simulated_mem_gb:
        return GpuMonitor(SimulatedSource(dict(zip(indexes, simulated_mem_gb, strict=True)),
                                          held=simulated_held),
                          max_age_s=max_age_s)
    try:
        source = NvmlSource.open(indexes, nvml)
    except Exception as exc:  # noqa: BLE001 - no library, no driver: run on without telemetry
        log.warning("gpu_telemetry_unavailable gpus=%s: NVML: %s: %s", list(indexes),
                    type(exc).__name__, exc)
        return None
    return GpuMonitor(source, max_age_s=max_age_s)
