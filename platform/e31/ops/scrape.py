"""One scrape of the pool: what the API's `/metrics` reads and how it renders it
(docs/operations.md, "Monitoring"). `PoolCollector` reads the store (through `PoolReads`, which
`e31.store.Repo` is), the heartbeats, drain requests and health hash in Redis, and the
artifact store's filesystem at each scrape, and yields the series `e31.core.metrics` names.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

import redis
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
)
from prometheus_client.registry import Collector, CollectorRegistry

from e31.core import keys
from e31.core.errors import StoreError
from e31.core.metrics import (
    ALL,
    ARTIFACT_STORE_FREE,
    ARTIFACT_STORE_SIZE,
    ATTEMPTS_ENDED,
    BROKER_ERROR_PREFIX,
    BROKER_ERRORS,
    BROKER_UP,
    FENCED,
    FENCED_WRITES,
    GPU_BUSY,
    GPU_ECC_ERRORS,
    GPU_MEMORY_TOTAL,
    GPU_MEMORY_USED,
    GPU_POWER,
    GPU_SECONDS,
    GPU_SIMULATED,
    GPU_TEMPERATURE,
    GPU_UTILIZATION,
    GPU_XID_ERRORS,
    GPUS,
    JOBS,
    JOBS_ENDED,
    JOBS_FAILED_BY_POOL,
    JOBS_IDLE,
    LEASE_EXPIRIES,
    OLDEST_QUEUED_AGE,
    QUEUE_WAIT,
    RUN_BUCKETS_S,
    RUN_TIME,
    SCHEDULER_LAST_TICK,
    SCHEDULER_PUBLISHED,
    SCHEDULER_TICK_DURATION,
    STORE_ERROR_PREFIX,
    STORE_ERRORS,
    STORE_UP,
    TICK_AT,
    TICK_DURATION,
    TICK_PUBLISHED,
    WAIT_BUCKETS_S,
    WINDOW_DEFAULT_S,
    WORKER_STATES,
    WORKERS,
    Metric,
)
from e31.core.records import JobKey, PoolCounts, Spread, Totals
from e31.core.states import REASONS, Cap, Owner
from e31.ops import pool
from e31.ops.heartbeat import WorkerInfo, read_workers

log = logging.getLogger(__name__)


class PoolReads(Protocol):
    """Where the collector reads the store (`e31.store.Repo` is one)."""

    def pool_counts(self, *, now: datetime, window_s: float,
                    ended_since: datetime) -> PoolCounts: ...

    def ended_totals(self, *, since: datetime | None, until: datetime) -> Totals: ...

    def idle_jobs(self) -> dict[str, int]: ...


class EndedTally:
    """The totals of the jobs that ended before a watermark `SETTLE_S` behind the clock, kept
    by one process so that a scrape reads only what is newer: the first scrape of a process
    reads the whole history once, each later one adds the jobs that settled since (a range of
    `ix_jobs_ended`), and `PoolReads.pool_counts` reads the live jobs and those ended after
    the watermark in the same statement, so a job that ends between two reads is counted once.
    A job's `ended_at` never changes once set, and is written with the clock of the process
    that ended it; `SETTLE_S` is far beyond any clock skew the leases would survive."""

    def __init__(self) -> None:
        self._base = Totals()
        self._until: datetime | None = None
        self._lock = threading.Lock()

    def settled(self, reads: PoolReads, now: datetime) -> tuple[Totals, datetime]:
        """The settled totals and their watermark, brought up to `now - SETTLE_S`."""
        with self._lock:
            until = now - timedelta(seconds=SETTLE_S)
            if self._until is None or until > self._until:
                self._base = self._base + reads.ended_totals(since=self._until, until=until)
                self._until = until
            return self._base, self._until


SETTLE_S = 600.0   # a job that ended this long ago is history: its end is never written later


# -- the collector ------------------------------------------------------------------------

def _family(m: Metric) -> Any:
    if m.kind == "counter":
        return CounterMetricFamily(m.name, m.help, labels=m.labels)
    if m.kind == "gaugehistogram":
        return GaugeHistogramMetricFamily(m.name, m.help, labels=m.labels)
    return GaugeMetricFamily(m.name, m.help, labels=m.labels)


@dataclass(frozen=True)
class PoolView:
    """What one scrape read from Redis: heartbeats, nodes asked to drain, the health hash."""

    workers: tuple[WorkerInfo, ...]
    draining: frozenset[str]
    health: Mapping[str, str]


def read_pool_view(r: redis.Redis) -> PoolView:
    """Heartbeats, drain requests and the health hash, as one scrape reads them."""
    draining = frozenset(_text(key).removeprefix(keys.DRAIN_PREFIX)
                         for key in r.scan_iter(match=keys.drain_pattern(), count=500))
    health = {_text(k): _text(v) for k, v in r.hgetall(keys.HEALTH).items()}
    return PoolView(tuple(read_workers(r)), draining, health)


class PoolCollector(Collector):
    """Reads the store and Redis at each scrape and yields every series of `ALL` it has data
    for. A source that fails is reported by `e31_store_up` / `e31_broker_up` = 0 and its
    series are left out (a gap, not a made-up zero)."""

    def __init__(self, *, reads: PoolReads, redis_client: redis.Redis, classes: Sequence[str],
                 window_s: float = WINDOW_DEFAULT_S, artifacts_dir: Path | None = None,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self._reads = reads
        self._ended = EndedTally()
        self._artifacts_dir = artifacts_dir
        self._redis = redis_client
        self._classes = tuple(classes)
        self._window_s = window_s
        self._clock = clock

    def describe(self) -> Iterable[Any]:
        """Every family it may yield, empty: the registry learns the names without a read."""
        return [_family(m) for m in ALL]

    def collect(self) -> Iterator[Any]:
        now = self._clock()
        counts: PoolCounts | None = None
        settled = Totals()
        idle: dict[str, int] = {}
        view: PoolView | None = None
        try:
            settled, watermark = self._ended.settled(self._reads, now)
            counts = self._reads.pool_counts(now=now, window_s=self._window_s,
                                             ended_since=watermark)
            idle = self._reads.idle_jobs()
        except StoreError as exc:
            log.warning("metrics_store_unavailable: %s", exc)
        try:
            view = read_pool_view(self._redis)
        except redis.RedisError as exc:
            log.warning("metrics_broker_unavailable: %s", exc)
        yield _gauge(STORE_UP, [((), 1.0 if counts is not None else 0.0)])
        yield _gauge(BROKER_UP, [((), 1.0 if view is not None else 0.0)])
        if counts is not None:
            yield from self._store_series(counts, counts.current + settled, idle, now)
        if view is not None:
            yield from _health_series(view.health)
            slots = pool.slots(view.workers, counts.holders if counts else (), view.draining)
            yield from self._slot_series(slots)
            yield from _gpu_series(view.workers, slots)
        if self._artifacts_dir is not None:
            yield from _disk_series(self._artifacts_dir)

    def _store_series(self, c: PoolCounts, totals: Totals, idle: Mapping[str, int],
                      now: datetime) -> Iterator[Any]:
        def named(key: JobKey) -> tuple[str, str, str]:
            state, cls, tenant_id = key
            return state, cls, c.tenants.get(tenant_id, tenant_id)

        jobs = _summed((named(k), float(n)) for k, n in totals.jobs.items())
        pairs = sorted({labels[1:] for labels in jobs})
        yield _gauge(JOBS, [((state, cls, tenant), jobs.get((state, cls, tenant), 0.0))
                            for cls, tenant in pairs for state in LIVE_STATES])
        yield _counter(JOBS_ENDED, sorted((labels, n) for labels, n in jobs.items()
                                          if labels[0] not in LIVE_STATES))
        yield _counter(GPU_SECONDS, sorted(_summed(
            ((named(k)[2], k[1]), v) for k, v in totals.gpu_seconds.items()).items()))
        yield _counter(ATTEMPTS_ENDED, [((cls, reason), float(n)) for (cls, reason), n
                                        in sorted(totals.attempts.items())])
        lost = Counter({cls: n for (cls, reason), n in totals.attempts.items()
                        if reason == LOST})
        classes = self._all_classes(totals)
        yield _counter(LEASE_EXPIRIES, [((cls,), float(lost[cls])) for cls in classes])
        yield _counter(JOBS_FAILED_BY_POOL, [
            ((cls, reason), float(totals.failed.get((cls, reason), 0)))
            for cls in classes for reason in POOL_FAILURES])
        yield _gauge(OLDEST_QUEUED_AGE, [
            ((cls,), max(0.0, (now - c.oldest_queued_at[cls]).total_seconds())
             if cls in c.oldest_queued_at else 0.0) for cls in classes])
        yield _gauge(JOBS_IDLE, [((cls,), float(idle.get(cls, 0))) for cls in classes])
        for metric, spreads, bounds in ((QUEUE_WAIT, c.queue_wait, WAIT_BUCKETS_S),
                                        (RUN_TIME, c.run_time, RUN_BUCKETS_S)):
            fam = _family(metric)
            for cls in classes:
                s = spreads.get(cls) or Spread.empty(bounds)
                buckets = [(_le(b), float(n)) for b, n in zip(s.bounds_s, s.at_or_below,
                                                               strict=True)]
                fam.add_metric([cls], [*buckets, ("+Inf", float(s.count))], s.sum_s)
            yield fam

    def _all_classes(self, totals: Totals) -> list[str]:
        """The configured classes, and any other a stored job names (an old class)."""
        seen = dict.fromkeys(self._classes)
        seen.update(dict.fromkeys(sorted({cls for _, cls, _ in totals.jobs})))
        return list(seen)

    def _slot_series(self, slots: Sequence[pool.Slot]) -> Iterator[Any]:
        workers: Counter[tuple[str, str]] = Counter()
        gpus: Counter[tuple[str, str]] = Counter()
        for s in slots:
            workers[(s.size_class, s.state)] += 1
            gpus[(s.size_class, s.state)] += s.gpu_count
        classes = list(dict.fromkeys([*self._classes, *sorted({s.size_class for s in slots})]))
        yield _gauge(WORKERS, [((cls, st), float(workers[(cls, st)]))
                               for cls in classes for st in WORKER_STATES])
        yield _gauge(GPUS, [((cls, st), float(gpus[(cls, st)]))
                            for cls in classes for st in WORKER_STATES])


LIVE_STATES = ("queued", "running")
LOST = "lost"
# The pool's reasons a job can fail with (`REASONS`: the pool's, with a cap that fails the job
# when reached): each is a series of `e31_jobs_failed_by_pool_total` per class from the start,
# at 0, so that an alert's `increase` sees the first such failure.
POOL_FAILURES = tuple(r.value for r, rule in REASONS.items()
                      if rule.owner is Owner.POOL and rule.cap in (Cap.MAX_LOST, Cap.INFRA_RETRIES))


def _summed(samples: Iterable[tuple[tuple[str, ...], float]]) -> dict[tuple[str, ...], float]:
    """Samples with the same labels added (two tenant ids can carry one name only if one
    tenant was renamed; their series are one)."""
    out: dict[tuple[str, ...], float] = defaultdict(float)
    for labels, v in samples:
        out[labels] += v
    return out


def _le(bound_s: float) -> str:
    return f"{bound_s:g}" if bound_s != int(bound_s) else f"{bound_s:.1f}"


def _gauge(m: Metric, samples: Iterable[tuple[tuple[str, ...], float]]) -> Any:
    fam = _family(m)
    for labels, value in samples:
        fam.add_metric(list(labels), value)
    return fam


def _counter(m: Metric, samples: Iterable[tuple[tuple[str, ...], float]]) -> Any:
    return _gauge(m, samples)


def _health_series(health: Mapping[str, str]) -> Iterator[Any]:
    """The scheduler's tick and every process's error counters, from the health hash."""
    for metric, name in ((SCHEDULER_LAST_TICK, TICK_AT), (SCHEDULER_TICK_DURATION, TICK_DURATION),
                         (SCHEDULER_PUBLISHED, TICK_PUBLISHED)):
        value = _number(health.get(name))
        if value is not None:
            yield _gauge(metric, [((), value)])
    for metric, prefix in ((STORE_ERRORS, STORE_ERROR_PREFIX),
                           (BROKER_ERRORS, BROKER_ERROR_PREFIX)):
        yield _counter(metric, [((name.removeprefix(prefix),), _number(v) or 0.0)
                                for name, v in sorted(health.items()) if name.startswith(prefix)])
    yield _counter(FENCED_WRITES, [((), _number(health.get(FENCED)) or 0.0)])


def _gpu_series(workers: Sequence[WorkerInfo], slots: Sequence[pool.Slot]) -> Iterator[Any]:
    """Per GPU: whether a job holds it (from the slots), and the telemetry each worker relays
    in its heartbeat; a value it did not send is no sample. A GPU shared by two workers of a
    host is exported once (busy when either holds a job)."""
    busy: dict[tuple[str, str], float] = {}
    for s in slots:
        host = s.node.rpartition("@")[2]
        for index in s.gpu_indexes:
            held = s.state == pool.BUSY or (s.state == pool.DRAINING and s.job is not None)
            busy[(host, index)] = max(busy.get((host, index), 0.0), float(held))
    yield _gauge(GPU_BUSY, sorted(busy.items()))
    by_gpu: dict[tuple[str, str], pool.GpuReading] = {}
    for w in workers:
        for g in pool.gpu_readings(w):
            by_gpu.setdefault((w.host, g.index), g)
    fields: tuple[tuple[Metric, Callable[[pool.GpuReading], float | None]], ...] = (
        (GPU_UTILIZATION, lambda g: g.utilization_ratio),
        (GPU_MEMORY_USED, lambda g: g.memory_used_bytes),
        (GPU_MEMORY_TOTAL, lambda g: g.memory_total_bytes),
        (GPU_TEMPERATURE, lambda g: g.temperature_celsius), (GPU_POWER, lambda g: g.power_watts),
        (GPU_XID_ERRORS, lambda g: g.xid_errors), (GPU_ECC_ERRORS, lambda g: g.ecc_errors),
        (GPU_SIMULATED, lambda g: g.simulated))
    for metric, read in fields:
        samples = []
        for (host, index), g in sorted(by_gpu.items()):
            value = read(g)
            if value is not None:
                samples.append(((host, index), float(value)))
        yield _gauge(metric, samples)


def _disk_series(path: Path) -> Iterator[Any]:
    """Free and total bytes of the filesystem holding a file:// artifact store (none when it
    cannot be read: no sample, not a zero that would page someone)."""
    try:
        st = os.statvfs(path)
    except OSError as exc:
        log.warning("metrics_artifacts_unread %s: %s", path, exc)
        return
    yield _gauge(ARTIFACT_STORE_FREE, [((), float(st.f_bavail * st.f_frsize))])
    yield _gauge(ARTIFACT_STORE_SIZE, [((), float(st.f_blocks * st.f_frsize))])


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def _number(raw: str | None) -> float | None:
    try:
        return float(raw) if raw is not None else None
    except ValueError:
        return None


def registry(collector: PoolCollector) -> CollectorRegistry:
    """A registry of its own holding only `collector` (no process or platform metrics: the
    numbers are the pool's, the same from every API replica)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    return reg


CONTENT_TYPE = CONTENT_TYPE_LATEST


def render(reg: CollectorRegistry) -> bytes:
    """The Prometheus text exposition of `reg`, read now."""
    return bytes(generate_latest(reg))
