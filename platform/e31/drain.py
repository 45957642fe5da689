"""Operator drain of worker nodes through Redis (`e31 worker --drain`).

A drain request is a key per node. The node's worker process sees it at its next
heartbeat, stops taking jobs, gives its running job SIGTERM and the kill grace to save a
checkpoint, records it as `drained` (queued again at once, not counted against the user),
and exits; its launcher does not restart it. Starting `e31 worker` again clears the request.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import redis

from e31 import keys
from e31.heartbeat import read_workers

DRAIN_REQUEST_TTL_S = 86400   # a request outlives any drain; it cannot linger for ever
POLL_S = 0.5


def live_nodes(r: redis.Redis, *, host: str | None = None) -> list[str]:
    """Nodes with a live heartbeat, those of `host` only when given (`gpu0@host`)."""
    nodes = sorted(w.node for w in read_workers(r))
    return [n for n in nodes if host is None or n.rpartition("@")[2] == host]


def request_drain(r: redis.Redis, nodes: Iterable[str]) -> None:
    for node in nodes:
        r.set(keys.drain(node), str(time.time()), ex=DRAIN_REQUEST_TTL_S)


def clear_drain(r: redis.Redis, nodes: Iterable[str]) -> None:
    names = [keys.drain(n) for n in nodes]
    if names:
        r.delete(*names)


def wait_drained(r: redis.Redis, nodes: Sequence[str], *, timeout_s: float) -> list[str]:
    """Wait until none of `nodes` has a heartbeat; returns those still live at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        live = set(live_nodes(r))
        left = [n for n in nodes if n in live]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(POLL_S)
