"""What the API reads of the pool as it is now, outside any one job: the live workers (their
heartbeats), the registered node shapes, each queue's backlog and the tenants' fair-share views.

The explanations read them (a queued job's `pending`, a dry run's `could_run_now`, the queue
view), and so does the placement step of a submission (a job no registered node can hold is
refused). Every waiting client polls its job's status, so what each poll reads is reused for a
moment (`LOAD_CACHE_S`, `NODES_REMEMBER_S`). One `PoolReadings` serves one API process.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime
from typing import Any

import redis

from e31.core import keys
from e31.core.clock import utcnow
from e31.core.records import QueueLoad, SchedulingView
from e31.core.sizeclasses import all_queues
from e31.edge.settings import Settings
from e31.ops import gpuseries, pyenvs
from e31.ops.heartbeat import WorkerInfo, expand_gangs, read_workers
from e31.scheduling import inputs as policy
from e31.scheduling import placement
from e31.scheduling.fairshare import Tenant
from e31.store import Repo
from e31.store.scheduling import running_gpus

log = logging.getLogger(__name__)

LOAD_CACHE_S = 5.0        # a queue's backlog counts behind `pending`, reused this long
NODES_REMEMBER_S = 60.0   # an API process writes the live node shapes to e31:nodes at most
#                           this often: every status poll reads them, and they count for a day


class PoolReadings:
    """The pool's live state as the API reads it, over one store and Redis."""

    def __init__(self, *, settings: Settings, repo: Repo, redis_client: redis.Redis) -> None:
        self._settings = settings
        self._repo = repo
        self._redis = redis_client
        self._loads: dict[str, tuple[float, QueueLoad]] = {}   # queue -> (monotonic s, load)
        self._nodes_written = float("-inf")    # monotonic s of the last write to e31:nodes

    def workers(self, *, expand: bool = True) -> list[WorkerInfo] | None:
        """The live workers from their heartbeats, a gang host's as its GPU sets
        (`heartbeat.expand_gangs`) unless `expand` is False (one per GPU, as the queue view
        counts them); None when Redis cannot be read (which is not the same as no workers: a
        pending reason and the queue view say which)."""
        try:
            workers = read_workers(self._redis)
            return expand_gangs(workers) if expand else workers
        except redis.RedisError as exc:
            log.warning("pool_unreadable: %s", exc)
            return None

    def scheduler_leads(self, workers: list[WorkerInfo] | None) -> bool | None:
        """Whether a scheduler holds the leader's lock (it renews it every tick, and it lapses
        a few ticks after the last one died); None when Redis cannot be read, or (`workers`
        None: the heartbeats just could not be) is not asked again."""
        if workers is None:
            return None
        try:
            return bool(self._redis.exists(keys.LEADER))
        except redis.RedisError as exc:
            log.warning("pool_unreadable: %s", exc)
            return None

    def environments(self, workers: list[WorkerInfo]) -> dict[str, dict[str, Any]] | None:
        """The Python environments `workers` name, by digest (`e31.ops.pyenvs`); None when
        Redis cannot be read."""
        try:
            return pyenvs.read(self._redis, (w.pyenv for w in workers if w.pyenv))
        except redis.RedisError as exc:
            log.warning("pool_unreadable: %s", exc)
            return None

    def gpu_series(self, job_id: str) -> list[dict[str, Any]] | None:
        """A job's GPU readings over its run (`e31.ops.gpuseries`); None when Redis cannot
        be read."""
        try:
            return gpuseries.read(self._redis, job_id)
        except redis.RedisError as exc:
            log.warning("gpu_series_unreadable job=%s: %s", job_id, exc)
            return None

    def shapes(self, workers: list[WorkerInfo] | None) -> placement.Shapes | None:
        """The registered node shapes (`placement.registered`: the live `workers` and those
        seen in the last day); None when Redis cannot be read, and then nothing is refused."""
        if workers is None:
            return None
        remember = bool(workers) and \
            time.monotonic() - self._nodes_written >= NODES_REMEMBER_S
        try:
            nodes = placement.registered(self._redis, workers, remember=remember)
            if remember:
                self._nodes_written = time.monotonic()
            return placement.shapes(nodes)
        except redis.RedisError as exc:
            log.warning("pool_unreadable: %s", exc)
            return None

    def nodes(self) -> placement.Shapes | None:
        """The registered node shapes of the live workers now (what placement checks)."""
        return self.shapes(self.workers())

    def queue_load(self, queue: str, now: datetime) -> QueueLoad:
        """The queue's backlog and recent starts, reused for LOAD_CACHE_S: every waiting
        client polls its job's status, and the backlog read grows with the queue."""
        cached = self._loads.get(queue)
        if cached is not None and time.monotonic() - cached[0] < LOAD_CACHE_S:
            return cached[1]
        fresh = self._repo.queue_load(queue, now=now)
        self._loads[queue] = (time.monotonic(), fresh)
        return fresh

    def view(self, now: datetime) -> SchedulingView:
        """What the scheduler would read now: the tenants, and what runs and waits."""
        return self._repo.scheduling_view(now=now, queues=all_queues(self._settings.size_classes))

    def running_slots(self, view: SchedulingView) -> dict[str, dict[str, int]]:
        """Tenant id -> class -> slots its jobs hold in `view` (a CPU job one; what the queue
        view counts as running)."""
        return running_gpus(view.running, view.outstanding, slots=True)

    def tenant_views(self, view: SchedulingView) -> dict[str, Tenant]:
        """Each tenant's fair-share standing in `view` (its running GPUs against its weight)."""
        return policy.tenant_views(view.tenants, running_gpus(view.running, view.outstanding),
                                   now=utcnow(), half_life_s=self._settings.fair_share_half_life_s)
