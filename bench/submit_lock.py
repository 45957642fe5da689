"""How long one array submission holds the store's write transaction; on demand.

    python bench/submit_lock.py                        # SQLite
    python bench/submit_lock.py --postgres postgresql://postgres@127.0.0.1:5432/test
    python bench/submit_lock.py --smoke --out lock.json   # the suite's run: 200 items, 1 round

`Repo.insert_array` straight (no API, so none of its caps), on a fresh store holding one
tenant and 10,000 of its queued jobs, for the shapes an attacker or a big sweep sends:
10,000 items with 64 `after` ids each that are no job (refused), with one queued job each
(10,000 pending dependencies, the most the default `max_after_per_request` admits), and
with 64 queued jobs each (640,000 `job_deps` rows: only with that cap lifted), and without
dependencies. Prints, per shape, the outcome, the whole call and the longest write
transaction (from the moment it holds SQLite's write lock to its commit or rollback): the
median and the worst of `--rounds`. With `--postgres URL`, the same on PostgreSQL (a fresh
database, dropped after), where a write transaction holds row locks only. `--items N`
shrinks the arrays (and the seeded jobs); `--out FILE` writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, event

from e31.core.clock import utcnow
from e31.core.errors import SpecError
from e31.core.sizeclasses import Route, route
from e31.core.spec import MAX_AFTER, JobSpec
from e31.edge.settings import Settings
from e31.ops.sweep import MAX_ARRAY_ITEMS
from e31.store import Repo, make_engine
from e31.store.db import WRITE_OPTION, scratch_database
from e31.store.migrate import upgrade

from report import parse, save

SMOKE = {"items": 200, "rounds": 1}


@contextmanager
def database(workdir: Path, pg_url: str | None) -> Iterator[str]:
    if pg_url is None:
        yield f"sqlite:///{workdir / f'bench-{uuid.uuid4().hex[:6]}.db'}"
        return
    with scratch_database(Settings(database_url=pg_url).resolved_database_url,
                          prefix="e31_bench") as url:
        yield url


def write_holds(engine: Engine) -> list[float]:
    """Seconds each write transaction on `engine` held the store, appended as they end."""
    holds: list[float] = []
    started: dict[int, float] = {}

    @event.listens_for(engine, "begin")   # after db.py's listener took the write lock
    def _began(conn: Any) -> None:
        if conn.get_execution_options().get(WRITE_OPTION):
            started[id(conn)] = time.perf_counter()

    def _ended(conn: Any) -> None:
        if (began := started.pop(id(conn), None)) is not None:
            holds.append(time.perf_counter() - began)

    event.listen(engine, "commit", _ended)
    event.listen(engine, "rollback", _ended)
    return holds


def shapes(queued: list[str]) -> dict[str, Callable[[int], list[str]]]:
    """Each shape's `after` list for item i."""
    return {
        f"{MAX_AFTER} unknown ids per item": lambda i: [
            f"j-{uuid.uuid4().hex[:20]}" for _ in range(MAX_AFTER)],
        "1 queued job per item": lambda i: [queued[i]],
        f"{MAX_AFTER} queued jobs per item": lambda i: [
            queued[(i * MAX_AFTER + k) % len(queued)] for k in range(MAX_AFTER)],
        "no dependencies": lambda i: [],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--postgres", metavar="URL", help="PostgreSQL server (SQLAlchemy URL)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--items", type=int, default=MAX_ARRAY_ITEMS,
                        help="items per array, and queued jobs seeded")
    args = parse(parser, SMOKE)
    items_n = args.items
    report: dict[str, Any] = {"items": items_n, "rounds": args.rounds, "shapes": {}}
    classes = Settings().size_classes
    plain = JobSpec.parse({"entrypoint": "m:f"})
    where: Route = route(plain, classes)
    with tempfile.TemporaryDirectory() as tmp, database(Path(tmp), args.postgres) as url:
        engine = make_engine(url)
        upgrade(engine)
        repo = Repo(engine, half_life_s=Settings().fair_share_half_life_s)
        tenant, _ = repo.create_tenant("bench", now=utcnow())
        seeded = repo.insert_array(tenant.id, "deps", [(plain, where)] * items_n, now=utcnow())
        holds = write_holds(engine)
        report["store"] = engine.dialect.name
        print(f"{engine.dialect.name}: arrays of {items_n:,} items; median / worst of "
              f"{args.rounds} rounds")
        for name, after in shapes([item.id for item in seeded.items or []]).items():
            totals, longest, outcome = [], [], ""
            for _ in range(args.rounds):
                items = []
                for i in range(items_n):
                    spec = JobSpec.parse({"entrypoint": "m:f", "after": after(i)})
                    items.append((spec, where))
                holds.clear()
                began = time.perf_counter()
                try:
                    repo.insert_array(tenant.id, "bench", items, now=utcnow())
                    outcome = "stored"
                except SpecError:
                    outcome = "refused"
                totals.append(time.perf_counter() - began)
                longest.append(max(holds, default=0.0))
            report["shapes"][name] = {
                "outcome": outcome, "call_s_median": statistics.median(totals),
                "call_s_worst": max(totals), "write_s_median": statistics.median(longest),
                "write_s_worst": max(longest)}
            print(f"  {name:28} {outcome:8} call {statistics.median(totals):6.2f} / "
                  f"{max(totals):6.2f} s   write transaction "
                  f"{statistics.median(longest):6.3f} / {max(longest):6.3f} s")
        engine.dispose()
    save(args, report)


if __name__ == "__main__":
    main()
