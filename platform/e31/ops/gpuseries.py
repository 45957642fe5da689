"""A job's GPU memory and utilisation over its run: a bounded series per job in Redis, fed
from the telemetry the heartbeat already carries.

The worker holding the job appends a point every `STEP_S` of its beats (`record`): when,
which node, the attempt's GPUs' mean utilisation and their memory used and total. The list
keeps the newest `MAX_POINTS` (at 10 s a point, the last two hours of a run) and expires
`TTL_S` after its last point, so a pool of a thousand busy GPUs holds at most some 80 MB of
it. The API reads it whole (`read`) for a job's page; a point that does not parse is
skipped.
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from e31.core import keys
from e31.ops.heartbeat import WorkerInfo

STEP_S = 10.0
MAX_POINTS = 720
TTL_S = 24 * 3600


def point(info: WorkerInfo, *, at_s: float | None = None) -> dict[str, Any] | None:
    """The series' point of a busy worker's heartbeat; None without readings."""
    samples = info.gpus_telemetry
    if not samples:
        return None
    utils = [g.util_pct for g in samples if g.util_pct is not None]
    used = [g.mem_used_bytes for g in samples if g.mem_used_bytes is not None]
    total = [g.mem_total_bytes for g in samples if g.mem_total_bytes is not None]
    return {"t": round(time.time() if at_s is None else at_s, 3), "node": info.node,
            "util_pct": round(sum(utils) / len(utils), 2) if utils else None,
            "mem_used_bytes": sum(used) if used else None,
            "mem_total_bytes": sum(total) if total else None}


def record(r: redis.Redis, info: WorkerInfo) -> None:
    """Append the point of `info` (a worker busy with a job) to its job's series, in one
    round trip; nothing for an idle worker or one without readings."""
    p = point(info)
    if info.busy_job is None or p is None:
        return
    key = keys.gpu_series(info.busy_job)
    pipe = r.pipeline(transaction=False)
    pipe.rpush(key, json.dumps(p))
    pipe.ltrim(key, -MAX_POINTS, -1)
    pipe.expire(key, TTL_S)
    pipe.execute()


def read(r: redis.Redis, job_id: str) -> list[dict[str, Any]]:
    """The job's points, oldest first ([] when it has none, or they expired)."""
    out = []
    for raw in r.lrange(keys.gpu_series(job_id), 0, -1):
        try:
            p = json.loads(raw)
        except ValueError:
            continue
        if isinstance(p, dict) and isinstance(p.get("t"), int | float):
            out.append(p)
    return out
