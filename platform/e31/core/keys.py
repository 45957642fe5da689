"""Every Redis key E31 Batch uses, in one place."""

from __future__ import annotations

PREFIX = "e31"

WAKE = f"{PREFIX}:scheduler:wake"           # list: pushed on submit / job end; scheduler BLPOPs it
LEADER = f"{PREFIX}:scheduler:leader"       # string: the leading scheduler's token, with a TTL
WORKER_PREFIX = f"{PREFIX}:worker:"         # string per worker node: its heartbeat JSON, with a TTL
DRAIN_PREFIX = f"{PREFIX}:drain:"           # string per worker node: an operator asked it to drain
# string, no TTL: set by the scheduler; when it is missing, Redis restarted empty or was
# flushed, and every message in flight went with it
BROKER_EPOCH = f"{PREFIX}:broker:epoch"
# hash, no TTL: the scheduler's last tick (time, duration, jobs published) and every process's
# store and broker error counts, read by the metrics (e31.core.metrics names the fields)
HEALTH = f"{PREFIX}:health"
# pub/sub channel: a job's id, published by its worker when it records the job's final state;
# the API's long polls (GET /v1/jobs/{id}?wait_s=N, e31.api.waits) listen to it
JOB_ENDED = f"{PREFIX}:jobs:ended"
# hash per tenant, with a TTL: its submit-rate token bucket (tokens, at), shared by every API
# process (e31.api.requestlimits.SubmitRate)
SUBMIT_RATE_PREFIX = f"{PREFIX}:rate:submit:"
# hash, with a TTL of a day: worker node -> the shape its last heartbeat seen by an API showed
# (host, GPUs, queues, when), the registered node shapes (e31.scheduling.placement)
NODES = f"{PREFIX}:nodes"
# list per job, with a TTL: its GPUs' readings over its run, a point every few heartbeats of its
# worker, the newest kept (e31.ops.gpuseries); the console's job page draws it
GPU_SERIES_PREFIX = f"{PREFIX}:gpuseries:"
# string per Python environment, with a TTL of a day renewed by the workers that have it: the
# JSON of `e31.core.functioncalls.environment()`, keyed by its digest, which each worker's
# heartbeat names (`pyenv`); a caller checks a function call against it (e31.ops.pyenvs)
PYENV_PREFIX = f"{PREFIX}:pyenv:"


def worker(node: str) -> str:
    """Heartbeat key of one worker node."""
    return f"{WORKER_PREFIX}{node}"


def worker_pattern() -> str:
    return f"{WORKER_PREFIX}*"


def drain_pattern() -> str:
    return f"{DRAIN_PREFIX}*"


def drain(node: str) -> str:
    """Drain request of one worker node (set by `e31 worker --drain`)."""
    return f"{DRAIN_PREFIX}{node}"


def submit_rate(tenant_id: str) -> str:
    """Submit-rate token bucket of one tenant."""
    return f"{SUBMIT_RATE_PREFIX}{tenant_id}"


def gpu_series(job_id: str) -> str:
    """The GPU readings of one job over its run."""
    return f"{GPU_SERIES_PREFIX}{job_id}"


def pyenv(digest: str) -> str:
    """One Python environment of the workers, by its digest."""
    return f"{PYENV_PREFIX}{digest}"
