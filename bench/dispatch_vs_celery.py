"""Dispatch overhead of E31 Batch against bare Celery on the same machine; on demand.

    python bench/dispatch_vs_celery.py --jobs 300 --workers 4

The same work both ways: N tasks that each run `python -c pass` in a child process, on
`--workers` worker processes (pool threads, concurrency 1, late ack, prefetch 1) over a
private redis-server. Bare Celery: `apply_async` of a task that runs the child, completion
counted in Redis. E31: `e31 up --cpu-slots W` and N command jobs through the API, the
scheduler, the claim, the store and the artifact store. Prints both throughputs and the
ratio E31 / Celery.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from e31.local.redisserver import start_redis

from stack import private_stack, submit_all, wait_all

CHILD = [sys.executable, "-c", "pass"]

BASELINE_APP = f'''
import subprocess, sys, redis
from celery import Celery
app = Celery("bare", broker=sys.argv[1])
app.conf.update(task_acks_late=True, worker_prefetch_multiplier=1, accept_content=["json"],
                task_serializer="json", task_ignore_result=True)
r = redis.Redis.from_url(sys.argv[1])

@app.task(name="bare.run")
def run():
    subprocess.run({CHILD!r}, check=True)
    r.incr("bare:done")

if __name__ == "__main__":
    app.worker_main(["worker", "-P", "threads", "-c", "1", "-n", sys.argv[2], "-Q", "bare",
                     "--without-gossip", "--without-mingle", "-l", "WARNING"])
'''


def bare_celery(n: int, workers: int, url: str, tmp: Path) -> float:
    script = tmp / "bare_app.py"
    script.write_text(BASELINE_APP)
    procs = [subprocess.Popen([sys.executable, str(script), url, f"bare{i}@bench"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for i in range(workers)]
    try:
        sys.path.insert(0, str(tmp))
        from celery import Celery
        app = Celery("bare", broker=url)
        app.conf.update(accept_content=["json"], task_serializer="json")
        r = redis.Redis.from_url(url)
        r.delete("bare:done")
        time.sleep(5)  # let the workers connect
        start = time.monotonic()
        for _ in range(n):
            app.send_task("bare.run", queue="bare")
        while int(r.get("bare:done") or 0) < n:
            time.sleep(0.05)
        return time.monotonic() - start
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=60)


def e31(n: int, workers: int, tmp: Path) -> float:
    with private_stack(tmp / "e31home", ["--cpu-slots", str(workers)]) as client:
        start = time.monotonic()
        handles = submit_all(client, [{"command": CHILD, "resources": {"gpus": 0}}] * n)
        states = [st["state"] for st in wait_all(handles)]
        elapsed = time.monotonic() - start
    assert states.count("succeeded") == n, states
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=300)
    ap.add_argument("--workers", type=int, default=4)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="e31-bench-"))
    redis_proc, url = start_redis(tmp / "redis")
    try:
        bare_s = bare_celery(args.jobs, args.workers, url, tmp)
    finally:
        redis_proc.terminate()
        redis_proc.wait()
    e31_s = e31(args.jobs, args.workers, tmp)
    print(json.dumps({
        "jobs": args.jobs, "workers": args.workers,
        "bare_celery_s": round(bare_s, 2), "bare_celery_jobs_per_s": round(args.jobs / bare_s, 2),
        "e31_s": round(e31_s, 2), "e31_jobs_per_s": round(args.jobs / e31_s, 2),
        "ratio_e31_over_celery": round(bare_s / e31_s, 3),
    }, indent=2))


if __name__ == "__main__":
    main()
