"""The worker heartbeat: one record type, how it is written and read, and the scheduler's
wake-up signal. The worker writes it, the scheduler and the API read it; none of them
imports another to do so.

A heartbeat is a JSON string per worker node under `keys.worker(node)` with a TTL of a few
beats: a node whose key expired is gone. `busy_job` is the job the node holds right now.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import redis

from e31 import keys

TTL_INTERVALS = 3  # a heartbeat key outlives this many missed beats, no more


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

    @property
    def host(self) -> str:
        return self.node.split("@", 1)[1] if "@" in self.node else self.node

    @property
    def gpu_ids(self) -> frozenset[str]:
        """The GPUs it pins, as `<host>:<index>`: two workers of one host may share one."""
        return frozenset(f"{self.host}:{i.strip()}" for i in self.gpus.split(",") if i.strip())

    def busy(self, job_id: str | None) -> WorkerInfo:
        return dataclasses.replace(self, busy_job=job_id)

    def to_json(self) -> str:
        payload: dict[str, Any] = dataclasses.asdict(self)
        payload["queues"] = list(self.queues)
        payload["pid"] = os.getpid()
        payload["ts"] = time.time()
        return json.dumps(payload)

    @classmethod
    def from_json(cls, raw: str | bytes) -> WorkerInfo:
        data = json.loads(raw)
        return cls(node=data["node"], queues=tuple(data["queues"]), gpus=data.get("gpus", ""),
                   gpu_count=int(data.get("gpu_count") or 0),
                   size_class=data.get("size_class", ""), busy_job=data.get("busy_job"),
                   isolation=str(data.get("isolation") or ""))


def write(r: redis.Redis, info: WorkerInfo, *, interval_s: float) -> None:
    """Publish `info` as its node's heartbeat, alive for `TTL_INTERVALS` beats."""
    r.set(keys.worker(info.node), info.to_json(), px=int(interval_s * TTL_INTERVALS * 1000))


def withdraw(r: redis.Redis, node: str) -> None:
    """Remove a node's heartbeat, so no more work is planned for it."""
    r.delete(keys.worker(node))


def read_workers(r: redis.Redis) -> list[WorkerInfo]:
    """Live workers from their heartbeats (each key expires when its worker stops beating)."""
    infos = []
    for key in r.scan_iter(match=keys.worker_pattern(), count=500):
        raw = r.get(key)
        if raw:
            infos.append(WorkerInfo.from_json(raw))
    return infos


def wake(r: redis.Redis) -> None:
    """Ask the scheduler to run a tick now (after a submit or a job's end)."""
    r.rpush(keys.WAKE, "1")
