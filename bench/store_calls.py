"""The CPU and the SQL statements of each store call on a job's path, in-process; on demand.

    python bench/store_calls.py                       # 300 jobs and a 300-item row, SQLite
    python bench/store_calls.py --calls 1000 --out calls.json
    python bench/store_calls.py --smoke --out calls.json      # the suite's run: 20 calls

A fresh SQLite store in a temporary directory (the one `e31 up` uses), one tenant. For `--calls`
jobs, each call a job makes of the store, one after the other, as its processes make them:
the API's token read (`tenant_for_token`) and submit (`insert_job`, within the tenant's most
queued jobs), the scheduler's mark (`mark_dispatched`), the worker's claim and outcome
(`record_outcome`), and the API's read of the ended job (`get_job`). Then the items of one array
run as a row does (docs/scheduling.md, "Array items in a row"): each item's outcome, then
`claim_next_item` for the next. Prints, per call, the CPU it took (this process's own clock,
`time.process_time`: the median over the calls and their mean) and the SQL statements it ran
(counted by an SQLAlchemy listener, SQLite's BEGIN included: they do not depend on the
machine's load).

Where issue 31's control path spends its store time, call by call, without a stack around it:
`bench/profile_job_path.py` measures the same calls inside the real processes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import event

from e31.core.clock import utcnow
from e31.core.records import Claim, Outcome
from e31.core.sizeclasses import route
from e31.core.spec import JobSpec
from e31.core.states import AttemptReason
from e31.edge.settings import Settings
from e31.store import Repo
from e31.store.db import make_engine
from e31.store.migrate import upgrade

from report import parse, save

SMOKE = {"calls": 20}
MAX_QUEUED = 1_000_000   # the submit counts the tenant's queued jobs, as the API's does
WORKER = "bench@host"
LEASE_TTL_S = 60.0


class Meter:
    """CPU seconds and SQL statements per named call: `with meter("claim"): ...`."""

    def __init__(self, repo: Repo) -> None:
        self.cpu: dict[str, list[float]] = {}
        self.statements: dict[str, list[int]] = {}
        self._seen = 0
        event.listen(repo.engine, "before_cursor_execute", self._count)

    def _count(self, *_: Any) -> None:
        self._seen += 1

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        seen, started = self._seen, time.process_time()
        yield
        self.cpu.setdefault(name, []).append(time.process_time() - started)
        self.statements.setdefault(name, []).append(self._seen - seen)

    def report(self) -> dict[str, Any]:
        return {name: {"cpu_ms_median": round(1000 * statistics.median(cpu), 3),
                       "cpu_ms_mean": round(1000 * statistics.fmean(cpu), 3),
                       "statements": round(statistics.fmean(self.statements[name]), 2),
                       "calls": len(cpu)}
                for name, cpu in self.cpu.items()}


def measure(calls: int, home: Path) -> dict[str, Any]:
    engine = make_engine(f"sqlite:///{home / 'e31.db'}")
    upgrade(engine)
    repo = Repo(engine, half_life_s=Settings().fair_share_half_life_s)
    tenant, token = repo.create_tenant("bench", now=utcnow())
    spec = JobSpec.parse({"command": ["true"], "resources": {"gpus": 0}})
    where = route(spec, Settings().size_classes)
    meter = Meter(repo)
    done = Outcome(AttemptReason.SUCCEEDED, exit_code=0)
    for _ in range(calls):
        with meter("token"):
            repo.tenant_for_token(token)
        with meter("submit"):
            job = repo.insert_job(tenant.id, spec, where, now=utcnow(), max_queued=MAX_QUEUED)
        with meter("mark"):
            issued = repo.mark_dispatched([job.id], now=utcnow())
        with meter("claim"):
            claim = repo.claim(job.id, dispatch_token=issued[job.id], worker=WORKER, gpus="",
                               gpu_count=0, now=utcnow(), lease_ttl_s=LEASE_TTL_S)
        assert claim is not None, "a published job was not claimed"
        with meter("outcome"):
            repo.record_outcome(job.id, claim.token, done, now=utcnow())
        with meter("read"):
            repo.get_job(tenant.id, job.id)
    array = repo.insert_array(tenant.id, "row", [(spec, where)] * (calls + 1), now=utcnow())
    first = min(repo.list_jobs(tenant.id, array_id=array.id, limit=calls + 1),
                key=lambda j: j.array_index or 0).id
    item: Claim | None = repo.claim(
        first, dispatch_token=repo.mark_dispatched([first], now=utcnow())[first], worker=WORKER,
        gpus="", gpu_count=0, now=utcnow(), lease_ttl_s=LEASE_TTL_S)
    for _ in range(calls):
        assert item is not None, "a row ended before its array"
        with meter("item outcome"):
            repo.record_outcome(item.job_id, item.token, done, now=utcnow())
        with meter("next item claim"):
            item = repo.claim_next_item(item.job_id, queue=where.queue, worker=WORKER, gpus="",
                                        gpu_count=0, now=utcnow(), lease_ttl_s=LEASE_TTL_S)
    engine.dispose()
    return {"calls": calls, "database": "sqlite", "per_call": meter.report()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300, help="jobs, and items of the row")
    args = parse(ap, SMOKE)
    with tempfile.TemporaryDirectory(prefix="e31-store-calls-") as home:
        result = measure(args.calls, Path(home))
    save(args, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
