"""Tiny isolated jobs end to end: E31 Batch against bare Celery on the same Redis and machine;
on demand.

    python bench/dispatch_vs_celery.py --jobs 300 --workers 2
    python bench/dispatch_vs_celery.py --smoke --out dispatch.json   # the suite's run: 4 jobs

One private redis-server serves every side in turn. Bare Celery runs `--workers` worker
processes (pool threads, concurrency 1, late ack, prefetch 1) and N tasks through them twice:
an in-process no-op task, then a task that runs `python3 -c pass` in a child process (the
same work as E31's command job). E31 runs `e31 up --cpu-slots W` on the same Redis and takes N jobs
through the API, the scheduler, the claim, the store, the sandbox and the artifact store,
each followed with `JobHandle.wait()` as a user would, twice: as command jobs
`python3 -c pass`, and as entrypoint jobs (`e31_worker.examples:hello`, forked from the warm
process where the worker has one). The timer runs from the first submit or `send_task` to
the last completion.

Nothing may be lost and nothing run twice: every Celery task adds its own id to a Redis set
and counts itself (N ids, N runs), and every E31 job must succeed in exactly one attempt.
Prints jobs/s for each side and the ratios E31 / Celery (docs/performance.md, "Dispatch and
the control path"); `--out FILE` writes the same JSON.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis

from e31.local.redisserver import start_redis

from report import parse, save
from stack import celery_workers_ready, private_stack, submit_all

CHILD = ["python3", "-c", "pass"]

BASELINE_APP = f'''
import subprocess, sys, redis
from celery import Celery
app = Celery("bare", broker=sys.argv[1])
app.conf.update(task_acks_late=True, worker_prefetch_multiplier=1, accept_content=["json"],
                task_serializer="json", task_ignore_result=True)
r = redis.Redis.from_url(sys.argv[1])

def done(task):
    r.sadd("bare:ids", task.request.id)
    r.incr("bare:runs")

@app.task(name="bare.noop", bind=True)
def noop(self):
    done(self)

@app.task(name="bare.run", bind=True)
def run(self):
    subprocess.run({CHILD!r}, check=True)
    done(self)

if __name__ == "__main__":
    app.worker_main(["worker", "-P", "threads", "-c", "1", "-n", sys.argv[2], "-Q", "bare",
                     "--without-gossip", "--without-mingle", "-l", "WARNING"])
'''

SMOKE = {"jobs": 4, "workers": 1}

E31_JOBS = {"command": {"command": CHILD, "resources": {"gpus": 0}},
            "entrypoint": {"entrypoint": "e31_worker.examples:hello", "resources": {"gpus": 0}}}


def bare_celery(n: int, workers: int, url: str, tmp: Path, tasks: list[str],
                ) -> dict[str, dict[str, Any]]:
    """`n` tasks of each of `tasks` in turn through the same `workers` bare Celery workers;
    wall seconds and checks per task."""
    script = tmp / "bare_app.py"
    script.write_text(BASELINE_APP)
    r = redis.Redis.from_url(url)
    r.delete("bare")
    procs = [subprocess.Popen([sys.executable, str(script), url, f"bare{i}@bench"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for i in range(workers)]
    out: dict[str, dict[str, Any]] = {}
    try:
        from celery import Celery
        app = Celery("bare", broker=url)
        app.conf.update(accept_content=["json"], task_serializer="json")
        celery_workers_ready(app, workers)
        for task in tasks:
            r.delete("bare:ids", "bare:runs")
            start = time.monotonic()
            with app.producer_or_acquire() as producer:
                for _ in range(n):
                    app.send_task(task, queue="bare", producer=producer)
            while int(r.get("bare:runs") or 0) < n:
                time.sleep(0.01)
            elapsed = time.monotonic() - start
            time.sleep(1.0)  # a duplicate run would show by now
            runs, ids = int(r.get("bare:runs") or 0), r.scard("bare:ids")
            out[task] = {"s": round(elapsed, 2), "jobs_per_s": round(n / elapsed, 1),
                         "runs": runs, "distinct": ids, "lost": n - ids, "run_twice": runs - ids}
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=60)
    return out


def e31(n: int, workers: int, url: str, tmp: Path, kinds: list[str]) -> dict[str, Any]:
    """`n` jobs of each kind through one `e31 up` stack on `url`; wall seconds and checks."""
    out: dict[str, Any] = {}
    with private_stack(tmp / "e31home", ["--cpu-slots", str(workers)], redis_url=url) as client:
        for kind in kinds:
            for h in submit_all(client, [E31_JOBS[kind]] * (2 * workers)):   # warm-up
                h.wait()
            start = time.monotonic()
            handles = submit_all(client, [E31_JOBS[kind]] * n)
            with ThreadPoolExecutor(8) as pool:
                finals = list(pool.map(lambda h: h.wait(), handles))
            elapsed = time.monotonic() - start
            once = sum(1 for st in finals if st["state"] == "succeeded"
                       and len(st["attempts"]) == 1)
            out[kind] = {"s": round(elapsed, 2), "jobs_per_s": round(n / elapsed, 1),
                         "succeeded_in_one_attempt": once, "lost_or_rerun": n - once}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=300)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--e31-kinds", default="command,entrypoint",
                    help="which E31 jobs to run: command, entrypoint or both")
    args = parse(ap, SMOKE)
    tmp = Path(tempfile.mkdtemp(prefix="e31-bench-"))
    redis_proc, url = start_redis(tmp / "redis")
    try:
        bare = bare_celery(args.jobs, args.workers, url, tmp, ["bare.noop", "bare.run"])
        noop, child = bare["bare.noop"], bare["bare.run"]
        ours = e31(args.jobs, args.workers, url, tmp, args.e31_kinds.split(","))
    finally:
        redis_proc.terminate()
        redis_proc.wait()
    best = max(v["jobs_per_s"] for v in ours.values())
    report = {
        "jobs": args.jobs, "workers": args.workers,
        "bare_celery_noop_in_process": noop, "bare_celery_subprocess_per_task": child,
        "e31": ours,
        "ratio_e31_best_over_celery_noop": round(best / noop["jobs_per_s"], 3),
        "ratio_e31_command_over_celery_subprocess": round(
            ours["command"]["jobs_per_s"] / child["jobs_per_s"], 3) if "command" in ours else None,
    }
    save(args, report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
