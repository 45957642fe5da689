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
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis

from e31.client import Client
from e31.redisserver import free_port, start_redis

CHILD = [sys.executable, "-c", "pass"]

BASELINE_APP = '''
import subprocess, sys, redis
from celery import Celery
app = Celery("bare", broker=sys.argv[1])
app.conf.update(task_acks_late=True, worker_prefetch_multiplier=1, accept_content=["json"],
                task_serializer="json", task_ignore_result=True)
r = redis.Redis.from_url(sys.argv[1])

@app.task(name="bare.run")
def run():
    subprocess.run(%r, check=True)
    r.incr("bare:done")

if __name__ == "__main__":
    app.worker_main(["worker", "-P", "threads", "-c", "1", "-n", sys.argv[2], "-Q", "bare",
                     "--without-gossip", "--without-mingle", "-l", "WARNING"])
''' % (CHILD,)


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
    home = tmp / "e31home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("E31_")}
    env.update(E31_HOME=str(home), E31_API_PORT=str(free_port()))
    up = subprocess.Popen([sys.executable, "-m", "e31.cli", "up", "--no-flower", "--cpu-slots",
                           str(workers)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not (home / "stack.json").exists() or not json.loads((home / "stack.json").read_text()).get("ready"):
            if up.poll() is not None:
                sys.exit(f"e31 up failed; see {home}/logs")
            time.sleep(0.2)
        profile = json.loads((home / "profile.json").read_text())
        client = Client(profile["url"], profile["token"])
        start = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            handles = list(pool.map(lambda _: client.submit(command=CHILD, resources={"gpus": 0}), range(n)))
        with ThreadPoolExecutor(8) as pool:
            states = list(pool.map(lambda h: next(s["state"] for s in h.watch(poll_s=0.5)
                                                  if s["state"] in ("succeeded", "failed", "cancelled")),
                                   handles))
        elapsed = time.monotonic() - start
        assert states.count("succeeded") == n, states
        return elapsed
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=120)


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
