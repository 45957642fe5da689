"""Operator drain of worker nodes (`e31 worker --drain`): recorded in the store, rung in Redis.

A drain request is a row per node in the store (the authority) and a key per node in Redis
(the bell). The node's worker process looks at its key at each heartbeat; when it is there,
it asks the store whether an operator asked (`drain_authorized`), and only then stops taking
jobs, gives its running job SIGTERM and the kill grace to save a checkpoint, records it as
`drained` (queued again at once, not counted against the user), and exits; its launcher
does not restart it. Anyone holding the broker's URL can write the key, so a key alone
drains nothing (docs/security.md, "The broker is not a trust boundary"). Starting
`e31 worker` again clears both.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Protocol

import redis

from e31.core import keys
from e31.core.clock import utcnow
from e31.ops.heartbeat import read_workers

DRAIN_REQUEST_TTL_S = 86400   # a request outlives any drain; it cannot linger for ever
POLL_S = 0.5


class DrainRecords(Protocol):
    """Where drain requests are kept with authority: the store (`e31.store.Repo` is one)."""

    def request_drain(self, nodes: Sequence[str], *, now: datetime,
                      reason: str | None = None) -> None: ...

    def drain_requested(self, node: str, *, since: datetime) -> bool: ...

    def clear_drain(self, nodes: Sequence[str]) -> int: ...


def live_nodes(r: redis.Redis, *, host: str | None = None) -> list[str]:
    """Nodes with a live heartbeat, those of `host` only when given (`gpu0@host`)."""
    nodes = sorted(w.node for w in read_workers(r))
    return [n for n in nodes if host is None or n.rpartition("@")[2] == host]


def request_drain(r: redis.Redis, records: DrainRecords, nodes: Iterable[str], *,
                  reason: str | None = None) -> None:
    """Ask `nodes` to drain: the store's record first, so that the bell finds it. `reason`:
    why, when a node takes itself out of service (a GPU's XID error); None for an operator."""
    names = list(dict.fromkeys(nodes))
    now = utcnow()
    records.request_drain(names, now=now, reason=reason)
    for node in names:
        r.set(keys.drain(node), now.isoformat(), ex=DRAIN_REQUEST_TTL_S)


def drain_authorized(records: DrainRecords, node: str) -> bool:
    """Whether the store holds an operator's drain request for `node`, made within
    `DRAIN_REQUEST_TTL_S` (an older one that its launcher could not clear counts no more)."""
    return records.drain_requested(node, since=utcnow() - timedelta(seconds=DRAIN_REQUEST_TTL_S))


def clear_drain(r: redis.Redis, nodes: Iterable[str]) -> None:
    """Silence the bells of `nodes`; their store records go with `DrainRecords.clear_drain`."""
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
