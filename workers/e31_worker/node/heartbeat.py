"""`Heartbeat`: tells the scheduler that this worker process lives and whether it is busy,
and watches for an operator's drain request.

A drain request's Redis key only rings the bell: anyone holding the broker's URL can write
one. The node drains only when `drain_authorized` (the store's record of the request,
`e31.ops.drain`) says an operator asked; a key without it is logged `drain_unauthorized` and
ignored (docs/security.md, "The broker is not a trust boundary").

A GPU that reports an XID error its job cannot have caused takes the node out of service
the same way, on the node's own authority: the request, with its reason, is written to the
store (shown by `e31 queue`) and logged `gpu_xid_drain` (`e31_worker.node.telemetry`).

It writes through `e31.ops.heartbeat` (one record type for every reader), with the latest
reading of each of the node's GPUs and the digest of its Python environment, whose record
it keeps alive (`e31.ops.pyenvs`). The attempt layer sees it only as the `busy` callback
and the `draining` event of its `AttemptServices`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import redis

from e31.core import keys
from e31.core.errors import E31Error, StoreError
from e31.ops import gpuseries, heartbeat
from e31.ops.heartbeat import WorkerInfo
from e31.ops.pyenvs import Publisher
from e31_worker.node.telemetry import GpuMonitor, GpuView

log = logging.getLogger(__name__)


class Heartbeat:
    """One worker process's heartbeat thread and its drain state.

    `draining` is set when the process stops (the running job is requeued, no new one is
    claimed); `drain_requested` when an operator asked for it (`e31 worker --drain`), after
    which `on_drain` is called once.

    Its thread survives: an exception of a beat (Redis, the store, the GPU readings, the gang
    ledger's full disk) is logged (`heartbeat_failed`, `heartbeat_error`) and the next beat
    comes at its interval, so the pool never loses a live worker to one fault.
    """

    def __init__(self, *, redis_client: redis.Redis, identity: WorkerInfo, interval_s: float,
                 on_drain: Callable[[], None], drain_authorized: Callable[[], bool],
                 gpus: GpuMonitor | GpuView | None = None,
                 record_drain: Callable[[str], None] | None = None,
                 pyenv: Publisher | None = None) -> None:
        self.identity = identity
        self.draining = threading.Event()
        self.gpu_fault = threading.Event()   # the drain is for a GPU's error (gpu_fault)
        self.drain_requested = threading.Event()
        self._redis = redis_client
        self._interval_s = interval_s
        self._on_drain = on_drain
        self._drain_authorized = drain_authorized
        self._gpus = gpus                  # None: a cpu slot, or no telemetry
        self._record_drain = record_drain  # writes the node's own drain request, with why
        self._pyenv = pyenv                # its Python environment, named by its beats
        self._refused_logged = False   # one `drain_unauthorized` line per unauthorized key
        self._busy_job: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # When a beat last reached Redis (time.monotonic()): a worker unheard for as long as
        # it has not renewed its lease stops its job (e31_worker.attempt.watchdog).
        self.last_beat = time.monotonic()
        self._next_point = float("-inf")   # when the busy job's next GPU point is due

    def set_busy(self, job_id: str | None) -> None:
        """Record the job in hand and say so at once (the periodic beat would lag). A
        stopping worker's job handed back ends its beats (`stop`)."""
        self._busy_job = job_id
        self._next_point = float("-inf")   # a new job's series starts at once
        if job_id is None and self.draining.is_set():
            self._stop.set()
        try:
            self.beat()
        except redis.RedisError as exc:  # the store's lease says it too; the next beat retries
            log.warning("heartbeat_failed node=%s: %s", self.identity.node, exc)

    def beat(self) -> None:
        """Publish this worker's heartbeat now (withdraw it while draining, once its job is
        handed back)."""
        if self.draining.is_set() and self._busy_job is None:
            heartbeat.withdraw(self._redis, self.identity.node)
            return
        info = self.identity.busy(self._busy_job)
        if self._pyenv is not None and self._pyenv.digest:
            info = dataclasses.replace(info, pyenv=self._pyenv.digest)
        if self._gpus is not None:
            info = info.with_telemetry(self._gpus.current(busy=self._busy_job is not None))
        heartbeat.write(self._redis, info, interval_s=self._interval_s)
        self.last_beat = time.monotonic()
        if self._pyenv is not None:
            self._pyenv.renew(self._redis)
        if info.busy_job is not None and info.gpus_telemetry \
                and self.last_beat >= self._next_point:   # the job's GPU series, bounded
            gpuseries.record(self._redis, info)
            self._next_point = self.last_beat + gpuseries.STEP_S

    def start(self) -> None:
        """Start the heartbeat thread (once the Celery consumer is ready)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="e31-heartbeat", daemon=True)
        self._thread.start()
        log.info("worker_ready node=%s queues=%s gpus=%r", self.identity.node,
                 ",".join(self.identity.queues), self.identity.gpus)

    def stop(self) -> None:
        """Stop beating and withdraw the heartbeat, so no more work is planned for us. A
        worker that holds a job beats on with it until the job is handed back (`set_busy`):
        the scheduler takes a running job whose worker no longer beats with it for a dead
        worker's (docs/reliability.md, "A dead node noticed in seconds"), and a drained
        job's last upload may outlast its lease's last renewal by more than that silence."""
        self.draining.set()
        if self._busy_job is not None:
            return
        self._stop.set()
        try:
            heartbeat.withdraw(self._redis, self.identity.node)
        except redis.RedisError:
            pass

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.beat()
                self._check_gpu_faults()
                self._check_drain()
            except redis.RedisError as exc:
                log.warning("heartbeat_failed node=%s: %s", self.identity.node, exc)
            except Exception:  # a thread that died here would leave the
                # process up and the pool without this worker (a full disk's OSError from
                # the gang ledger did): say it, and beat again at the next interval
                log.exception("heartbeat_error node=%s: beating on", self.identity.node)
            self._stop.wait(self._interval_s)

    def _check_drain(self) -> None:
        """An operator's drain request: stop as on SIGTERM, and tell the launcher not to restart.
        The Redis key is looked at every beat, the store only while a key is there."""
        if self.drain_requested.is_set():
            return
        if not self._redis.exists(keys.drain(self.identity.node)):
            self._refused_logged = False
            return
        try:
            authorized = self._drain_authorized()
        except StoreError as exc:  # the next beat asks again
            log.warning("drain_check_failed node=%s: %s", self.identity.node, exc)
            return
        if not authorized:
            if not self._refused_logged:
                log.warning("drain_unauthorized node=%s: a drain key in Redis, but the store "
                            "holds no drain request for this node; ignored", self.identity.node)
                self._refused_logged = True
            return
        log.warning("worker_drain_requested node=%s busy_job=%s: stopping after the running job "
                    "is requeued", self.identity.node, self._busy_job)
        self.drain_requested.set()
        self._on_drain()

    def _check_gpu_faults(self) -> None:
        """An XID error that is not the job's doing: drain as an operator's request would,
        the reason recorded in the store first (a store that fails does not stop the drain)."""
        faults = self._gpus.faults() if self._gpus is not None else []
        if not faults or self.drain_requested.is_set():
            return
        reason = "GPU error: " + ", ".join(str(f) for f in faults)
        log.error("gpu_xid_drain node=%s busy_job=%s reason=%r: taking this worker out of "
                  "service; `e31 worker` started again brings it back", self.identity.node,
                  self._busy_job, reason)
        if self._record_drain is not None:
            try:
                self._record_drain(reason)
            except (E31Error, redis.RedisError) as exc:
                log.warning("drain_record_failed node=%s: %s", self.identity.node, exc)
        self.gpu_fault.set()
        self.drain_requested.set()
        self._on_drain()
