"""A simulated fleet around the real central parts; on demand (docs/scale.md).

    python bench/fleet_sim.py --postgres postgresql://postgres@127.0.0.1:5432/ \\
        --workers 200 --procs 20 --seconds 60 --job-s 4
    python bench/fleet_sim.py --postgres postgresql://postgres@127.0.0.1:5432/ --smoke \\
        --out fleet.json        # the suite's run (tests/bench): 4 workers for 3 s

Starts a private redis-server, a fresh database on the PostgreSQL server (dropped after),
the real `e31 scheduler` and `e31 api` processes, and a backlog of queued jobs over
`--tenants` tenants. Then:

1. **Submit burst.** `--submits` single-job `POST /v1/jobs` from 8 client threads against
   the API process: submits a second; then one `POST /v1/arrays` of `--array-items`
   items: jobs stored a second.
2. **Fleet.** `--workers` simulated one-GPU workers in `--procs` processes (threads within
   each, eight to a pretend host). Each one beats with the worker's own `Heartbeat` class
   (e31_worker.node.heartbeat: the record, its TTL, the drain-key check every beat), takes
   the scheduler's Celery messages off its class queue (a BRPOP on the queue's priority
   lists, as kombu's Redis transport consumes them, without kombu's unacked bookkeeping),
   claims the job with the message's dispatch token, renews its lease every heartbeat
   interval for `--job-s` seconds of pretend work, records success, and wakes the
   scheduler, as a worker does; with `--chain N` it first claims up to N of the array's
   next items in a row (`claim_next_item`, as a worker with `array_chain_items` does). No
   process or sandbox is started for the job. A process's
   simulated workers share one worker pool of connections to the store (`make_engine(...,
   worker=True)`: one, and a second while a call nests), as a node's workers would share a
   node-local pooler (docs/architecture.md, "Connections").

Prints one JSON object: the submit rate; the fleet's jobs a second; heartbeats, Redis
commands (INFO commandstats, per command) and store transactions and rows written
(pg_stat_database) a second; Redis memory; PostgreSQL connections seen; the scheduler's
process CPU seconds a second. `--out FILE` writes the same object there.
"""

from __future__ import annotations

import argparse
import base64
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import httpx
import redis
from scheduler_cost import fill
from sqlalchemy import text

from e31.client import Client
from e31.core.clock import utcnow
from e31.core.errors import StoreError
from e31.core.records import Claim, Outcome
from e31.core.states import AttemptReason
from e31.edge.settings import Settings
from e31.local.redisserver import free_port, start_redis
from e31.ops import heartbeat
from e31.ops.heartbeat import WorkerInfo
from e31.store import Repo, make_engine
from e31.store.db import scratch_database
from e31.store.migrate import upgrade
from e31_worker.node.heartbeat import Heartbeat

from report import parse, save

QUEUE = "e31.gpu24"
# kombu's Redis transport keeps one list per priority step ("sep" ":"), the highest first
QUEUE_KEYS = [QUEUE] + [f"{QUEUE}:{p}" for p in range(1, 10)]
BRPOP_S = 1
STORE_RETRY_FIRST_S = 0.2     # as a worker's first back-off after a store error
STORE_RETRY_MAX_DELAY_S = 2.0
T = TypeVar("T")
READY_S = 60.0
SUBMIT_THREADS = 8
SMOKE = {"workers": 4, "procs": 1, "seconds": 3.0, "job_s": 0.5, "interval_s": 0.5,
         "tenants": 2, "backlog": 40, "submits": 10, "array_items": 20}


def decode(raw: bytes) -> tuple[str, str]:
    """(job id, dispatch token) from a Celery message as kombu stores it in Redis."""
    envelope = json.loads(raw)
    body = envelope["body"]
    if envelope.get("properties", {}).get("body_encoding") == "base64":
        body = base64.b64decode(body)
    args, _kwargs, _embed = json.loads(body)
    return str(args[0]), str(args[1])


class Tally:
    """Counts one simulated worker's thread adds to; summed per process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = self.claims_refused = self.renewals = self.store_retries = self.chained = 0

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)


def retried(tally: Tally, call: Callable[[], T]) -> T:
    """`call()`, retried on a store error as a worker's writes are (e31_worker.attempt.record,
    `with_store_retries`: a deadlock PostgreSQL broke is one), each retry counted."""
    delay_s = STORE_RETRY_FIRST_S
    while True:
        try:
            return call()
        except StoreError:
            tally.add(store_retries=1)
            time.sleep(delay_s)
            delay_s = min(delay_s * 2, STORE_RETRY_MAX_DELAY_S)


def sim_worker(index: int, repo: Repo, redis_url: str, *, interval_s: float, job_s: float,
               lease_ttl_s: float, chain: int, stop: threading.Event, tally: Tally) -> None:
    beats = redis.Redis.from_url(redis_url)
    consumer = redis.Redis.from_url(redis_url, socket_timeout=BRPOP_S + 5)
    node = f"gpu{index % 8}@sim{index // 8}"
    info = WorkerInfo(node=node, queues=(QUEUE,), gpus=str(index % 8), gpu_count=1,
                      size_class="gpu24", isolation="sandbox")
    hb = Heartbeat(redis_client=beats, identity=info, interval_s=interval_s,
                   on_drain=lambda: None, drain_authorized=lambda: False)

    def work(claim: Claim) -> None:
        """The claimed job's pretend work, its lease renewed every interval, then success."""
        hb.set_busy(claim.job_id)
        end = time.monotonic() + job_s
        renewals = 0
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(interval_s, left))
            done_s = job_s - max(0.0, end - time.monotonic())
            retried(tally, partial(repo.renew, claim.job_id, claim.token, now=utcnow(),
                                   lease_ttl_s=lease_ttl_s, progress=(done_s, job_s)))
            renewals += 1
        retried(tally, partial(repo.record_outcome, claim.job_id, claim.token,
                               Outcome(AttemptReason.SUCCEEDED), now=utcnow()))
        tally.add(done=1, renewals=renewals)

    hb.start()
    try:
        while not stop.is_set():
            item = consumer.brpop(QUEUE_KEYS, timeout=BRPOP_S)
            if item is None:
                continue
            job_id, token = decode(item[1])
            claim = retried(tally, partial(
                repo.claim, job_id, dispatch_token=token, worker=node, gpus=info.gpus,
                gpu_count=1, now=utcnow(), lease_ttl_s=lease_ttl_s))
            if claim is None:
                tally.add(claims_refused=1)
                continue
            work(claim)
            for _ in range(chain):   # the array's next items in a row, as a worker does
                if stop.is_set():
                    break
                nxt = retried(tally, partial(
                    repo.claim_next_item, claim.job_id, queue=QUEUE, worker=node,
                    gpus=info.gpus, gpu_count=1, now=utcnow(), lease_ttl_s=lease_ttl_s))
                if nxt is None:
                    break
                tally.add(chained=1)
                work(nxt)
                claim = nxt
            hb.set_busy(None)
            heartbeat.wake(beats)
    finally:
        hb.stop()


def sim_process(first: int, count: int, db_url: str, redis_url: str, settings: dict[str, Any],
                seconds: float, out: Any) -> None:
    """`count` simulated workers as threads sharing one worker engine, for `seconds`."""
    engine = make_engine(db_url, application_name="e31 fleet-sim", worker=True)
    repo = Repo(engine, half_life_s=Settings().fair_share_half_life_s)
    stop, tally = threading.Event(), Tally()
    threads = [threading.Thread(target=sim_worker, args=(first + i, repo, redis_url),
                                kwargs={"stop": stop, "tally": tally, **settings}, daemon=True)
               for i in range(count)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    engine.dispose()
    out.put({"done": tally.done, "claims_refused": tally.claims_refused, "chained": tally.chained,
             "renewals": tally.renewals, "store_retries": tally.store_retries})


@contextmanager
def service(name: str, env: dict[str, str], logs: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(logs / f"{name}.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "e31.cli", name], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def db_stats(engine: Any) -> dict[str, int]:
    with engine.connect() as conn:
        row = conn.execute(text(
            "SELECT xact_commit, tup_inserted, tup_updated, tup_deleted, numbackends "
            "FROM pg_stat_database WHERE datname = current_database()")).one()
    return dict(zip(("xact_commit", "tup_inserted", "tup_updated", "tup_deleted", "backends"),
                    map(int, row), strict=True))


def commandstats(r: redis.Redis) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): int(v["calls"])
            for k, v in r.info("commandstats").items()}


def submit_burst(url: str, token: str, n: int) -> float:
    """Submits a second: `n` single jobs from SUBMIT_THREADS threads."""
    client = Client(url, token)
    spec = {"entrypoint": "pkg.mod:main", "resources": {"gpus": 1}, "timeout_s": 600}
    started = time.perf_counter()
    with ThreadPoolExecutor(SUBMIT_THREADS) as pool:
        list(pool.map(lambda _: client.submit(spec), range(n)))
    return n / (time.perf_counter() - started)


def array_burst(url: str, token: str, n: int, arrays: int = 1) -> tuple[float, float]:
    """Jobs a second stored by `arrays` requests `POST /v1/arrays` of `n` items each, sent
    from up to SUBMIT_THREADS clients at once, and the seconds they took in all."""
    def one(k: int) -> None:
        Client(url, token).submit_many([{"params": {"i": i}} for i in range(n)],
                                       name=f"burst-{k}", entrypoint="pkg.mod:main",
                                       resources={"gpus": 1}, timeout_s=600)

    started = time.perf_counter()
    with ThreadPoolExecutor(min(arrays, SUBMIT_THREADS)) as pool:
        list(pool.map(one, range(arrays)))
    took = time.perf_counter() - started
    return n * arrays / took, took


def api_ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait(what: str, condition: Any, timeout_s: float = READY_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {what}")
        time.sleep(0.2)


def run(args: argparse.Namespace, tmp: Path, db_url: str) -> dict[str, Any]:
    engine = make_engine(db_url)
    upgrade(engine)
    repo = Repo(engine, half_life_s=Settings().fair_share_half_life_s)
    fill(repo, args.backlog, args.tenants)
    _, token = repo.create_tenant("burst", now=utcnow())
    proc, redis_url = start_redis(tmp / "redis")
    r = redis.Redis.from_url(redis_url)
    api_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("E31_")}
    env.update(E31_HOME=str(tmp / "home"), E31_DATABASE_URL=db_url, E31_REDIS_URL=redis_url,
               E31_API_PORT=str(api_port), E31_HEARTBEAT_INTERVAL_S=str(args.interval_s),
               E31_TENANT_SUBMIT_RATE_PER_S="1000000", E31_TENANT_SUBMIT_BURST="100000",
               E31_TENANT_MAX_QUEUED="2000000")
    url = f"http://127.0.0.1:{api_port}"
    logs = tmp / "logs"
    logs.mkdir()
    settings = {"interval_s": args.interval_s, "job_s": args.job_s, "lease_ttl_s": 30.0,
                "chain": args.chain}
    try:
        with service("api", env, logs) as api, service("scheduler", env, logs) as sched:
            wait("the API", lambda: api_ready(url))
            submits_per_s = submit_burst(url, token, args.submits) if args.submits else 0.0
            array_per_s, array_s = (array_burst(url, token, args.array_items, args.arrays)
                                    if args.array_items else (0.0, 0.0))
            r.config_resetstat()
            before_db, mem_before = db_stats(engine), int(r.info("memory")["used_memory"])
            sched_cpu, api_cpu = cpu_s(sched.pid), cpu_s(api.pid)
            ctx = multiprocessing.get_context("fork")
            out = ctx.Queue()
            per = -(-args.workers // args.procs)
            procs = [ctx.Process(target=sim_process, args=(
                first, min(per, args.workers - first), db_url, redis_url, settings,
                args.seconds, out)) for first in range(0, args.workers, per)]
            started = time.monotonic()
            for p in procs:
                p.start()
            backends = 0
            while any(p.is_alive() for p in procs):
                backends = max(backends, db_stats(engine)["backends"])
                time.sleep(1)
            elapsed = time.monotonic() - started
            results = [out.get(timeout=10) for _ in procs]
            after_db, calls = db_stats(engine), commandstats(r)
            mem_peak = int(r.info("memory")["used_memory_peak"])
            sched_cpu, api_cpu = cpu_s(sched.pid) - sched_cpu, cpu_s(api.pid) - api_cpu
    finally:
        r.close()
        proc.terminate()
        proc.wait(timeout=10)
        engine.dispose()
    done = sum(x["done"] for x in results)
    beats = calls.get("set", 0)   # every heartbeat is one SET; nothing else here SETs
    total_calls = sum(calls.values())
    return {
        "workers": args.workers, "procs": args.procs,
        "job_s": args.job_s, "heartbeat_interval_s": args.interval_s, "seconds": round(elapsed, 1),
        "api_submits_per_s": round(submits_per_s, 1),
        "api_array_jobs_per_s": round(array_per_s, 1),
        "api_arrays": {"arrays": args.arrays, "items_each": args.array_items,
                       "jobs": args.arrays * args.array_items, "seconds": round(array_s, 1)},
        "jobs_done": done, "jobs_per_s": round(done / elapsed, 1),
        "jobs_per_s_if_never_idle": round(args.workers / (args.job_s + 0.0001), 1),
        "claims_refused": sum(x["claims_refused"] for x in results),
        "array_chain_items": args.chain,
        "claimed_in_a_row": sum(x["chained"] for x in results),
        "store_retries": sum(x["store_retries"] for x in results),
        "renewals_per_s": round(sum(x["renewals"] for x in results) / elapsed, 1),
        "heartbeats_per_s": round(beats / elapsed, 1),
        "redis_calls_per_s": round(total_calls / elapsed, 1),
        "redis_calls_per_job": round(total_calls / max(done, 1), 1),
        "redis_calls_by_command": dict(sorted(calls.items(), key=lambda kv: -kv[1])[:10]),
        "redis_used_memory_mb": round(mem_before / 2**20, 2),
        "redis_peak_memory_mb": round(mem_peak / 2**20, 2),
        "pg_commits_per_s": round((after_db["xact_commit"] - before_db["xact_commit"]) / elapsed,
                                  1),
        "pg_rows_written_per_s": round(sum(after_db[k] - before_db[k] for k in (
            "tup_inserted", "tup_updated", "tup_deleted")) / elapsed, 1),
        "pg_commits_per_job": round((after_db["xact_commit"] - before_db["xact_commit"])
                                    / max(done, 1), 1),
        "pg_backends_max": backends,
        "scheduler_cpu_s_per_s": round(sched_cpu / elapsed, 3),
        "api_cpu_s_per_s": round(api_cpu / elapsed, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--postgres", required=True, help="a PostgreSQL server (a database is made)")
    ap.add_argument("--workers", type=int, default=200, help="simulated one-GPU workers")
    ap.add_argument("--procs", type=int, default=20, help="processes they run in")
    ap.add_argument("--seconds", type=float, default=60.0, help="how long the fleet runs")
    ap.add_argument("--job-s", type=float, default=4.0, help="each job's pretend work")
    ap.add_argument("--interval-s", type=float, default=2.0, help="heartbeat interval")
    ap.add_argument("--tenants", type=int, default=50)
    ap.add_argument("--backlog", type=int, default=20_000, help="queued jobs at the start")
    ap.add_argument("--submits", type=int, default=500, help="single submits in the burst")
    ap.add_argument("--array-items", type=int, default=10_000, help="items of one array submit")
    ap.add_argument("--arrays", type=int, default=1,
                    help="array submits of --array-items each, from up to 8 clients at once "
                         "(100 of 10,000: the million jobs of issue 31's target)")
    ap.add_argument("--chain", type=int, default=0,
                    help="array items a simulated worker claims in a row after one it ran "
                         "(the worker's array_chain_items; 0: every job from a message)")
    args = parse(ap, SMOKE)
    base = Settings(database_url=args.postgres).resolved_database_url
    with tempfile.TemporaryDirectory() as tmp, scratch_database(base, prefix="e31_fleet") as url:
        report = run(args, Path(tmp), url)
    save(args, report)
    print(json.dumps(report, indent=2), flush=True)


if __name__ == "__main__":
    main()
