"""The worker heartbeat: one record type, how it is written and read, and the scheduler's
wake-up signal. The worker writes it, the scheduler and the API read it; none of them
imports another to do so.

A heartbeat is a JSON string per worker node under `keys.worker(node)` with a TTL of a few
beats: a node whose key expired is gone. `busy_job` is the job the node holds right now;
`gpus_telemetry` the latest reading of each of its GPUs (`GpuSample`, read through NVML, or
made up and marked `simulated` on a worker with `--simulate-gpus`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from e31.core import keys

TTL_INTERVALS = 3  # a heartbeat key outlives this many missed beats, no more
# A worker gone silent (docs/reliability.md, "A dead node noticed in seconds"): no lease renewal
# and no heartbeat for this many heartbeat intervals, never less than SILENT_MIN_S. The
# scheduler takes such a worker's job for lost; the worker, cut off, stops the job itself on
# the same silence, so that two copies do not run on side by side.
SILENT_BEATS = 1.5
SILENT_MIN_S = 2.0


def silence_s(interval_s: float) -> float:
    """How long a worker may be unheard (no renewal, no beat) before it counts as gone."""
    return max(SILENT_BEATS * interval_s, SILENT_MIN_S)
# A node's launcher (`e31 worker`) beats too, for each node it runs, under this prefix: a
# worker process that went silent while its launcher lives is restarted (or frozen), not a
# dead node's (`not_held`).
LAUNCHER_PREFIX = "e31:launcher:"


def launcher_key(node: str) -> str:
    """The key by which `node`'s launcher says it lives."""
    return f"{LAUNCHER_PREFIX}{node}"


@dataclass(frozen=True)
class GpuSample:
    """One reading of one GPU, as its worker relays it. A value the GPU cannot report (NVML:
    not supported) is None, never a made-up zero; `simulated` ones are made up, and say so."""

    index: int                        # the GPU's index on its host (CUDA_DEVICE_ORDER=PCI_BUS_ID)
    util_pct: float | None = None     # 0..100, over the driver's last sample period
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    xid_errors: int = 0               # XID errors seen since its worker process started
    last_xid: int | None = None       # the code of the latest one
    ecc_errors: int | None = None     # uncorrected ECC errors since the driver loaded
    simulated: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> GpuSample | None:
        """The sample in `data`, or None when it is not one (a reader skips it)."""
        if not isinstance(data, dict) or not isinstance(data.get("index"), int):
            return None
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in names})
        except TypeError:
            return None


@dataclass(frozen=True)
class WorkerInfo:
    """One worker node: what it serves and, in a heartbeat, whether it is busy.

    `queues[0]` is its own class's queue, then the queues it spills to; `gpus` is the
    worker's `CUDA_VISIBLE_DEVICES` ("" for a cpu slot).
    """

    node: str
    queues: tuple[str, ...]
    gpus: str
    gpu_count: int = 0
    size_class: str = ""
    busy_job: str | None = None
    isolation: str = ""       # how its jobs run: sandbox | process ("" from an older worker)
    network: str = ""         # its jobs' network: isolated | host | none ("" from an older one)
    gpus_telemetry: tuple[GpuSample, ...] = ()   # its GPUs' latest readings (none: not known)
    # A gang worker (docs/scheduling.md "Gangs on demand") pins no GPU: it consumes its host's
    # queue and runs each job on the GPUs its dispatch names. This is its host's GPU sets a
    # job may be given, each with the class queues it serves; its `gpus` is the one GPU it
    # watches (its telemetry, its XID errors).
    gang: tuple[tuple[str, tuple[str, ...]], ...] = ()
    pyenv: str = ""   # the digest of its Python environment (e31.ops.pyenvs; "": not said)
    # the process that wrote the beat (0: not said): a new one under the same name is a
    # restart, and whatever message the old one had taken died with it (e31.scheduling.departures)
    pid: int = dataclasses.field(default=0, compare=False)

    @property
    def own_class(self) -> str:
        """Its class: the heartbeat's, else its own queue's (`e31.gpu80.x4` -> gpu80)."""
        return self.size_class or (queue_class(self.queues[0]) if self.queues else "")

    @property
    def host(self) -> str:
        return self.node.split("@", 1)[1] if "@" in self.node else self.node

    @property
    def gpu_ids(self) -> frozenset[str]:
        """The GPUs it pins (a gang worker: watches), as `<host>:<index>`: two workers of one
        host may share one."""
        return gpu_ids(self.node, self.gpus)

    def busy(self, job_id: str | None) -> WorkerInfo:
        return dataclasses.replace(self, busy_job=job_id)

    def with_telemetry(self, samples: tuple[GpuSample, ...]) -> WorkerInfo:
        return dataclasses.replace(self, gpus_telemetry=samples)

    def to_json(self) -> str:
        payload: dict[str, Any] = dataclasses.asdict(self)
        payload["queues"] = list(self.queues)
        payload["gpus_telemetry"] = [g.to_dict() for g in self.gpus_telemetry]
        payload["gang"] = [[gpus, list(queues)] for gpus, queues in self.gang]
        payload["pid"] = os.getpid()
        payload["ts"] = time.time()
        return json.dumps(payload)

    @classmethod
    def from_json(cls, raw: str | bytes) -> WorkerInfo:
        data = json.loads(raw)
        return cls(node=data["node"], queues=tuple(data["queues"]), gpus=data.get("gpus", ""),
                   gpu_count=int(data.get("gpu_count") or 0),
                   size_class=data.get("size_class", ""), busy_job=data.get("busy_job"),
                   isolation=str(data.get("isolation") or ""),
                   network=str(data.get("network") or ""),
                   gang=tuple((str(gpus), tuple(map(str, queues)))
                              for gpus, queues in data.get("gang") or ()),
                   pyenv=str(data.get("pyenv") or ""), pid=int(data.get("pid") or 0),
                   gpus_telemetry=tuple(g for g in map(GpuSample.from_dict,
                                                       data.get("gpus_telemetry") or ())
                                        if g is not None))


def gpu_ids(node: str, gpus: str) -> frozenset[str]:
    """GPU indexes `gpus` ("0,1") of `node`'s host as `<host>:<index>`: a worker's, or the GPUs
    a job's attempt holds there (`attempts.gpus`), so that the two can be matched."""
    host = node.rpartition("@")[2]
    return frozenset(f"{host}:{i.strip()}" for i in gpus.split(",") if i.strip())


def queue_class(queue: str) -> str:
    """The size class of a class queue (`e31.gpu80.x4` -> gpu80); "" for any other name."""
    parts = queue.split(".")
    return parts[1] if len(parts) > 1 else ""


def gang_slot(host: str, gpus: str) -> str:
    """The name of one GPU set a host's gang workers may be given: `gang[0,1]@host`."""
    return f"gang[{gpus}]@{host}"


def gang_place(slot: str) -> tuple[str, str] | None:
    """(host, GPU indexes) of a gang slot's name (`gang[0,1]@host`); None for a worker's."""
    if not slot.startswith("gang[") or "]@" not in slot:
        return None
    gpus, host = slot.removeprefix("gang[").split("]@", 1)
    return host, gpus


def expand_gangs(workers: Sequence[WorkerInfo]) -> list[WorkerInfo]:
    """`workers` with each host's gang workers replaced by its GPU sets, one record each (as
    the scheduler and the node shapes count capacity); other workers as they are. A set is
    offered only while each of its GPUs has its own gang worker beating: a GPU whose worker
    was drained (by an operator, or for an XID error on it) or died is out of service."""
    watched: dict[str, set[str]] = defaultdict(set)
    for w in workers:
        if w.gang:
            watched[w.host].update(i.strip() for i in w.gpus.split(",") if i.strip())
    out: list[WorkerInfo] = []
    seen: set[str] = set()
    for w in workers:
        if not w.gang:
            out.append(w)
            continue
        for gpus, queues in w.gang:
            node = gang_slot(w.host, gpus)
            if node not in seen and set(gpus.split(",")) <= watched[w.host]:
                seen.add(node)
                out.append(WorkerInfo(node=node, queues=queues, gpus=gpus,
                                      gpu_count=len(gpus.split(",")),
                                      size_class=queue_class(queues[0]) if queues else "",
                                      isolation=w.isolation, network=w.network,
                                      pyenv=w.pyenv))
    return out


def write(r: redis.Redis, info: WorkerInfo, *, interval_s: float) -> None:
    """Publish `info` as its node's heartbeat, alive for `TTL_INTERVALS` beats."""
    r.set(keys.worker(info.node), info.to_json(), px=int(interval_s * TTL_INTERVALS * 1000))


def withdraw(r: redis.Redis, node: str) -> None:
    """Remove a node's heartbeat, so no more work is planned for it."""
    r.delete(keys.worker(node))


def read_workers(r: redis.Redis) -> list[WorkerInfo]:
    """Live workers from their heartbeats (each key expires when its worker stops beating)."""
    names = list(r.scan_iter(match=keys.worker_pattern(), count=500))
    infos = []
    # one MGET, not a GET per key: an API submit reads them all (the registered node
    # shapes), and a thousand round trips per submit is most of its time at a thousand GPUs
    for start in range(0, len(names), 500):
        for raw in r.mget(names[start:start + 500]):
            if raw:
                infos.append(WorkerInfo.from_json(raw))
    return infos


def beat_launcher(r: redis.Redis, nodes: Sequence[str], *, interval_s: float) -> None:
    """Say that the launcher of `nodes` lives, for `TTL_INTERVALS` beats (one round trip)."""
    pipe = r.pipeline(transaction=False)
    ts = json.dumps({"ts": time.time(), "pid": os.getpid()})
    for node in nodes:
        pipe.set(launcher_key(node), ts, px=int(interval_s * TTL_INTERVALS * 1000))
    pipe.execute()


def not_held(r: redis.Redis, held: Sequence[tuple[str, str]], *, silent_s: float,
             now_s: float | None = None) -> set[str]:
    """Those of `held`'s (job id, node) that their node no longer holds, by its beats: it
    beats and runs another job or none (a worker process its launcher restarted under the
    same name), or neither it nor its launcher has beaten for `silent_s` (a dead node: no
    key, or one written more than `silent_s` ago by the node's own clock, `ts`; the
    scheduler's leases assume the clocks agree, and so does this). A silent worker whose
    launcher beats is left to its lease: its launcher restarts it, and the new process
    says (or it is only frozen). Returns their job ids; one MGET."""
    nodes = list(dict.fromkeys(node for _, node in held))
    if not nodes:
        return set()
    now_s = time.time() if now_s is None else now_s
    raws = r.mget([keys.worker(n) for n in nodes] + [launcher_key(n) for n in nodes])
    beats = {n: _beat(raw) for n, raw in zip(nodes, raws[:len(nodes)], strict=True)}
    launchers = {n: _beat(raw) for n, raw in zip(nodes, raws[len(nodes):], strict=True)}

    def fresh(beat: tuple[float, str | None] | None) -> bool:
        return beat is not None and now_s - beat[0] <= silent_s

    out = set()
    for job_id, node in held:
        beat = beats[node]
        if beat is _UNREADABLE:
            continue
        if fresh(beat):
            if beat is not None and beat[1] != job_id:
                out.add(job_id)
        elif not fresh(launchers[node]):
            out.add(job_id)
    return out


_UNREADABLE = (float("inf"), None)   # a record that cannot be read: never judged by it


def _beat(raw: bytes | str | None) -> tuple[float, str | None] | None:
    """(ts, busy job) of a heartbeat's record; None without one, `_UNREADABLE` for one that
    cannot be read (only its key's TTL says it is gone)."""
    if not raw:
        return None
    try:
        data = json.loads(raw)
        return float(data["ts"]), data.get("busy_job")
    except (ValueError, KeyError, TypeError, AttributeError):
        return _UNREADABLE


def wake(r: redis.Redis) -> None:
    """Ask the scheduler to run a tick now (after a submit or a job's end)."""
    r.rpush(keys.WAKE, "1")
