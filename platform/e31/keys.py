"""Every Redis key E31 Batch uses, in one place."""

from __future__ import annotations

PREFIX = "e31"

WAKE = f"{PREFIX}:scheduler:wake"           # list: pushed on submit / job end; scheduler BLPOPs it
LEADER = f"{PREFIX}:scheduler:leader"       # string: the leading scheduler's token, with a TTL
WORKER_PREFIX = f"{PREFIX}:worker:"         # string per worker node: its heartbeat JSON, with a TTL


def worker(node: str) -> str:
    """Heartbeat key of one worker node."""
    return f"{WORKER_PREFIX}{node}"


def worker_pattern() -> str:
    return f"{WORKER_PREFIX}*"
