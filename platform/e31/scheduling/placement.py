"""Registered node shapes, and whether a job's GPUs fit any of them (docs/scheduling.md,
"Refused or explained: registered node shapes").

A node is a host; its shape is how many GPUs of each size class one job could get there: the
GPUs of the host's workers that consume the class's queues (their own class, or a smaller one
they spill to). The registered nodes are those the live heartbeats show now, plus those shown
in the last `NODE_MEMORY_S` (`keys.NODES`): a pool whose workers are all restarting for a
moment does not refuse every job.

A job of k GPUs of class C is impossible when some registered node serves C but none has k
GPUs for it. A class that no registered node serves is not up (a fresh pool, a class scaled to
zero): its jobs wait for a worker (`no_workers`) instead of being refused, and so does every
job when no node is registered at all.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

import redis

from e31.core import keys
from e31.core.sizeclasses import QUEUE_PREFIX
from e31.ops.heartbeat import WorkerInfo, expand_gangs

NODE_MEMORY_S = 86400.0   # a node's shape counts for a day after its last heartbeat was seen

Shapes = Mapping[str, Mapping[str, int]]
"""size class -> host -> GPUs one job of that class could get on that host."""


def shapes(workers: Iterable[WorkerInfo]) -> Shapes:
    """Each class's GPUs per host: the distinct GPUs of the host's workers serving the class."""
    gpus: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for w in workers:
        ids = w.gpu_ids
        if not ids:
            continue                 # a cpu slot: no GPU for any class
        for q in w.queues:
            if q.startswith(QUEUE_PREFIX):
                gpus[q.removeprefix(QUEUE_PREFIX).split(".", 1)[0]][w.host] |= ids
    return {c: {h: len(ids) for h, ids in hosts.items()} for c, hosts in gpus.items()}


def missing(size_class: str, gpus: int, known: Shapes) -> str | None:
    """Why no registered node could ever run `gpus` GPUs of `size_class`, or None when one
    could (or when nothing is known of the class: not up, not impossible)."""
    hosts = known.get(size_class)
    if gpus < 1 or not hosts:
        return None
    host, most = max(sorted(hosts.items()), key=lambda item: item[1])
    if most >= gpus:
        return None
    return (f"no node with {gpus} × {size_class} is registered "
            f"(largest: {most} × {size_class} on {host})")


def registered(r: redis.Redis, live: Sequence[WorkerInfo], *, remember: bool = True,
               now_s: float | None = None) -> list[WorkerInfo]:
    """The registered nodes' workers: `live` (the heartbeats just read; with `remember`,
    written under `keys.NODES` for `NODE_MEMORY_S`), and those remembered from the last day
    that are not live now. Raises `redis.RedisError` when Redis cannot be read."""
    now_s = time.time() if now_s is None else now_s
    live = expand_gangs(live)     # a gang host's GPU sets, as the scheduler counts them
    if live and remember:
        pipe = r.pipeline(transaction=False)
        pipe.hset(keys.NODES, mapping={w.node: json.dumps(
            {"queues": list(w.queues), "gpus": w.gpus, "ts": now_s}) for w in live})
        pipe.expire(keys.NODES, int(NODE_MEMORY_S))
        pipe.execute()
    seen = {w.node for w in live}
    out = list(live)
    stale = []
    for raw_node, raw in r.hgetall(keys.NODES).items():
        node = raw_node.decode() if isinstance(raw_node, bytes) else str(raw_node)
        try:
            data = json.loads(raw)
            ts, queues, gpus = float(data["ts"]), tuple(data["queues"]), str(data["gpus"])
        except (ValueError, KeyError, TypeError):
            stale.append(node)
            continue
        if now_s - ts > NODE_MEMORY_S:
            stale.append(node)
        elif node not in seen:
            out.append(WorkerInfo(node=node, queues=queues, gpus=gpus))
    if stale:
        r.hdel(keys.NODES, *stale)
    return out
