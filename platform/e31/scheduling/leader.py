"""The scheduler: the only publisher into Celery (docs/architecture.md, "The path of a job").

One leader at a time, elected with a Redis lock; a second scheduler waits. The leader
wakes on a signal (a submit, a job's end) or every tick, recovers what died (expired
leases, the jobs of workers gone silent, messages a restarted or flushed Redis lost), and
lets `admission.decide` choose what the free worker slots (plus a small headroom) take:
priority band, then the tenant furthest below its fair share, then age; quotas; a
reservation for a big job that waited too long (docs/scheduling.md). Every candidate it
does not publish gets a pending reason.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from datetime import datetime

import redis
from celery import Celery
from kombu.exceptions import OperationalError as BrokerError

from e31.core import keys, metrics
from e31.core.clock import utcnow
from e31.core.errors import SchedulingError, StoreError
from e31.core.names import printable
from e31.core.records import Candidate, SchedulingView
from e31.core.sizeclasses import all_queues, node_queue, redis_priority
from e31.edge.celeryapp import TASK_NAME
from e31.edge.settings import Settings
from e31.ops.heartbeat import WorkerInfo, gang_place, not_held, read_workers, silence_s
from e31.scheduling import inputs
from e31.scheduling.admission import AdmissionConfig, Decision, Dispatch, Slot, decide
from e31.scheduling.departures import Departures, consumed
from e31.scheduling.fairshare import Reason
from e31.scheduling.preemption import PreemptConfig, Waiter, plan
from e31.store.scheduling import SchedulingStore, running_gpus

log = logging.getLogger(__name__)

LEADER_TTL_TICKS = 3       # the lock outlives a few missed ticks, no more
WAKE_POLL_MAX_S = 1.0      # one BLPOP wait; below the socket timeout that follows
# The scheduler's Redis calls answer within a BLPOP wait; one that does not (seen once in
# the chaos suite: a 5 s stall at redis-py's default) is an error, and the tick is retried
# at once rather than holding up every lease expiry and publication behind it.
REDIS_SOCKET_TIMEOUT_S = 2.0
TOKEN_SHOWN = "..."        # what a message's display form shows in place of its dispatch token
# A dead node noticed in seconds (docs/reliability.md): a running job whose lease was not
# renewed for `silence_s` (e31.ops.heartbeat), and whose worker has not beaten for as long or
# beats without it, is lost now, not at its lease's expiry; looked for this often (in
# intervals, and no more often than the floor) between ticks.
SILENCE_CHECK_BEATS = 0.5
SILENCE_CHECK_MIN_S = 0.5

_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""


class Scheduler:
    """The leader loop over the scheduler's store (`repo`: a `SchedulingStore`, or a `Repo`,
    which is one), one Redis client (its calls bounded by REDIS_SOCKET_TIMEOUT_S in the
    `e31 scheduler` process) and one Celery app."""

    def __init__(self, *, settings: Settings, repo: SchedulingStore, redis_client: redis.Redis,
                 celery: Celery) -> None:
        self._settings = settings
        self._repo = repo
        self._redis = redis_client
        self._celery = celery
        self._token = uuid.uuid4().hex
        self._config = AdmissionConfig(half_life_s=settings.fair_share_half_life_s,
                                       reserve_after_s=settings.reserve_after_s,
                                       big_job_min_gpus=settings.big_job_min_gpus,
                                       spill_max_s=settings.spill_max_s)
        self._preempt = PreemptConfig(
            grace_s=settings.preempt_grace_s if settings.preemption else None,
            min_runtime_s=settings.preempt_min_runtime_s)
        self._reserved_for: str | None = None
        self._queues = all_queues(settings.size_classes)
        self._tenant_names: dict[str, str] = {}   # for Flower's task names
        self._standby_logged = False
        self._errors = metrics.ErrorTally("scheduler")   # for the metrics (keys.HEALTH)
        # Lease expiry is judged only after a full TTL of this scheduler leading with a
        # working store: workers that could not reach the store either get a chance to renew.
        self._expire_leases_after = 0.0   # time.monotonic()
        # Silence is judged only after a TTL with Redis's data intact (a flush or a restart
        # empties every heartbeat at once); the leases' own hold applies too.
        self._judge_silence_after = 0.0   # time.monotonic()
        self._silence_checked = 0.0       # time.monotonic() of the last look for silence
        # the queues of workers that left, whose taken messages may have died with them
        self._departures = Departures(window_s=settings.dispatch_timeout_s)

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

    def tick(self, now: datetime | None = None, *, recover: bool = True) -> int:
        """Publish what the free capacity can take, by policy; returns the messages sent.
        `recover=False` leaves out the recovery of what died (expired leases, lost and stale
        publications: two write transactions); the loop recovers at most once a tick
        interval, so a burst of wake-ups (a job ending every few milliseconds) does not
        repeat it at each."""
        now = now or utcnow()
        if recover:
            self.reconcile(now)
        workers = read_workers(self._redis)
        view = self._repo.scheduling_view(now=now, queues=self._queues)
        busy = {r.node for r in view.running if r.lease_live and r.node}
        # an idle gang worker serves the class queues of its host's GPU sets
        idle_queues = {q for w in inputs.idle_workers(workers, busy) for q in consumed(w)}
        for node in self._departures.observe(workers, now_s=now.timestamp()):
            log.info("worker_left node=%s: its queues' unclaimed messages are published again "
                     "when a consumer is idle", node)
        expired = self._repo.expire_dispatches(
            sorted(idle_queues), now=now,
            timeout_s=self._settings.dispatch_timeout_s) if recover else 0
        if recover:
            expired += self._expire_departed(idle_queues, now)
        if expired:
            log.warning("dispatch_expired count=%d: published again", expired)
            view = self._repo.scheduling_view(now=now, queues=self._queues)
        self._tenant_names = {t.id: t.name for t in view.tenants}
        decision, heads, slots = self._decide(workers, view, now)
        sent = self._publish([(heads[d.job_id], d) for d in decision.publish], now,
                             pending=self._pending_changes(decision, heads))
        self._preempt_for_waiting(view, slots, decision, heads, now)
        return sent

    def _expire_departed(self, idle_queues: set[str], now: datetime) -> int:
        """Publish again, at once, the unclaimed publications of the queues whose consumer
        left since they were made (`e31.scheduling.departures`), where a consumer is idle now,
        rather than after the dispatch timeout. Returns how many."""
        due = self._departures.due(idle_queues)
        expired = 0
        for since in sorted(set(due.values())):
            queues = sorted(q for q, at in due.items() if at == since)
            expired += self._repo.expire_dispatches(
                queues, now=now, timeout_s=max(0.0, now.timestamp() - since))
        self._departures.cleared(due)
        return expired

    def _preempt_for_waiting(self, view: SchedulingView, slots: list[Slot], decision: Decision,
                             heads: dict[str, Candidate], now: datetime) -> None:
        """Ask the running jobs that `preemption.plan` chooses to stop, for the jobs that have
        waited for capacity past the grace: the heads this tick could not place, and those
        published that no worker has taken."""
        if self._preempt.grace_s is None:
            return
        blocked = [heads[job_id] for job_id, p in decision.pending.items()
                   if p.reason is Reason.NO_CAPACITY]
        waiting = [Waiter(c.id, c.tenant_id, c.queue, c.gpus, c.priority,
                          c.queued_since_s or c.submitted_at_s) for c in blocked]
        waiting += [Waiter(p.id, p.tenant_id, p.queue, p.gpus, p.priority,
                           p.queued_since.timestamp())
                    for p in view.outstanding if p.queued_since is not None]
        plans = plan(now_s=now.timestamp(), slots=slots, running=view.running, waiting=waiting,
                     weights={t.id: t.weight for t in view.tenants}, config=self._preempt)
        if not plans:
            return
        asked = set(self._repo.request_preemption(
            [v for p in plans for v in p.victims], now=now))
        for p in plans:
            for victim in p.victims:
                if victim in asked:
                    log.info("job_preempting job=%s for=%s worker=%s", victim, p.for_job, p.node)

    def _decide(self, workers: list[WorkerInfo], view: SchedulingView,
                now: datetime) -> tuple[Decision, dict[str, Candidate], list[Slot]]:
        slots = inputs.slots(workers, view.running, headroom=self._settings.dispatch_headroom,
                             placed=view.outstanding)
        outstanding: dict[str, int] = {}
        bounds: dict[str, list[float]] = {}
        for p in view.outstanding:
            if p.dispatch_host is not None:   # a gang dispatch holds its own GPUs (slots)
                continue
            outstanding[p.queue] = outstanding.get(p.queue, 0) + 1
            bounds.setdefault(p.queue, []).append(p.timeout_s)
        k = inputs.heads_per_queue(slots, outstanding,
                                   per_tenant=self._settings.heads_per_tenant)
        heads = {h.id: h for h in self._repo.heads(k, now=now)} if k else {}
        tenants = inputs.tenant_views(view.tenants, running_gpus(view.running, view.outstanding),
                                      now=now, half_life_s=self._config.half_life_s)
        decision = decide(now_s=now.timestamp(), slots=slots, tenants=tenants,
                          heads=inputs.per_queue(heads.values()), outstanding=outstanding,
                          config=self._config, outstanding_timeout_s=bounds)
        r = decision.reservation
        if r is not None and r.job_id != self._reserved_for:
            log.info("job_reserved job=%s node=%s start=%s", r.job_id, r.node,
                     datetime.fromtimestamp(r.start_s, now.tzinfo).isoformat()
                     if r.start_s != float("inf") else "unknown")
        self._reserved_for = r.job_id if r is not None else None
        return decision, heads, slots

    @staticmethod
    def _pending_changes(decision: Decision, heads: dict[str, Candidate],
                         ) -> list[tuple[str, str | None, str | None]]:
        """Why each examined job waits, where that changed since the last tick: stored with
        the tick's publication, in its transaction."""
        changes: list[tuple[str, str | None, str | None]] = []
        for job_id, pending in decision.pending.items():
            h = heads[job_id]
            if (h.pending_reason, h.pending_detail) != (pending.reason.value, pending.detail):
                changes.append((job_id, pending.reason.value, pending.detail[:64]))
        return changes

    def hold_lease_expiry(self) -> None:
        """Judge no lease for one TTL: after taking the lead, or after the store was unreachable
        (the workers could not renew then either, and their jobs are alive)."""
        self._expire_leases_after = time.monotonic() + self._settings.lease_ttl_s

    def reconcile(self, now: datetime) -> None:
        """Recover what died: jobs whose lease expired or whose worker went silent, and
        messages the broker lost."""
        if time.monotonic() >= self._expire_leases_after:
            for job_id, state in self._repo.expire_leases(now=now,
                                                          lease_ttl_s=self._settings.lease_ttl_s):
                log.warning("lease_expired job=%s: attempt lost, job %s", job_id, state.value)
        if not self._redis.exists(keys.BROKER_EPOCH):
            # Redis restarted without its data or was flushed: the published messages are gone,
            # and so is every heartbeat (silence says nothing until the workers beat again).
            self._judge_silence_after = time.monotonic() + self._settings.lease_ttl_s
            republish = self._repo.expire_dispatches(None, now=now, timeout_s=0)
            self._redis.set(keys.BROKER_EPOCH, now.isoformat())
            log.warning("broker_reset: Redis is new, restarted empty or was flushed; %d published "
                        "jobs lost their messages and are published again", republish)
        self.expire_silent(now)

    def expire_silent(self, now: datetime) -> int:
        """End `lost` now the attempts of running jobs whose worker is gone: no lease renewal
        for `silence_s` (1.5 intervals), and no heartbeat for as long from the worker nor from
        its launcher (a dead node) or a heartbeat that says the worker holds another job or
        none (a worker process that its launcher restarted under the same name, whose
        predecessor's attempt had not finished: `e31_worker.attempt.settle`; until the new
        process beats, a live launcher keeps the job to its lease, so that a successor may
        still settle an attempt that had finished). Both must say so: a worker
        whose heartbeat is lost (Redis flushed, its heartbeat thread stuck) still renews its
        lease, and one whose store is slow still beats with its job. The fence is
        `expire_leases`'s. Not judged while leases are not (after taking the lead, after a
        store error) nor for a TTL after Redis lost its data. Returns the jobs recovered."""
        self._silence_checked = mono = time.monotonic()
        interval_s, ttl_s = self._settings.heartbeat_interval_s, self._settings.lease_ttl_s
        silent_s = silence_s(interval_s)
        if silent_s >= ttl_s or mono < max(self._expire_leases_after, self._judge_silence_after):
            return 0
        overdue = self._repo.overdue_leases(now=now, lease_ttl_s=ttl_s, silent_s=silent_s)
        if not overdue:
            return 0
        gone = not_held(self._redis, overdue, silent_s=silent_s, now_s=now.timestamp())
        ended = self._repo.expire_silent(sorted(gone), now=now, lease_ttl_s=ttl_s,
                                         silent_s=silent_s)
        for job_id, state in ended:
            log.warning("worker_silent job=%s: no lease renewal for %g s, and its worker no "
                        "longer beats with it; attempt lost, job %s", job_id, silent_s,
                        state.value)
        return len(ended)

    def _publish(self, chosen: list[tuple[Candidate, Dispatch]], now: datetime, *,
                 pending: Sequence[tuple[str, str | None, str | None]] = ()) -> int:
        """Mark the chosen jobs published, each with a new dispatch token, and store why the
        others wait (`pending`, in the same transaction: one write per tick); then send each
        one's message `e31.run(job_id, dispatch_token)`: only a message with the token the
        store holds claims the job. A job placed on a gang host's GPU set goes to that host's queue,
        the store noting which GPUs it is given. SchedulingError when the broker refuses one
        (the next tick tries again: the job is published again when its message does not
        arrive within the dispatch timeout)."""
        places = {c.id: place for c, d in chosen
                  if (place := gang_place(d.node)) is not None}
        tokens = self._repo.mark_dispatched([c.id for c, _ in chosen], now=now, places=places,
                                            pending=pending)
        # One producer (and its connection) from Celery's pool for the whole tick, where
        # each send_task took and gave back its own
        with self._celery.producer_or_acquire() as producer:
            for c, _ in chosen:
                if c.id not in tokens:
                    continue
                label = f"{self._tenant_names.get(c.tenant_id, c.tenant_id)}/{c.name}"
                queue = node_queue(places[c.id][0]) if c.id in places else c.queue
                try:
                    self._celery.send_task(
                        TASK_NAME, args=[c.id, tokens[c.id]], queue=queue, routing_key=queue,
                        priority=redis_priority(c.size_class, self._settings.size_classes),
                        shadow=printable(label),   # worker logs: one line, whatever the name
                        argsrepr=repr([c.id, TOKEN_SHOWN]),   # Flower and events: no token
                        producer=producer)
                except BrokerError as exc:
                    raise SchedulingError(f"cannot publish job {c.id} to {queue}: {exc}") from exc
                log.info("job_published job=%s queue=%s tenant=%s%s", c.id, queue, c.tenant_id,
                         f" gpus={places[c.id][1]}" if c.id in places else "")
        return len(tokens)

    # -- loop ----------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Lead (or wait to lead) until `stop` is set."""
        leading = False
        tick_s = self._settings.scheduler_tick_s
        recovered_s = -float("inf")   # time.monotonic() of the last tick that recovered
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
                started_s = time.monotonic()
                recover = started_s - recovered_s >= tick_s
                sent = self.tick(recover=recover)
                if recover:
                    recovered_s = started_s
                self._note_health(started_s, sent)
                self._wait_for_wake(stop, tick_s)
            except (redis.RedisError, SchedulingError, StoreError) as exc:
                log.warning("scheduler_error %s: %s; retrying", type(exc).__name__, exc)
                if isinstance(exc, StoreError):
                    self._errors.store_error()
                    self.hold_lease_expiry()
                else:
                    self._errors.broker_error()
                stop.wait(tick_s)
        self.resign()

    def _note_health(self, started_s: float, published: int) -> None:
        """Note the tick (its end, duration and publications) and the errors counted since the
        last note in the health hash the metrics read; a note that fails waits for the next."""
        try:
            metrics.record_tick(self._redis, ended_at_s=time.time(),
                                duration_s=time.monotonic() - started_s, published=published)
            self._errors.flush(self._redis)
        except redis.RedisError as exc:
            log.warning("scheduler_health_unwritten: %s", exc)

    def _wait_for_wake(self, stop: threading.Event, tick_s: float) -> None:
        """Return on a wake-up signal, on `stop`, or after `tick_s`; meanwhile look for
        silent workers every `SILENCE_CHECK_BEATS` intervals, and return at once (a tick
        publishes their jobs again) when one was found."""
        deadline = time.monotonic() + tick_s
        check_s = max(SILENCE_CHECK_BEATS * self._settings.heartbeat_interval_s,
                      SILENCE_CHECK_MIN_S)
        while not stop.is_set():
            now_s = time.monotonic()
            left = deadline - now_s
            if left <= 0:
                return
            if now_s - self._silence_checked >= check_s and self.expire_silent(utcnow()):
                return
            wait_s = min(left, WAKE_POLL_MAX_S, check_s)
            if self._redis.blpop([keys.WAKE], timeout=wait_s):
                self._redis.delete(keys.WAKE)  # one tick serves every wake-up so far
                return
