"""The scheduler: the only publisher into Celery (ARCHITECTURE §2, steps 2 and 6).

One leader at a time, elected with a Redis lock; a second scheduler waits. The leader
wakes on a signal (a submit, a job's end) or every tick, recovers what died (expired
leases, messages a restarted or flushed Redis lost), and publishes as many queued jobs per
queue as the idle worker slots can take, plus a small headroom.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from datetime import datetime

import redis
from celery import Celery
from kombu.exceptions import OperationalError as BrokerError

from e31 import keys
from e31.celeryapp import TASK_NAME
from e31.clock import utcnow
from e31.errors import StoreError
from e31.policy import WorkerInfo, idle_workers, order, plan
from e31.settings import Settings
from e31.sizeclasses import redis_priority
from e31.store import Repo
from e31.store.records import Candidate

log = logging.getLogger(__name__)

LEADER_TTL_TICKS = 3       # the lock outlives a few missed ticks, no more
WAKE_POLL_MAX_S = 1.0      # one BLPOP wait; below redis-py's default 5 s socket timeout
CANDIDATE_BATCH = 500      # most jobs read per queue per tick

_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""


def wake(r: redis.Redis) -> None:
    """Ask the scheduler to run a tick now (after a submit or a job's end)."""
    r.rpush(keys.WAKE, "1")


def read_workers(r: redis.Redis) -> list[WorkerInfo]:
    """Live workers from their heartbeats (each key expires when its worker stops beating)."""
    infos = []
    for key in r.scan_iter(match=keys.worker_pattern(), count=500):
        raw = r.get(key)
        if not raw:
            continue
        data = json.loads(raw)
        infos.append(WorkerInfo(node=data["node"], queues=tuple(data["queues"]),
                                gpus=data.get("gpus", ""), busy_job=data.get("busy_job")))
    return infos


class Scheduler:
    def __init__(self, *, settings: Settings, repo: Repo, redis_client: redis.Redis,
                 celery: Celery) -> None:
        self._settings = settings
        self._repo = repo
        self._redis = redis_client
        self._celery = celery
        self._token = uuid.uuid4().hex
        classes = settings.size_classes
        self._rank = lambda queue: redis_priority(queue.split(".")[1], classes)
        self._standby_logged = False
        # Lease expiry is judged only after a full TTL of this scheduler leading with a
        # working store: workers that could not reach the store either get a chance to renew.
        self._expire_leases_after = 0.0   # time.monotonic()

    # -- leadership ----------------------------------------------------------------------

    def _ttl_ms(self) -> int:
        return int(self._settings.scheduler_tick_s * LEADER_TTL_TICKS * 1000)

    def try_lead(self) -> bool:
        """Take or keep the leader lock."""
        if self._redis.set(keys.LEADER, self._token, nx=True, px=self._ttl_ms()):
            return True
        return bool(self._redis.eval(_RENEW, 1, keys.LEADER, self._token, self._ttl_ms()))

    def resign(self) -> None:
        if self._redis.get(keys.LEADER) == self._token.encode():
            self._redis.delete(keys.LEADER)

    # -- one pass ------------------------------------------------------------------------

    def tick(self, now: datetime | None = None) -> int:
        """Publish what the idle capacity can take; returns the number of messages sent."""
        now = now or utcnow()
        self.reconcile(now)
        workers, busy = read_workers(self._redis), self._repo.busy_workers(now=now)
        idle_queues = {q for w in idle_workers(workers, busy) for q in w.queues}
        expired = self._repo.expire_dispatches(sorted(idle_queues), now=now,
                                               timeout_s=self._settings.dispatch_timeout_s)
        if expired:
            log.warning("dispatch_expired count=%d: published again", expired)
        queues = self._repo.queues_with_work(now=now)
        if not queues:
            return 0
        candidates = {q: self._repo.dispatch_candidates(q, now=now, limit=CANDIDATE_BATCH)
                      for q in queues}
        budget = plan(workers, busy,
                      {q: len(c) for q, c in candidates.items()}, self._repo.outstanding_by_queue(),
                      headroom=self._settings.dispatch_headroom, rank=self._rank)
        sent = 0
        for queue, n in budget.items():
            chosen = order(candidates[queue])[:n]
            sent += self._publish(chosen, now)
        return sent

    def hold_lease_expiry(self) -> None:
        """Judge no lease for one TTL: after taking the lead, or after the store was unreachable
        (the workers could not renew then either, and their jobs are alive)."""
        self._expire_leases_after = time.monotonic() + self._settings.lease_ttl_s

    def reconcile(self, now: datetime) -> None:
        """Recover what died: jobs whose lease expired, and messages the broker lost."""
        if time.monotonic() >= self._expire_leases_after:
            for job_id, state in self._repo.expire_leases(now=now,
                                                          lease_ttl_s=self._settings.lease_ttl_s):
                log.warning("lease_expired job=%s: attempt lost, job %s", job_id, state.value)
        if not self._redis.exists(keys.BROKER_EPOCH):
            # Redis restarted without its data or was flushed: the published messages are gone.
            republish = self._repo.expire_dispatches(None, now=now, timeout_s=0)
            self._redis.set(keys.BROKER_EPOCH, now.isoformat())
            log.warning("broker_reset: Redis is new, restarted empty or was flushed; %d published "
                        "jobs lost their messages and are published again", republish)

    def _publish(self, chosen: list[Candidate], now: datetime) -> int:
        ids = set(self._repo.mark_dispatched([c.id for c in chosen], now=now))
        for c in chosen:
            if c.id not in ids:
                continue
            self._celery.send_task(
                TASK_NAME, args=[c.id], queue=c.queue, routing_key=c.queue,
                priority=redis_priority(c.size_class, self._settings.size_classes),
                shadow=f"{c.tenant}/{c.name}")
            log.info("job_published job=%s queue=%s tenant=%s", c.id, c.queue, c.tenant)
        return len(ids)

    # -- loop ----------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Lead (or wait to lead) until `stop` is set."""
        leading = False
        tick_s = self._settings.scheduler_tick_s
        while not stop.is_set():
            try:
                if not self.try_lead():
                    if leading or not self._standby_logged:
                        log.info("scheduler_standby: another scheduler leads; waiting")
                        self._standby_logged = True
                    leading = False
                    stop.wait(tick_s)
                    continue
                if not leading:
                    log.info("scheduler_leading")
                    leading = True
                    self.hold_lease_expiry()
                self.tick()
                self._wait_for_wake(stop, tick_s)
            except (redis.RedisError, BrokerError, StoreError) as exc:
                log.warning("scheduler_error %s: %s; retrying", type(exc).__name__, exc)
                if isinstance(exc, StoreError):
                    self.hold_lease_expiry()
                stop.wait(tick_s)
        self.resign()

    def _wait_for_wake(self, stop: threading.Event, tick_s: float) -> None:
        """Return on a wake-up signal, on `stop`, or after `tick_s`."""
        deadline = time.monotonic() + tick_s
        while not stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self._redis.blpop([keys.WAKE], timeout=min(left, WAKE_POLL_MAX_S)):
                self._redis.delete(keys.WAKE)  # one tick serves every wake-up so far
                return
