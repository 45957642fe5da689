"""One snapshot of the pool for `e31 top` (`GET /v1/top`, `e31.api.routes.top`): each class's
GPUs (busy, idle, draining, lost; utilisation and memory from the workers' heartbeats), its
backlog and oldest runnable wait, each GPU with its readings, and the running jobs with their
tenant, runtime and GPU use. A tenant's token sees its own jobs by id and name and everyone
else's merged into `others` per class, as `e31 queue` does; an admin's sees every job.

A CPU class's workers hold no GPU: its `gpus`, `busy_gpus`, `idle_gpus`… count its slots
instead, one a worker (as `e31 queue` does), and its `slot_kind` says `cpu` (a GPU class's,
`gpu`), so a CPU worker running a job shows busy 1, not busy 0 idle 0.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol

import redis

from e31.core import metrics
from e31.core.clock import utcnow
from e31.core.records import LeaseHolder, TenantRecord
from e31.edge.settings import Settings
from e31.ops import pool, scrape
from e31.ops.heartbeat import gpu_ids
from e31.store.pool import RunningRow

log = logging.getLogger(__name__)

OTHERS = "others"   # how a tenant's token sees every other tenant (as in `e31 queue`)


class TopReads(Protocol):
    """What the snapshot reads from the store (`e31.store.Repo` is one)."""

    def backlog(self, *, now: datetime) -> dict[str, tuple[int, datetime | None]]: ...

    def running_jobs(self) -> list[RunningRow]: ...


class TopService:
    """The snapshot of `/v1/top`, read from the store and the workers' heartbeats in Redis."""

    def __init__(self, *, settings: Settings, reads: TopReads, redis_client: redis.Redis) -> None:
        self._classes = [c.name for c in settings.size_classes]
        self._cpu_classes = frozenset(c.name for c in settings.size_classes
                                      if c.gpu_mem_gb == 0)
        self._reads = reads
        self._redis = redis_client

    def top(self, viewer: TenantRecord) -> dict[str, Any]:
        """The pool now as `viewer` may see it: classes, GPUs, running jobs (its own, or all
        for an admin's token)."""
        now = utcnow()
        backlog = self._reads.backlog(now=now)
        running = self._reads.running_jobs()
        try:
            view: scrape.PoolView | None = scrape.read_pool_view(self._redis)
        except redis.RedisError as exc:
            log.warning("top_workers_unknown: %s", exc)
            view = None
        return snapshot(classes=self._classes, backlog=backlog, running=running, view=view,
                        viewer=viewer, now=now, cpu_classes=self._cpu_classes)


def snapshot(*, classes: Sequence[str], backlog: dict[str, tuple[int, datetime | None]],
             running: Sequence[RunningRow], view: scrape.PoolView | None,
             viewer: TenantRecord, now: datetime,
             cpu_classes: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The answer of `/v1/top` (pure: `TopService.top` reads, this shapes). The slots of
    `cpu_classes` count one a worker (they hold no GPU)."""
    leases = [LeaseHolder(r.node or "", r.size_class, r.gpus,
                          bool(r.lease_expires_at and r.lease_expires_at > now),
                          held_gpus=r.held_gpus)
              for r in running]
    workers = view.workers if view is not None else ()
    slots = pool.slots(workers, leases, view.draining if view is not None else ())
    readings = {(w.host, g.index): g for w in workers for g in pool.gpu_readings(w)}
    job_on_node = {r.node: r for r in running if r.node}
    # the job on each GPU: its attempt's GPUs (a gang host's worker runs jobs on others' GPUs)
    job_on_gpu = {g: r for r in running if r.node for g in gpu_ids(r.node, r.held_gpus)}
    visible = {r.id for r in running if viewer.admin or r.tenant_id == viewer.id}

    gpus = []
    for s in slots:
        host = s.node.rpartition("@")[2]
        for index in s.gpu_indexes:
            g = readings.get((host, index))
            held = job_on_gpu.get(f"{host}:{index}")
            if held is None and (r := job_on_node.get(s.node)) is not None and not r.held_gpus:
                held = r          # an attempt that recorded no GPUs: its worker's
            gpus.append({"node": host, "worker": s.node, "gpu": index,
                         "size_class": s.size_class, "state": s.state,
                         "job": held.id if held is not None and held.id in visible else None,
                         **_reading(g)})

    jobs: list[dict[str, Any]] = []
    others: defaultdict[str, dict[str, int]] = defaultdict(lambda: {"jobs": 0, "gpus": 0})
    for r in running:
        if r.id not in visible:
            o = others[r.size_class]
            o["jobs"] += 1
            o["gpus"] += r.gpus
            continue
        mine = [g for g in gpus if g["job"] == r.id]
        utils = [g["utilization"] for g in mine if g["utilization"] is not None]
        mems = [g["memory_used_bytes"] for g in mine if g["memory_used_bytes"] is not None]
        jobs.append({
            "id": r.id, "name": r.name, "tenant": r.tenant, "size_class": r.size_class,
            "gpus": r.gpus, "node": r.node, "attempt": r.attempt,
            "runtime_s": round((now - r.started_at).total_seconds(), 1) if r.started_at else None,
            "progress": (round(r.progress_done / r.progress_total, 4)
                         if r.progress_done is not None and r.progress_total else None),
            "gpu_utilization": round(sum(utils) / len(utils), 4) if utils else None,
            "gpu_memory_used_bytes": int(sum(mems)) if mems else None,
            "idle_since": r.idle_since.isoformat() if r.idle_since else None})

    out_classes = []
    for cls in dict.fromkeys([*classes, *backlog, *(s.size_class for s in slots)]):
        mine_slots = [s for s in slots if s.size_class == cls]
        mine_gpus = [g for g in gpus if g["size_class"] == cls]
        queued, oldest = backlog.get(cls, (0, None))
        if not mine_slots and not queued and not any(r.size_class == cls for r in running):
            continue
        cpu = cls in cpu_classes
        by_state = {st: sum(_slot_count(s, cpu) for s in mine_slots if s.state == st)
                    for st in metrics.WORKER_STATES}
        utils = [g["utilization"] for g in mine_gpus if g["utilization"] is not None]
        out_classes.append({
            "size_class": cls, "slot_kind": "cpu" if cpu else "gpu",
            "workers": len(mine_slots), "gpus": sum(_slot_count(s, cpu) for s in mine_slots),
            **{f"{st}_gpus": n for st, n in by_state.items()},
            "queued": queued, "running": sum(1 for r in running if r.size_class == cls),
            "oldest_queued_s": round((now - oldest).total_seconds(), 1) if oldest else None,
            "utilization": round(sum(utils) / len(utils), 4) if utils else None,
            "memory_used_bytes": _total(mine_gpus, "memory_used_bytes"),
            "memory_total_bytes": _total(mine_gpus, "memory_total_bytes")})
    return {"at": now.isoformat(), "workers_known": view is not None, "classes": out_classes,
            "gpus": gpus, "running": jobs,
            "others": [{"tenant": OTHERS, "size_class": cls, **o}
                       for cls, o in sorted(others.items())]}


def _slot_count(s: pool.Slot, cpu: bool) -> int:
    """What a worker slot counts for in its class: its GPUs, or one for a CPU worker."""
    return s.gpu_count or (1 if cpu else 0)


def _reading(g: pool.GpuReading | None) -> dict[str, Any]:
    """A GPU's readings as JSON; null where its worker sent none."""
    def num(value: float | None) -> float | None:
        return None if value is None else round(value, 4)
    return {"utilization": num(g.utilization_ratio) if g else None,
            "memory_used_bytes": int(g.memory_used_bytes) if g and g.memory_used_bytes
            is not None else None,
            "memory_total_bytes": int(g.memory_total_bytes) if g and g.memory_total_bytes
            is not None else None,
            "temperature_celsius": num(g.temperature_celsius) if g else None,
            "power_watts": num(g.power_watts) if g else None,
            "simulated": bool(g.simulated) if g and g.simulated is not None else None}


def _total(rows: Sequence[dict[str, Any]], key: str) -> int | None:
    values = [r[key] for r in rows if r[key] is not None]
    return int(sum(values)) if values else None
