"""The workers' Python environments in Redis: each stored once, under its digest, for a caller
to check a function call against before it stores a job (docs/notebooks.md, "How a call
travels").

A worker computes its environment once, at its start (`functioncalls.environment`), names its
digest in every heartbeat (`WorkerInfo.pyenv`) and keeps the environment itself alive here
(`Publisher`): the heartbeat stays small, and a thousand workers of one image share one key.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import redis

from e31.core import keys
from e31.core.functioncalls import environment_digest

TTL_S = 24 * 3600    # an environment no live worker renews is gone within a day
RENEW_S = 60.0       # a worker renews its environment's key at most this often

log = logging.getLogger(__name__)


class Publisher:
    """One worker's environment, kept in Redis by its heartbeat (`renew`, every beat)."""

    def __init__(self, env: Mapping[str, Any] | None = None) -> None:
        self._text = ""
        self.digest = ""                 # "": not read yet; the beats name none meanwhile
        self._renewed = float("-inf")    # monotonic s of the last renewal
        if env is not None:
            self._set(env)

    @classmethod
    def reading(cls, read: Callable[[], Mapping[str, Any]]) -> Publisher:
        """A publisher whose environment `read` reads in its own thread (some 0.2 s of
        package metadata), so that no worker's start waits for it."""
        publisher = cls()

        def run() -> None:
            try:
                publisher._set(read())
            except Exception:   # the workers' own check remains
                log.exception("pyenv_unread: callers' calls are checked on the worker only")

        threading.Thread(target=run, name="e31-pyenv", daemon=True).start()
        return publisher

    def _set(self, env: Mapping[str, Any]) -> None:
        self._text = json.dumps(env, sort_keys=True, separators=(",", ":"))
        self.digest = environment_digest(env)   # last: a digest always has its text

    def renew(self, r: redis.Redis) -> None:
        """Extend the key's life; write it again when it is missing (its first beat, a Redis
        that restarted empty). At most once per `RENEW_S`: one EXPIRE, rarely a SET."""
        now = time.monotonic()
        if not self.digest or now - self._renewed < RENEW_S:
            return
        if not r.expire(keys.pyenv(self.digest), TTL_S):
            r.set(keys.pyenv(self.digest), self._text, ex=TTL_S)
        self._renewed = now


def read(r: redis.Redis, digests: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The environments of `digests` that Redis holds (one MGET); an unreadable one is left
    out, as a missing one is: the caller does not check against what it cannot read."""
    wanted = sorted(set(digests))
    if not wanted:
        return {}
    found: dict[str, dict[str, Any]] = {}
    for digest, raw in zip(wanted, r.mget([keys.pyenv(d) for d in wanted]), strict=True):
        try:
            env = json.loads(raw) if raw else None
        except ValueError:
            env = None
        if isinstance(env, dict):
            found[digest] = env
    return found
