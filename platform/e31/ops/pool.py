"""The pool as its heartbeats and the store's leases show it: each worker slot with its state
(idle, busy, draining, lost) and the per-GPU readings a worker relays in its heartbeat. Pure:
the metrics (`e31.ops.scrape`) and `e31 top` (`e31.api.services.top`) read Redis and the store and
shape their answers with this.

A worker that beats is `busy` when it holds a job (its heartbeat says so, or the store has
a live lease in its name) or, a gang worker, while a job holds the GPU it watches;
`draining` when an operator or the worker itself asked it to drain, else `idle`. A node the
store still shows holding a lease but that no longer beats is `lost` — unless it is draining,
which withdraws its heartbeat on purpose while it finishes.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from e31.ops.heartbeat import WorkerInfo, gpu_ids

IDLE, BUSY, DRAINING, LOST = "idle", "busy", "draining", "lost"


class Lease(Protocol):
    """A running job's lease as the store shows it (`e31.core.records.LeaseHolder` is one)."""

    @property
    def node(self) -> str: ...

    @property
    def size_class(self) -> str: ...

    @property
    def gpus(self) -> int: ...

    @property
    def live(self) -> bool: ...

    @property
    def held_gpus(self) -> str: ...


@dataclass(frozen=True)
class Slot:
    """One worker slot: its node, class, GPUs (count and `host:index` ids) and state."""

    node: str
    size_class: str
    gpu_count: int
    state: str
    gpu_indexes: tuple[str, ...] = ()
    job: str | None = None     # the job it holds, where its heartbeat names it


def slots(workers: Iterable[WorkerInfo], leases: Iterable[Lease],
          draining: Collection[str]) -> list[Slot]:
    """Every worker slot the pool has or had a moment ago, with its state."""
    holding: dict[str, Lease] = {}
    held: set[str] = set()                   # the GPUs (`host:index`) live leases' attempts hold
    for lease in leases:
        if lease.node:
            holding.setdefault(lease.node, lease)
            if lease.live:
                held |= gpu_ids(lease.node, lease.held_gpus)
    out = []
    beating = set()
    for w in workers:
        beating.add(w.node)
        own = holding.get(w.node)
        indexes = tuple(i.strip() for i in w.gpus.split(",") if i.strip())
        if w.node in draining:
            state = DRAINING
        elif w.gang:      # a gang worker's slot is the GPU it watches, busy while a job holds it
            state = BUSY if w.gpu_ids & held else IDLE
        elif w.busy_job is not None or (own is not None and own.live):
            state = BUSY
        else:
            state = IDLE
        out.append(Slot(node=w.node, size_class=w.own_class, gpu_count=w.gpu_count,
                        state=state, gpu_indexes=indexes,
                        job=None if w.gang else w.busy_job))
    for node, lease in sorted(holding.items()):
        if node not in beating:
            out.append(Slot(node=node, size_class=lease.size_class, gpu_count=lease.gpus,
                            state=DRAINING if node in draining else LOST))
    return out


@dataclass(frozen=True)
class GpuReading:
    """One GPU's telemetry as its worker relayed it; None where it sent no value. `index`
    is the GPU's index on its host (as in CUDA_VISIBLE_DEVICES with PCI bus order)."""

    index: str
    utilization_ratio: float | None = None      # 0..1
    memory_used_bytes: float | None = None
    memory_total_bytes: float | None = None
    temperature_celsius: float | None = None
    power_watts: float | None = None
    xid_errors: float | None = None
    ecc_errors: float | None = None
    simulated: float | None = None               # 1.0 simulated, 0.0 real


def gpu_readings(w: WorkerInfo) -> list[GpuReading]:
    """The per-GPU readings in `w`'s heartbeat (`WorkerInfo.gpus_telemetry`; none from a
    worker that sends none).

    Read defensively: the heartbeat may come from an older or newer worker, so a field that
    is missing or not a number is no value, never a made-up zero.
    """
    raw = getattr(w, "gpus_telemetry", None) or ()
    out = []
    for item in raw if isinstance(raw, Sequence) else ():
        index = _field(item, "index")
        if isinstance(index, bool) or not isinstance(index, int | str):
            continue
        pct = _number(_field(item, "util_pct"))
        simulated = _field(item, "simulated")
        out.append(GpuReading(
            index=str(index), utilization_ratio=None if pct is None else pct / 100.0,
            memory_used_bytes=_number(_field(item, "mem_used_bytes")),
            memory_total_bytes=_number(_field(item, "mem_total_bytes")),
            temperature_celsius=_number(_field(item, "temperature_c")),
            power_watts=_number(_field(item, "power_w")),
            xid_errors=_number(_field(item, "xid_errors")),
            ecc_errors=_number(_field(item, "ecc_errors")),
            simulated=None if simulated is None else float(bool(simulated))))
    return out


def _field(item: Any, name: str) -> Any:
    if isinstance(item, Mapping):
        return item.get(name)
    return getattr(item, name, None)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)
