"""`WorkerRuntime`: what one pinned worker process holds — its identity, store, artifacts,
Redis, and the heartbeat that tells the scheduler whether it is idle.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis
from e31 import heartbeat, keys
from e31.artifacts import ArtifactStore
from e31.heartbeat import WorkerInfo
from e31.settings import Settings
from e31.store import Repo

from e31_worker.attempt.cgroups import JobCgroups
from e31_worker.attempt.groups import GroupRegistry, NodeLock

log = logging.getLogger(__name__)



class WorkerRuntime:
    def __init__(self, *, settings: Settings, identity: WorkerInfo, repo: Repo,
                 artifacts: ArtifactStore, redis_client: redis.Redis) -> None:
        self.settings = settings
        self.identity = identity
        self.repo = repo
        self.artifacts = artifacts
        self.redis = redis_client
        self.draining = threading.Event()
        # Per node: a restarted worker process finds what its predecessor left running.
        groups_dir = settings.resolved_work_dir / ".groups"
        self.groups = GroupRegistry(groups_dir / identity.node)
        self.node_lock = NodeLock(groups_dir / f"{identity.node}.lock")
        self.cgroups: JobCgroups | None = None  # set up in start()
        self.drain_requested = threading.Event()  # an operator ran `e31 worker --drain`
        self.on_drain: Callable[[], None] = lambda: None
        self._busy_job: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def set_busy(self, job_id: str | None) -> None:
        """Record the job in hand and say so at once (the periodic beat would lag)."""
        self._busy_job = job_id
        try:
            self.beat()
        except redis.RedisError as exc:  # the store's lease says it too; the next beat retries
            log.warning("heartbeat_failed node=%s: %s", self.identity.node, exc)

    def beat(self) -> None:
        """Publish this worker's heartbeat now."""
        if self.draining.is_set():
            heartbeat.withdraw(self.redis, self.identity.node)
            return
        heartbeat.write(self.redis, self.identity.busy(self._busy_job),
                        interval_s=self.settings.heartbeat_interval_s)

    def start(self) -> None:
        """Start the heartbeat thread (once the Celery consumer is ready)."""
        if self._thread is not None:
            return
        self.groups.reap()
        self.cgroups = JobCgroups.for_node(self.identity.node)
        if self.cgroups is not None:
            self.cgroups.reap()
        self._thread = threading.Thread(target=self._loop, name="e31-heartbeat", daemon=True)
        self._thread.start()
        log.info("worker_ready node=%s queues=%s gpus=%r", self.identity.node,
                 ",".join(self.identity.queues), self.identity.gpus)

    def stop(self) -> None:
        """Stop beating and withdraw the heartbeat, so no more work is planned for us."""
        self.draining.set()
        self._stop.set()
        try:
            heartbeat.withdraw(self.redis, self.identity.node)
        except redis.RedisError:
            pass

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.beat()
                self._check_drain()
            except redis.RedisError as exc:
                log.warning("heartbeat_failed node=%s: %s", self.identity.node, exc)
            self._stop.wait(self.settings.heartbeat_interval_s)

    def _check_drain(self) -> None:
        """An operator's drain request: stop as on SIGTERM, and tell the launcher not to restart."""
        if self.drain_requested.is_set() or not self.redis.exists(keys.drain(self.identity.node)):
            return
        log.warning("worker_drain_requested node=%s busy_job=%s: stopping after the running job "
                    "is requeued", self.identity.node, self._busy_job)
        self.drain_requested.set()
        self.on_drain()
