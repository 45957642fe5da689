"""The scheduler's cost per dispatched job against the size of the backlog; on demand.

    python bench/scheduler_cost.py                       # SQLite: 1,000 / 10,000 / 100,000 queued
    python bench/scheduler_cost.py --smoke --out cost.json   # the suite's run: 200 queued, 2 rounds
    python bench/scheduler_cost.py --postgres postgresql://postgres@127.0.0.1:5432/test
    python bench/scheduler_cost.py --no-sqlite --postgres postgresql://postgres@127.0.0.1:5432/ \
        --sizes 100000,1000000 --tenants 50 --workers 1000 --rounds 3     # docs/scale.md

For each backlog size: a fresh store with that many queued gpu24 jobs over `--tenants`
tenants (weights 1, 1, 2, 4 in turn; every fourth with a quota), a private redis-server,
and `--workers` idle worker heartbeats (the real record, `e31.ops.heartbeat.write`). On
PostgreSQL the backlog is bulk-inserted: a seed of real submits per tenant
(`Repo.insert_array`), copied inside the server (`INSERT … SELECT … generate_series`) to
the size, then ANALYZEd, so that a million queued jobs take seconds, not an hour.

Each round, the real `Scheduler.tick` (reconcile, heartbeats, the heads read,
`admission.decide`, publishing through Celery, pending reasons) fills every idle worker;
then the published jobs are claimed and succeed (not timed) and the queue is drained, so the
next round starts from the same free capacity and a backlog as large less what ran. Prints,
over `--rounds`, ms per tick and per dispatched job (median and best: a busy machine adds
noise), the scheduler process's own CPU ms of it (less noisy: time spent waiting for a
loaded machine's Redis or PostgreSQL is not in it) and the SQL statements one tick runs (no
noise at all).
With `--postgres URL`, the same on PostgreSQL (a fresh database per size, dropped after).

Also per size, for docs/scale.md's model: Redis bytes per heartbeat key and per published
message (INFO memory), Redis commands per tick (INFO commandstats after CONFIG RESETSTAT),
and the SQL statements (and how many of them write) of one job's life outside the tick:
submit (`insert_job`), claim, one lease renewal (a running job renews once a heartbeat
interval) and the outcome, counted by an SQLAlchemy `after_cursor_execute` listener.
Prints a JSON object per store and size; `--out FILE` writes them as one JSON list.
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

from e31.core.clock import utcnow
from e31.core.records import Outcome
from e31.core.sizeclasses import route
from e31.core.spec import JobSpec
from e31.core.states import AttemptReason
from e31.edge.celeryapp import make_celery
from e31.edge.settings import Settings
from e31.local.redisserver import start_redis
from e31.ops import heartbeat
from e31.ops.heartbeat import WorkerInfo
from e31.scheduling.leader import Scheduler
from e31.store import Repo, make_engine
from e31.store.db import scratch_database
from e31.store.migrate import upgrade
from e31.store.models import Job

from report import parse, save

SIZES = (1_000, 10_000, 100_000)
WEIGHTS = (1.0, 1.0, 2.0, 4.0)   # tenants' weights in turn; every fourth has QUOTA
QUOTA = {"gpu24": 8}
INSERT_CHUNK = 5_000
SEED_PER_TENANT = 200     # real submits per tenant on PostgreSQL; the rest are server-side copies
QUEUE = "e31.gpu24"
SMOKE = {"sizes": "200", "rounds": 2, "workers": 4}
BEAT_TTL_S = 600          # the bench's heartbeats outlive a round; real ones live 3 beats
# Columns a copied job gets anew: its id, and no array (an array item's index is unique)
COPY_FRESH = {"id": "'j-' || substr(md5(random()::text || clock_timestamp()::text || g::text), "
                    "1, 20)",
              "array_id": "NULL", "array_index": "NULL",
              "submitted_at": "s.submitted_at + g * interval '1 microsecond'",
              "queued_since": "s.queued_since + g * interval '1 microsecond'"}


def tenants(n: int) -> list[tuple[str, float, dict[str, int] | None]]:
    return [(f"t{i:02d}", WEIGHTS[i % len(WEIGHTS)], QUOTA if i % 4 == 3 else None)
            for i in range(n)]


@contextmanager
def database(kind: str, workdir: Path, pg_url: str | None) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{workdir / f'bench-{uuid.uuid4().hex[:6]}.db'}"
        return
    assert pg_url
    base = Settings(database_url=pg_url).resolved_database_url
    with scratch_database(base, prefix="e31_bench") as url:
        yield url


def fill(repo: Repo, size: int, n_tenants: int) -> None:
    """`size` queued jobs, spread evenly over the tenants: bulk inserts through the repo,
    and on PostgreSQL beyond SEED_PER_TENANT a tenant, copies made inside the server."""
    spec = JobSpec.parse({"entrypoint": "pkg.mod:main", "timeout_s": 600})
    where = route(spec, Settings().size_classes)
    ids = []
    for name, weight, quotas in tenants(n_tenants):
        tenant, _ = repo.create_tenant(name, weight=weight, quotas=quotas, now=utcnow())
        ids.append(tenant.id)
    per_tenant = size // len(ids)
    postgres = repo.engine.dialect.name == "postgresql"
    seeded = min(per_tenant, SEED_PER_TENANT) if postgres else per_tenant
    for tenant_id in ids:
        for start in range(0, seeded, INSERT_CHUNK):
            count = min(INSERT_CHUNK, seeded - start)
            repo.insert_array(tenant_id, "bench", [(spec, where)] * count, now=utcnow())
    if postgres and per_tenant > seeded:
        copy_backlog(repo, ids, seeded, per_tenant - seeded)


def copy_backlog(repo: Repo, tenant_ids: list[str], seeded: int, extra: int) -> None:
    """`extra` more queued jobs per tenant, copies of its seeded ones made by one
    INSERT … SELECT per tenant (PostgreSQL), then ANALYZE so plans see the real table."""
    columns = [c.name for c in Job.__table__.columns]
    chosen = ", ".join(COPY_FRESH.get(c, f"s.{c}") for c in columns)
    copies = -(-extra // seeded)   # ceil: each seeded job copied this many times at most
    sql = text(f"INSERT INTO jobs ({', '.join(columns)}) SELECT {chosen} "
               "FROM (SELECT * FROM jobs WHERE tenant_id = :t) s "
               "CROSS JOIN generate_series(1, :copies) g LIMIT :extra")
    for tenant_id in tenant_ids:
        with repo.engine.begin() as conn:
            conn.execute(sql, {"t": tenant_id, "copies": copies, "extra": extra})
    with repo.engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("ANALYZE jobs"))


def heartbeats(r: redis.Redis, workers: int) -> None:
    """`workers` idle one-GPU workers' heartbeats, eight to a host as on a GPU node."""
    with r.pipeline(transaction=False) as pipe:
        for i in range(workers):
            info = WorkerInfo(node=f"gpu{i % 8}@bench{i // 8}", queues=(QUEUE,), gpus=str(i % 8),
                              gpu_count=1, size_class="gpu24", isolation="sandbox")
            heartbeat.write(pipe, info, interval_s=BEAT_TTL_S / heartbeat.TTL_INTERVALS)
        pipe.execute()


def run_them(repo: Repo, r: redis.Redis) -> None:
    """What the workers would do: claim every published job and record its success."""
    with repo.engine.connect() as conn:
        ids = [(row[0], row[1]) for row in conn.execute(text(
            "SELECT id, dispatch_token FROM jobs "
            "WHERE state = 'queued' AND dispatched_at IS NOT NULL"))]
    for i, (job_id, token) in enumerate(ids):
        claim = repo.claim(job_id, dispatch_token=token, worker=f"gpu{i % 8}@bench{i // 8}",
                           gpus=str(i % 8), gpu_count=1, now=utcnow(), lease_ttl_s=60)
        if claim is not None:
            repo.record_outcome(job_id, claim.token, Outcome(AttemptReason.SUCCEEDED), now=utcnow())
    for key in r.scan_iter(match=f"{QUEUE}*"):
        r.delete(key)


class Statements:
    """SQL statements an engine runs, and how many of them write (INSERT, UPDATE, DELETE)."""

    def __init__(self, engine: object) -> None:
        self.total = self.writes = 0
        event.listen(engine, "after_cursor_execute", self._count)

    def _count(self, _conn: object, _cursor: object, statement: str, *_: object) -> None:
        self.total += 1
        self.writes += statement.lstrip().split(None, 1)[0].upper() in ("INSERT", "UPDATE",
                                                                         "DELETE")

    def reset(self) -> None:
        self.total = self.writes = 0


def redis_calls(r: redis.Redis) -> int:
    """Commands Redis ran since its last CONFIG RESETSTAT (INFO commandstats)."""
    return sum(int(v["calls"]) for v in r.info("commandstats").values())


def redis_used(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


def lifecycle(repo: Repo, counter: Statements) -> dict[str, object]:
    """Statements (writes) of one job's life outside the scheduler's tick: submit, claim,
    one renewal, the outcome. Its dispatch is in the tick (`mark_dispatched`)."""
    tenant = repo.list_tenants()[0]
    spec = JobSpec.parse({"entrypoint": "pkg.mod:main", "timeout_s": 600})
    where = route(spec, Settings().size_classes)
    phases: dict[str, object] = {}

    def count(name: str, call: object) -> object:
        counter.reset()
        result = call() if callable(call) else None
        phases[name] = [counter.total, counter.writes]
        return result

    job = count("submit", lambda: repo.insert_job(tenant.id, spec, where, now=utcnow()))
    tokens = repo.mark_dispatched([job.id], now=utcnow())
    claim = count("claim", lambda: repo.claim(
        job.id, dispatch_token=tokens[job.id], worker="gpu0@life", gpus="0", gpu_count=1,
        now=utcnow(), lease_ttl_s=60))
    assert claim is not None
    count("renew", lambda: repo.renew(job.id, claim.token, now=utcnow(), lease_ttl_s=60,
                                      progress=(1.0, 2.0)))
    count("record", lambda: repo.record_outcome(job.id, claim.token,
                                                Outcome(AttemptReason.SUCCEEDED), now=utcnow()))
    return {"statements_writes_by_phase": phases}


def measure(url: str, size: int, redis_url: str, *, workers: int, rounds: int,
            n_tenants: int) -> dict[str, object]:
    engine = make_engine(url)
    upgrade(engine)
    repo = Repo(engine, half_life_s=Settings().fair_share_half_life_s)
    started = time.perf_counter()
    fill(repo, size, n_tenants)
    fill_s = time.perf_counter() - started
    settings = Settings(redis_url=redis_url, dispatch_headroom=0)
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    scheduler = Scheduler(settings=settings, repo=repo, redis_client=client,
                          celery=make_celery(settings))
    bare = redis_used(client)
    heartbeats(client, workers)
    beat_bytes = (redis_used(client) - bare) / max(workers, 1)
    scheduler.tick()            # warm-up: connections, broker epoch, statement caches
    run_them(repo, client)
    statements = Statements(engine)

    ticks, cpu, sent, counted, calls, message_bytes = [], [], [], [], [], []
    for _ in range(rounds):
        heartbeats(client, workers)
        statements.reset()
        client.config_resetstat()
        before = redis_used(client)
        start, start_cpu = time.perf_counter(), time.process_time()
        n = scheduler.tick()
        ticks.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)   # the scheduler's own CPU: less noisy
        calls.append(redis_calls(client) - 2)   # less the INFO and CONFIG of the bench
        message_bytes.append((redis_used(client) - before) / max(n, 1))
        counted.append(statements.total)
        sent.append(n)
        run_them(repo, client)
    life = lifecycle(repo, statements)
    engine.dispose()
    client.close()
    tick_ms = statistics.median(ticks) * 1000
    per_job = [t * 1000 / max(n, 1) for t, n in zip(ticks, sent, strict=True)]
    return {"queued": size, "tenants": n_tenants, "workers": workers, "fill_s": round(fill_s, 1),
            "dispatched_per_tick": statistics.median(sent),
            "tick_ms": round(tick_ms, 1), "ms_per_dispatch": round(statistics.median(per_job), 2),
            "best_ms_per_dispatch": round(min(per_job), 2),
            "tick_cpu_ms": round(statistics.median(cpu) * 1000, 1),
            "cpu_ms_per_dispatch": round(statistics.median(
                [c * 1000 / max(n, 1) for c, n in zip(cpu, sent, strict=True)]), 2),
            "sql_statements_per_tick": statistics.median(counted),
            "redis_calls_per_tick": statistics.median(calls),
            "redis_bytes_per_heartbeat": round(beat_bytes),
            "redis_bytes_per_message": round(statistics.median(message_bytes)), **life}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=32, help="idle one-GPU workers per round")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tenants", type=int, default=4, help="tenants sharing the backlog")
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    ap.add_argument("--postgres", default=None, help="also measure on this PostgreSQL server")
    ap.add_argument("--no-sqlite", action="store_true", help="measure PostgreSQL only")
    args = parse(ap, SMOKE)
    rows: list[dict[str, object]] = []
    sizes = [int(s) for s in args.sizes.split(",")]
    kinds = ([] if args.no_sqlite else ["sqlite"]) + (["postgres"] if args.postgres else [])
    with tempfile.TemporaryDirectory() as tmp:
        proc, redis_url = start_redis(Path(tmp) / "redis")
        try:
            for kind in kinds:
                for size in sizes:
                    with database(kind, Path(tmp), args.postgres) as url:
                        row = measure(url, size, redis_url, workers=args.workers,
                                      rounds=args.rounds, n_tenants=args.tenants)
                    rows.append({"store": kind, **row})
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    save(args, {"rows": rows})


if __name__ == "__main__":
    main()
