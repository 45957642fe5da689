"""Tiny isolated jobs end to end: E31 Batch against bare Celery on the same Redis and machine,
in wall time and in CPU per job of every process on both sides; on demand.

    python bench/dispatch_vs_celery.py --jobs 300 --workers 2
    python bench/dispatch_vs_celery.py --smoke --out dispatch.json   # the suite's run: 4 jobs

One private redis-server serves every side in turn. Bare Celery runs `--workers` worker
processes (pool threads, concurrency 1, late ack, prefetch 1) and N tasks through them twice:
an in-process no-op task, then a task that runs `python3 -c pass` in a child process (the
same work as E31's command job). E31 runs `e31 up --cpu-slots W` on the same Redis and takes N jobs
through the API, the scheduler, the claim, the store, the sandbox and the artifact store
three times (`--e31-kinds`): as command jobs `python3 -c pass` and as entrypoint jobs
(`e31_worker.examples:hello`, forked from the warm process where the worker has one), each
submitted alone and followed with `JobHandle.wait()` as a user would; and as the N items of
one array of those entrypoint jobs, submitted in one request and followed as a whole with
`ArrayHandle.wait()` (which asks every 0.5 s). Each E31 kind first runs a small batch of its
own as a warm-up. The timer runs from the first submit or `send_task` to the last completion.

Nothing may be lost and nothing run twice: every Celery task adds its own id to a Redis set
and counts itself (N ids, N runs); every E31 job must succeed in exactly one attempt (its
status lists them), and every array item must succeed, with no more attempts ended over the
run than items (the pool's `e31_attempts_ended_total`, read from `/metrics` before and after).

CPU per job, read just before the timer starts and once the last job has settled, divided by
N (`cpu_ms_per_job`, in ms): for each process found under a side's roots in /proc (through
psutil), its own CPU (user + system, from its CPU-time clock, exact where /proc's 10 ms ticks
would read a smoke run's few milliseconds as 0) and that of the children it reaped (/proc):

- bare Celery: `workers`, the worker processes themselves; `children`, the children they
  reaped (the `python3 -c pass` of each task); `sender`, this script, which sends the tasks
  and polls their count (getrusage).
- E31: each process of the stack by its part (`bench/stack.py`'s roles: api, scheduler,
  worker, launcher, up, zygote, as bench/profile_job_path.py reports them), `control_path`,
  the sum of those that carry a job to its run (api, scheduler, worker, launcher, up), and
  `client`, this script. The jobs' own processes (bubblewrap, the job's child, the warm
  zygote's forks) are not in the control path: `job_children_cpu_ms_per_job` gives them.

Prints jobs/s and CPU per job for each side and the ratios E31 / Celery (docs/performance.md,
"Dispatch and the control path"); `--out FILE` writes the same JSON.
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
from prometheus_client.parser import text_string_to_metric_families

from e31.client import Client
from e31.local.redisserver import start_redis
from e31.local.stack import metrics_token_path

from report import parse, save
from stack import (
    CONTROL_PATH,
    JOB_REAPERS,
    celery_workers_ready,
    cpu_s,
    own_cpu_s,
    private_stack,
    submit_all,
)

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
# After the last completion, before the CPU is read again: a duplicate Celery run would show
# by now, and the warm zygote has reaped its last fork (it reaps once a second).
SETTLE_S = 1.5

E31_JOBS = {"command": {"command": CHILD, "resources": {"gpus": 0}},
            "entrypoint": {"entrypoint": "e31_worker.examples:hello", "resources": {"gpus": 0}}}
E31_KINDS = (*E31_JOBS, "array")   # the array's items are entrypoint jobs
ATTEMPTS_ENDED = "e31_attempts_ended_total"


def ms_per_job(before: float, after: float, n: int) -> float:
    """CPU milliseconds per job from two readings of CPU seconds around `n` jobs."""
    return round(1000 * (after - before) / n, 2)


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
        pids = [p.pid for p in procs]
        for task in tasks:
            r.delete("bare:ids", "bare:runs")
            before = workers_cpu_s(pids)
            start = time.monotonic()
            with app.producer_or_acquire() as producer:
                for _ in range(n):
                    app.send_task(task, queue="bare", producer=producer)
            while int(r.get("bare:runs") or 0) < n:
                time.sleep(0.01)
            elapsed = time.monotonic() - start
            time.sleep(SETTLE_S)
            after = workers_cpu_s(pids)
            runs, ids = int(r.get("bare:runs") or 0), r.scard("bare:ids")
            out[task] = {"s": round(elapsed, 2), "jobs_per_s": round(n / elapsed, 1),
                         "runs": runs, "distinct": ids, "lost": n - ids, "run_twice": runs - ids,
                         "cpu_ms_per_job": {k: ms_per_job(before[k], after[k], n)
                                            for k in ("workers", "children", "sender")}}
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=60)
    return out


def workers_cpu_s(pids: list[int]) -> dict[str, float]:
    """CPU seconds so far of the bare Celery workers `pids` (with any child still running),
    of the children they reaped, and of this script, which sends."""
    own, reaped = cpu_s(pids, role_of=lambda _cmd: "workers")
    return {"workers": own["workers"], "children": reaped["workers"], "sender": own_cpu_s()}


def e31(n: int, workers: int, url: str, tmp: Path, kinds: list[str]) -> dict[str, Any]:
    """`n` jobs of each kind through one `e31 up` stack on `url`: wall seconds, checks, and
    the CPU per job of each process of the stack."""
    out: dict[str, Any] = {}
    home = tmp / "e31home"
    with private_stack(home, ["--cpu-slots", str(workers)], redis_url=url) as client:
        up_pid = json.loads((home / "stack.json").read_text())["pid"]
        scrape = {"Authorization": f"Bearer {metrics_token_path(home).read_text().strip()}"}
        for kind in kinds:
            run_e31(client, kind, 2 * workers)   # warm-up
            time.sleep(SETTLE_S)
            attempts = attempts_ended(client, scrape)
            before = stack_cpu_s(up_pid)
            start = time.monotonic()
            checks = run_e31(client, kind, n)
            elapsed = time.monotonic() - start
            time.sleep(SETTLE_S)
            after = stack_cpu_s(up_pid)
            attempts = attempts_ended(client, scrape) - attempts
            cpu = {name: ms_per_job(before.get(name, 0.0), after[name], n)
                   for name in sorted(after)}
            children = cpu.pop("job_children")
            cpu["control_path"] = round(sum(cpu.get(name, 0.0) for name in CONTROL_PATH), 2)
            out[kind] = {"s": round(elapsed, 2), "jobs_per_s": round(n / elapsed, 1), **checks,
                         "attempts_ended": attempts,
                         "lost_or_rerun": n - checks["succeeded"] + max(0, attempts - n),
                         "cpu_ms_per_job": cpu, "job_children_cpu_ms_per_job": children}
    return out


def stack_cpu_s(up_pid: int) -> dict[str, float]:
    """CPU seconds so far of each process of the stack under `up_pid` by its part, of the
    jobs' own processes (`job_children`: those the workers and zygotes reaped), and of this
    script (`client`)."""
    own, reaped = cpu_s([up_pid])
    return {**own, "job_children": sum(reaped[name] for name in JOB_REAPERS),
            "client": own_cpu_s()}


def run_e31(client: Client, kind: str, n: int) -> dict[str, int]:
    """`n` jobs of `kind`, each followed to its end as a user would: a job at a time, or the
    array as a whole. How many succeeded, and of single jobs how many in one attempt."""
    if kind == "array":
        array = client.submit_many([{} for _ in range(n)], name="dispatch",
                                   **E31_JOBS["entrypoint"])
        items = array.wait()["items"]
        return {"succeeded": sum(1 for item in items if item["state"] == "succeeded")}
    handles = submit_all(client, [E31_JOBS[kind]] * n)
    with ThreadPoolExecutor(8) as pool:
        finals = list(pool.map(lambda h: h.wait(), handles))
    succeeded = [st for st in finals if st["state"] == "succeeded"]
    return {"succeeded": len(succeeded),
            "succeeded_in_one_attempt": sum(1 for st in succeeded if len(st["attempts"]) == 1)}


def attempts_ended(client: Client, headers: dict[str, str]) -> int:
    """Attempts the pool has ended so far, of every class and reason, from its `/metrics`
    (`headers` carry the metrics token that `e31 up` wrote into its home)."""
    text = client.request("GET", "/metrics", headers=headers).text
    return int(sum(sample.value for family in text_string_to_metric_families(text)
                   for sample in family.samples if sample.name == ATTEMPTS_ENDED))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=300)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--e31-kinds", default=",".join(E31_KINDS),
                    help="which E31 jobs to run, comma-separated: command, entrypoint, array "
                         "(entrypoint jobs as the items of one array)")
    args = parse(ap, SMOKE)
    kinds = args.e31_kinds.split(",")
    if unknown := set(kinds) - set(E31_KINDS):
        ap.error(f"--e31-kinds: unknown {', '.join(sorted(unknown))}")
    tmp = Path(tempfile.mkdtemp(prefix="e31-bench-"))
    redis_proc, url = start_redis(tmp / "redis")
    try:
        bare = bare_celery(args.jobs, args.workers, url, tmp, ["bare.noop", "bare.run"])
        noop, child = bare["bare.noop"], bare["bare.run"]
        ours = e31(args.jobs, args.workers, url, tmp, kinds)
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
        "ratio_e31_array_over_celery_noop": round(
            ours["array"]["jobs_per_s"] / noop["jobs_per_s"], 3) if "array" in ours else None,
    }
    save(args, report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
