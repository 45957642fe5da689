"""How long each console page takes to answer on a store of many jobs; on demand.

    python bench/console_pages.py --postgres postgresql://postgres@127.0.0.1:5432/test \
        --jobs 1000000                                   # docs/performance.md's figure
    python bench/console_pages.py --smoke --out pages.json   # the suite's run: SQLite, 2,000

A fresh store (a scratch PostgreSQL database, dropped after, or a SQLite file) with `--jobs`
jobs of one tenant (`bench-a`) and a few of a second one: real submits (`Repo.insert_array`,
arrays of SEED items), and on PostgreSQL beyond them copies made inside the server
(`INSERT … SELECT … generate_series`, as bench/scheduler_cost.py does), then one in eight
set failed and the rest succeeded but the newest `--queued` (the backlog), and ANALYZE. A private
redis-server; the real app (`create_app`) in-process through Starlette's TestClient, signed in
to the console as `bench-a`. Each page is asked `--rounds` times after one warm-up; prints
the median and the slowest in ms per page, and the same for `GET /v1/jobs` (the JSON the
jobs page renders), as one JSON object. Not a timed assertion anywhere: a figure for
docs/performance.md ("The console's pages").
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
from fastapi.testclient import TestClient
from sqlalchemy import text

from e31.api import create_app
from e31.api.services import Services
from e31.core.clock import utcnow
from e31.core.sizeclasses import route
from e31.core.spec import JobSpec
from e31.edge.artifacts import ArtifactStore
from e31.edge.settings import Settings
from e31.local.redisserver import start_redis
from e31.store import Repo, make_engine
from e31.store.db import scratch_database
from e31.store.migrate import upgrade
from e31.store.models import Job

from report import parse, save

SEED = 1_000          # jobs per real array submit
SEED_ARRAYS = 5       # real arrays of the tenant; the rest are copies on PostgreSQL
SMOKE = {"jobs": 2_000, "queued": 100, "rounds": 3}
COPY_FRESH = {"id": "'j-' || substr(md5(random()::text || clock_timestamp()::text || g::text), "
                    "1, 20)",
              "array_id": "NULL", "array_index": "NULL",
              "submitted_at": "s.submitted_at - g * interval '1 millisecond'",
              "queued_since": "s.queued_since - g * interval '1 millisecond'"}


@contextmanager
def database(workdir: Path, pg_url: str | None) -> Iterator[str]:
    if pg_url is None:
        yield f"sqlite:///{workdir / 'pages.db'}"
        return
    with scratch_database(Settings(database_url=pg_url).resolved_database_url,
                          prefix="e31_bench") as url:
        yield url


def fill(repo: Repo, jobs: int, queued: int) -> tuple[str, str, list[str]]:
    """The tenants and their jobs; (bench-a's token, bench-b's token, bench-a's array ids)."""
    spec = JobSpec.parse({"entrypoint": "pkg.mod:main", "timeout_s": 600,
                          "resources": {"gpus": 0}})
    where = route(spec, Settings().size_classes)
    a, token_a = repo.create_tenant("bench-a", now=utcnow())
    b, token_b = repo.create_tenant("bench-b", now=utcnow())
    postgres = repo.engine.dialect.name == "postgresql"
    seeded = min(jobs, SEED * SEED_ARRAYS) if postgres else jobs
    arrays = []
    for start in range(0, seeded, SEED):
        arrays.append(repo.insert_array(a.id, "bench", [(spec, where)] * min(SEED, seeded - start),
                                        now=utcnow()).id)
    repo.insert_array(b.id, "theirs", [(spec, where)] * 10, now=utcnow())
    with repo.engine.begin() as conn:
        if jobs > seeded:
            columns = [c.name for c in Job.__table__.columns]
            chosen = ", ".join(COPY_FRESH.get(c, f"s.{c}") for c in columns)
            conn.execute(text(
                f"INSERT INTO jobs ({', '.join(columns)}) SELECT {chosen} "
                "FROM (SELECT * FROM jobs WHERE tenant_id = :t) s "
                "CROSS JOIN generate_series(1, :copies) g LIMIT :extra"),
                {"t": a.id, "copies": -(-(jobs - seeded) // seeded), "extra": jobs - seeded})
        # one in eight failed (by the id's last hex digit), the rest succeeded; then the
        # newest `queued` queued again: the backlog a queued row's reason is read against
        conn.execute(text(
            "UPDATE jobs SET state = CASE WHEN substr(id, 22, 1) IN ('0', '1') THEN 'failed' "
            "ELSE 'succeeded' END, "
            "reason = CASE WHEN substr(id, 22, 1) IN ('0', '1') THEN 'error' END, "
            "error = CASE WHEN substr(id, 22, 1) IN ('0', '1') THEN 'exited with code 1' END, "
            "queued_since = NULL WHERE tenant_id = :t"), {"t": a.id})
        conn.execute(text(
            "UPDATE jobs SET state = 'queued', reason = NULL, error = NULL, "
            "queued_since = submitted_at WHERE id IN (SELECT id FROM jobs WHERE tenant_id = :t "
            "ORDER BY submitted_at DESC LIMIT :n)"), {"t": a.id, "n": queued})
    if postgres:
        with repo.engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("ANALYZE"))
    return token_a, token_b, arrays


def timed(client: TestClient, path: str, rounds: int, **kwargs: object) -> dict[str, float]:
    """Median and slowest ms of `rounds` GETs of `path` (after one warm-up), each a 200."""
    def once() -> float:
        start = time.perf_counter()
        answer = client.get(path, **kwargs)   # type: ignore[arg-type]
        assert answer.status_code == 200, (path, answer.status_code, answer.text[:300])
        return (time.perf_counter() - start) * 1000
    once()
    samples = [once() for _ in range(rounds)]
    return {"median_ms": round(statistics.median(samples), 1),
            "max_ms": round(max(samples), 1)}


def measure(url: str, jobs: int, redis_url: str, workdir: Path, rounds: int, *,
            queued: int) -> dict[str, object]:
    engine = make_engine(url)
    upgrade(engine)
    repo = Repo(engine, half_life_s=Settings().fair_share_half_life_s)
    started = time.perf_counter()
    token_a, _, arrays = fill(repo, jobs, queued)
    fill_s = time.perf_counter() - started
    settings = Settings(redis_url=redis_url, home=workdir)
    services = Services(settings=settings, repo=repo,
                        artifacts=ArtifactStore(f"file://{workdir / 'artifacts'}"),
                        redis_client=redis.Redis.from_url(redis_url))
    client = TestClient(create_app(settings, services=services))
    assert client.post("/ui/login", data={"token": token_a},
                       follow_redirects=False).status_code == 303
    first = client.get("/v1/jobs", params={"limit": 50},
                       headers={"Authorization": f"Bearer {token_a}"}).json()["jobs"]
    job_id = first[-1]["id"]
    pages = {
        "jobs": "/ui/jobs",
        "jobs, failed": "/ui/jobs?state=failed",
        "jobs, name contains": "/ui/jobs?name=bench%5B9",
        "jobs, next page": f"/ui/jobs?before={job_id}",
        "a job": f"/ui/jobs/{job_id}",
        f"an array of {SEED}": f"/ui/arrays/{arrays[0]}",
        "queue": "/ui/queue",
        "usage": "/ui/usage",
        "gpus": "/ui/gpus",
    }
    figures = {name: timed(client, path, rounds) for name, path in pages.items()}
    figures["GET /v1/jobs?limit=50 (JSON)"] = timed(
        client, "/v1/jobs?limit=50", rounds, headers={"Authorization": f"Bearer {token_a}"})
    engine.dispose()
    return {"store": engine.dialect.name, "jobs": jobs, "queued": queued,
            "fill_s": round(fill_s, 1),
            "rounds": rounds, "pages": figures}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=100_000, help="jobs of the measured tenant")
    ap.add_argument("--queued", type=int, default=1_000,
                    help="of them, the newest this many queued (the backlog)")
    ap.add_argument("--rounds", type=int, default=20, help="GETs of each page, after a warm-up")
    ap.add_argument("--postgres", default=None, help="a PostgreSQL server (else SQLite)")
    args = parse(ap, SMOKE)
    with tempfile.TemporaryDirectory() as tmp:
        proc, redis_url = start_redis(Path(tmp) / "redis")
        try:
            with database(Path(tmp), args.postgres) as url:
                row = measure(url, args.jobs, redis_url, Path(tmp), args.rounds,
                              queued=args.queued)
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    print(json.dumps(row, indent=2), flush=True)
    save(args, row)


if __name__ == "__main__":
    main()
