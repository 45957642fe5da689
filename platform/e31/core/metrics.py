"""The Prometheus metrics of E31 Batch: every name, its help and its labels (the contract
the dashboards and alert rules of config/ are written against), and the health hash in Redis
that the scheduler and the workers write their tick and error counts into
(docs/operations.md, "Monitoring"). `e31.ops.scrape` reads the pool and renders them.

One endpoint, on the API, exports the whole pool. Its numbers are read at scrape time from
the places that hold the truth — the store (jobs, attempts, GPU-seconds), the worker
heartbeats in Redis (workers, GPUs, per-GPU telemetry relayed by each worker) and the health
hash — so every API replica answers the same, and a restarted process loses no count.

Labels are bounded: size class, tenant, state, reason, node and GPU index; never a job id.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from e31.core import keys

# Redis is imported where a client is used: the store, which imports the names and buckets
# here, and so every CLI command, spare its ~0.1 s.
if TYPE_CHECKING:
    import redis

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Metric:
    """One exported metric: its full sample name (a counter's ends in `_total`), its type
    (`gauge`, `counter` or `gaugehistogram`), its help text and its label names."""

    name: str
    kind: str
    help: str
    labels: tuple[str, ...] = ()


# -- from the store ----------------------------------------------------------------------
JOBS = Metric("e31_jobs", "gauge",
              "Live jobs in the store (queued or running), by state, class and tenant",
              ("state", "class", "tenant"))
JOBS_ENDED = Metric("e31_jobs_ended_total", "counter",
                    "Jobs that ended (succeeded, failed, cancelled), by state, class and tenant",
                    ("state", "class", "tenant"))
QUEUE_WAIT = Metric("e31_queue_wait_seconds", "gaugehistogram",
                    "Time waited in the queue by the jobs that started in the last "
                    "metrics_window_s, by class", ("class",))
RUN_TIME = Metric("e31_run_seconds", "gaugehistogram",
                  "Run time of the jobs that ended in the last metrics_window_s, by class",
                  ("class",))
JOBS_FAILED_BY_POOL = Metric("e31_jobs_failed_by_pool_total", "counter",
                             "Jobs that failed for the pool's own faults (their last attempt's "
                             "reason is the pool's: infra_retries or retries.max_lost reached), "
                             "by class and reason", ("class", "reason"))
ATTEMPTS_ENDED = Metric("e31_attempts_ended_total", "counter",
                        "Attempts that ended, by class and reason", ("class", "reason"))
GPU_SECONDS = Metric("e31_gpu_seconds_total", "counter",
                     "GPU-seconds billed, by tenant and class", ("tenant", "class"))
OLDEST_QUEUED_AGE = Metric("e31_oldest_queued_age_seconds", "gauge",
                           "Age of the oldest queued job per class (0 when none waits)",
                           ("class",))
LEASE_EXPIRIES = Metric("e31_lease_expiries_total", "counter",
                        "Attempts ended because their lease expired (reason lost), by class",
                        ("class",))
STORE_UP = Metric("e31_store_up", "gauge", "1 when the scrape could read the results store")

# -- from the heartbeats -----------------------------------------------------------------
WORKERS = Metric("e31_workers", "gauge",
                 "Worker slots by class and state (idle, busy, draining, lost)",
                 ("class", "state"))
GPUS = Metric("e31_gpus", "gauge", "GPUs by class and state (idle, busy, draining, lost)",
              ("class", "state"))
BROKER_UP = Metric("e31_broker_up", "gauge", "1 when the scrape could read Redis")

# -- from the processes' health hash in Redis --------------------------------------------
SCHEDULER_LAST_TICK = Metric("e31_scheduler_last_tick_timestamp_seconds", "gauge",
                             "Unix time the leading scheduler's last tick ended")
SCHEDULER_TICK_DURATION = Metric("e31_scheduler_tick_duration_seconds", "gauge",
                                 "How long the scheduler's last tick took")
SCHEDULER_PUBLISHED = Metric("e31_scheduler_published_last_tick", "gauge",
                             "Jobs the scheduler published in its last tick")
STORE_ERRORS = Metric("e31_store_errors_total", "counter",
                      "Errors reaching the results store, by process", ("process",))
BROKER_ERRORS = Metric("e31_broker_errors_total", "counter",
                       "Errors reaching Redis (the broker), by process", ("process",))
FENCED_WRITES = Metric("e31_fenced_writes_total", "counter",
                       "Outcome writes refused by the fencing token (the job had been "
                       "recovered elsewhere)")

# -- per GPU, relayed through each worker's heartbeat ------------------------------------
GPU_LABELS = ("node", "gpu")
GPU_UTILIZATION = Metric("e31_gpu_utilization_ratio", "gauge",
                         "GPU utilisation, 0..1", GPU_LABELS)
GPU_MEMORY_USED = Metric("e31_gpu_memory_used_bytes", "gauge", "GPU memory in use", GPU_LABELS)
GPU_MEMORY_TOTAL = Metric("e31_gpu_memory_total_bytes", "gauge", "GPU memory in all",
                          GPU_LABELS)
GPU_TEMPERATURE = Metric("e31_gpu_temperature_celsius", "gauge", "GPU temperature",
                         GPU_LABELS)
GPU_POWER = Metric("e31_gpu_power_watts", "gauge", "GPU power draw", GPU_LABELS)
GPU_XID_ERRORS = Metric("e31_gpu_xid_errors_total", "counter",
                        "XID errors NVML reported for the GPU since its worker started",
                        GPU_LABELS)
GPU_ECC_ERRORS = Metric("e31_gpu_ecc_errors_total", "counter",
                        "Uncorrected ECC errors NVML reported for the GPU", GPU_LABELS)
GPU_SIMULATED = Metric("e31_gpu_simulated", "gauge",
                       "1 when the GPU is simulated (--simulate-gpus) and its values made up",
                       GPU_LABELS)
JOBS_IDLE = Metric("e31_jobs_idle", "gauge",
                   "Running jobs the watchdog flagged idle (no log, progress or GPU use for "
                   "their idle_timeout_s), by class", ("class",))
GPU_BUSY = Metric("e31_gpu_busy", "gauge",
                  "1 while a job holds the GPU, 0 while it is free (with the utilisation: a "
                  "GPU hung at 0 % under a job)", GPU_LABELS)

# -- the artifact store (a file:// store: its filesystem, as the API host sees it) ---------
ARTIFACT_STORE_FREE = Metric("e31_artifact_store_free_bytes", "gauge",
                             "Free bytes on the filesystem of a file:// artifact store "
                             "(no sample for other stores)")
ARTIFACT_STORE_SIZE = Metric("e31_artifact_store_size_bytes", "gauge",
                             "Size of the filesystem of a file:// artifact store "
                             "(no sample for other stores)")

ALL: tuple[Metric, ...] = (
    JOBS, JOBS_ENDED, JOBS_FAILED_BY_POOL, QUEUE_WAIT, RUN_TIME, ATTEMPTS_ENDED, GPU_SECONDS,
    OLDEST_QUEUED_AGE, LEASE_EXPIRIES, STORE_UP, WORKERS, GPUS, BROKER_UP, SCHEDULER_LAST_TICK,
    SCHEDULER_TICK_DURATION, SCHEDULER_PUBLISHED, STORE_ERRORS, BROKER_ERRORS, FENCED_WRITES,
    GPU_UTILIZATION, GPU_MEMORY_USED, GPU_MEMORY_TOTAL, GPU_TEMPERATURE, GPU_POWER,
    GPU_XID_ERRORS, GPU_ECC_ERRORS, GPU_SIMULATED, JOBS_IDLE, GPU_BUSY, ARTIFACT_STORE_FREE,
    ARTIFACT_STORE_SIZE,
)

# Worker and GPU states of WORKERS and GPUS.
WORKER_STATES = ("idle", "busy", "draining", "lost")

# Bucket bounds of the wait and run-time histograms, in seconds: from a second to a day.
WAIT_BUCKETS_S = (1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 12 * 3600.0,
                  86400.0)
RUN_BUCKETS_S = (10.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 12 * 3600.0, 86400.0,
                 3 * 86400.0)
WINDOW_DEFAULT_S = 600.0   # the histograms' window when none is given (metrics_window_s)


# -- the processes' health hash in Redis (keys.HEALTH) ------------------------------------
TICK_AT = "scheduler:last_tick_ts"
TICK_DURATION = "scheduler:tick_duration_s"
TICK_PUBLISHED = "scheduler:published"
FENCED = "fenced_writes"
STORE_ERROR_PREFIX = "store_errors:"
BROKER_ERROR_PREFIX = "broker_errors:"


def record_tick(r: redis.Redis, *, ended_at_s: float, duration_s: float, published: int) -> None:
    """Note the scheduler's last tick in the health hash."""
    r.hset(keys.HEALTH, mapping={TICK_AT: f"{ended_at_s:.3f}", TICK_DURATION: f"{duration_s:.6f}",
                                 TICK_PUBLISHED: str(published)})


class ErrorTally:
    """A process's store and broker errors, counted in memory and added to the health hash
    whenever Redis answers: an error reaching Redis cannot be written to Redis at once, so it
    waits for the next `flush` that gets through. `process` is a bounded name (scheduler,
    api, worker), a label of the counters."""

    def __init__(self, process: str) -> None:
        self.process = process
        self._pending: Counter[str] = Counter()

    def store_error(self) -> None:
        self._pending[STORE_ERROR_PREFIX + self.process] += 1

    def broker_error(self) -> None:
        self._pending[BROKER_ERROR_PREFIX + self.process] += 1

    def flush(self, r: redis.Redis) -> None:
        """Add the pending counts to the health hash; kept for the next flush if Redis fails."""
        if not self._pending:
            return
        import redis
        pending, self._pending = self._pending, Counter()
        try:
            with r.pipeline(transaction=False) as pipe:
                for name, n in pending.items():
                    pipe.hincrby(keys.HEALTH, name, n)
                pipe.execute()
        except redis.RedisError:
            self._pending.update(pending)
            raise


def note_fenced_write(r: redis.Redis) -> None:
    """Count an outcome write the fencing token refused, where it happened (a worker); best
    effort: a count Redis cannot take is logged and lost."""
    import redis
    try:
        r.hincrby(keys.HEALTH, FENCED, 1)
    except redis.RedisError as exc:
        log.warning("health_uncounted %s: %s", FENCED, exc)
