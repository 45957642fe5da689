"""The scheduler's cost per dispatched job against the size of the backlog; on demand.

    python bench/scheduler_cost.py                       # SQLite: 1,000 / 10,000 / 100,000 queued
    python bench/scheduler_cost.py --postgres postgresql://postgres@127.0.0.1:5432/test

For each backlog size: a fresh store with that many queued gpu24 jobs over four tenants
(weights 1, 1, 2, 4; one with a quota), a private redis-server, and `--workers` idle
worker heartbeats. Each round, the real `Scheduler.tick` (reconcile, heartbeats, the heads
read, `admission.decide`, publishing through Celery, pending reasons) fills every idle
worker; then the published jobs are claimed and succeed (not timed) and the queue is
drained, so the next round starts from the same free capacity and a backlog as large less
what ran. Prints, over `--rounds`, ms per tick and per dispatched job (median and best:
a busy machine adds noise) and the SQL statements one tick runs (no noise at all).
With `--postgres URL`, the same on PostgreSQL (a fresh database per size, dropped after).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
from sqlalchemy import event, text

from e31 import keys
from e31.celeryapp import make_celery
from e31.clock import utcnow
from e31.local.redisserver import start_redis
from e31.scheduling.leader import Scheduler
from e31.settings import Settings
from e31.sizeclasses import route
from e31.spec import JobSpec
from e31.states import AttemptReason
from e31.store import Repo, make_engine
from e31.store.db import scratch_database
from e31.store.migrate import upgrade
from e31.store.records import Outcome

SIZES = (1_000, 10_000, 100_000)
TENANTS = (("a", 1.0, None), ("b", 1.0, None), ("c", 2.0, None), ("d", 4.0, {"gpu24": 8}))
INSERT_CHUNK = 5_000
QUEUE = "e31.gpu24"


@contextmanager
def database(kind: str, workdir: Path, pg_url: str | None) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{workdir / f'bench-{uuid.uuid4().hex[:6]}.db'}"
        return
    assert pg_url
    base = Settings(database_url=pg_url).resolved_database_url
    with scratch_database(base, prefix="e31_bench") as url:
        yield url


def fill(repo: Repo, size: int) -> None:
    """`size` queued jobs, spread evenly over the tenants (bulk inserts)."""
    spec = JobSpec.parse({"entrypoint": "pkg.mod:main", "timeout_s": 600})
    where = route(spec, Settings().size_classes)
    ids = []
    for name, weight, quotas in TENANTS:
        tenant, _ = repo.create_tenant(name, weight=weight, quotas=quotas, now=utcnow())
        ids.append(tenant.id)
    per_tenant = size // len(ids)
    for tenant_id in ids:
        for start in range(0, per_tenant, INSERT_CHUNK):
            count = min(INSERT_CHUNK, per_tenant - start)
            repo.insert_array(tenant_id, "bench", [(spec, where)] * count, now=utcnow())


def heartbeats(r: redis.Redis, workers: int) -> None:
    for i in range(workers):
        r.set(keys.worker(f"gpu{i}@bench"), json.dumps(
            {"node": f"gpu{i}@bench", "queues": [QUEUE], "gpus": str(i), "gpu_count": 1,
             "busy_job": None}), ex=600)


def run_them(repo: Repo, r: redis.Redis) -> None:
    """What the workers would do: claim every published job and record its success."""
    with repo.engine.connect() as conn:
        ids = [(row[0], row[1]) for row in conn.execute(text(
            "SELECT id, dispatch_token FROM jobs "
            "WHERE state = 'queued' AND dispatched_at IS NOT NULL"))]
    for i, (job_id, token) in enumerate(ids):
        claim = repo.claim(job_id, dispatch_token=token, worker=f"gpu{i}@bench", gpus=str(i),
                           gpu_count=1, now=utcnow(), lease_ttl_s=60)
        if claim is not None:
            repo.record_outcome(job_id, claim.token, Outcome(AttemptReason.SUCCEEDED), now=utcnow())
    for key in r.scan_iter(match=f"{QUEUE}*"):
        r.delete(key)


def measure(url: str, size: int, redis_url: str, *, workers: int, rounds: int) -> dict[str, float]:
    engine = make_engine(url)
    upgrade(engine)
    repo = Repo(engine, half_life_s=Settings().fair_share_half_life_s)
    fill(repo, size)
    settings = Settings(redis_url=redis_url, dispatch_headroom=0)
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    scheduler = Scheduler(settings=settings, repo=repo, redis_client=client,
                          celery=make_celery(settings))
    heartbeats(client, workers)
    scheduler.tick()            # warm-up: connections, broker epoch, statement caches
    run_them(repo, client)
    statements = [0]

    @event.listens_for(engine, "after_cursor_execute")
    def _count(*_: object) -> None:
        statements[0] += 1

    ticks, sent, counted = [], [], []
    for _ in range(rounds):
        heartbeats(client, workers)
        statements[0] = 0
        start = time.perf_counter()
        n = scheduler.tick()
        ticks.append(time.perf_counter() - start)
        counted.append(statements[0])
        sent.append(n)
        run_them(repo, client)
    engine.dispose()
    client.close()
    tick_ms = statistics.median(ticks) * 1000
    per_job = [t * 1000 / max(n, 1) for t, n in zip(ticks, sent, strict=True)]
    return {"queued": size, "dispatched_per_tick": statistics.median(sent),
            "tick_ms": round(tick_ms, 1), "ms_per_dispatch": round(statistics.median(per_job), 2),
            "best_ms_per_dispatch": round(min(per_job), 2),
            "sql_statements_per_tick": statistics.median(counted)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=32, help="idle one-GPU workers per round")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    ap.add_argument("--postgres", default=None, help="also measure on this PostgreSQL server")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    kinds = ["sqlite"] + (["postgres"] if args.postgres else [])
    with tempfile.TemporaryDirectory() as tmp:
        proc, redis_url = start_redis(Path(tmp) / "redis")
        try:
            for kind in kinds:
                for size in sizes:
                    with database(kind, Path(tmp), args.postgres) as url:
                        row = measure(url, size, redis_url, workers=args.workers,
                                      rounds=args.rounds)
                    print(json.dumps({"store": kind, **row}), flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=10)


if __name__ == "__main__":
    main()
