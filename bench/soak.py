"""Soak: short jobs while a random worker is SIGKILLed every few seconds; on demand.

    python bench/soak.py --jobs 1000 --workers 4 --kill-every 3
    python bench/soak.py --smoke --out soak.json    # the test suite's run (tests/bench): seconds

`--smoke`: 6 jobs of 1 s on 2 workers, E31 only, a kill every 2 s and 2 at most, a 0.5 s
heartbeat and a 4 s lease so that a killed worker's job comes back in seconds.

The same run twice, on one private redis-server:

* E31 Batch: `e31 up --cpu-slots W` (its launcher restarts a killed worker, as a node's
  would), N entrypoint jobs through the API; a kill loop SIGKILLs the worker process of a
  random live heartbeat every `--kill-every` seconds until every job has ended.
* Bare Celery with `acks_late=True`, prefetch 1 (the careful configuration), the same task
  body on W `-P threads -c 1` workers that this script restarts when killed, the same kill
  loop. `--celery-visibility-s` sets Redis's visibility timeout (Celery's default is 3600 s;
  a killed worker's message is invisible that long).

Each job and task appends `start`/`done` lines to a trail file, so the script can count:
lost (never completed), completed more than once, and the recovery time of every job
whose worker was killed under it (the kill, to the next start of that job).

Under the pool's default isolation (`sandbox`) a job runs as its tenant's uid with only the
paths the sandbox binds: the job's module lives in a world-readable directory on the
workers' PYTHONPATH (never in the one holding the stack's home, which the sandbox hides),
and the trail in a 0777 directory the stack shares on purpose (`sandbox_writable_dirs`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from e31.core import keys
from e31.core.states import FINAL_STATES
from e31.local.redisserver import start_redis

from report import parse, save
from stack import celery_workers_ready, private_stack, submit_all

BENCH_DIR = Path(__file__).resolve().parent
TASK_BODY = '''
import os, time
def work(trail, job_id, seconds, attempt):
    with open(os.path.join(trail, job_id), "a") as f:
        f.write(f"start {time.time():.3f} {attempt} {os.getpid()}\\n")
    time.sleep(seconds)
    with open(os.path.join(trail, job_id), "a") as f:
        f.write(f"done {time.time():.3f} {attempt} {os.getpid()}\\n")
'''

SOAK_JOB = TASK_BODY + '''

def run(ctx, trail, seconds):
    work(trail, ctx.job_id, seconds, ctx.attempt)
    return {"attempt": ctx.attempt}
'''

CELERY_APP = TASK_BODY + '''
import sys
from celery import Celery
app = Celery("soak", broker=sys.argv[1])
app.conf.update(task_acks_late=True, worker_prefetch_multiplier=1, accept_content=["json"],
                task_serializer="json", task_ignore_result=True,
                broker_transport_options={"visibility_timeout": int(sys.argv[3])})

@app.task(name="soak.run", bind=True)
def run(self, trail, job_id, seconds):
    work(trail, job_id, seconds, self.request.retries + 1)

if __name__ == "__main__":
    app.worker_main(["worker", "-P", "threads", "-c", "1", "-n", sys.argv[2], "-Q", "soak",
                     "--without-gossip", "--without-mingle", "-l", "WARNING"])
'''


NODE_REBOOT_S = 3.0   # `--kill node`: a killed node's launcher starts again this much later


@dataclass(frozen=True)
class Kill:
    at: float            # time.time() of the SIGKILL
    pid: int             # the worker process killed (a node: its launcher, its group)
    job: str | None      # the job it was running, when its heartbeat said (E31)


class Nodes:
    """`--kill node`: whole nodes beside the stack's own, each an `e31 worker --cpu-slots 1
    --hostname soak-nK` launcher in its own session (its worker process and its job's
    processes with it), SIGKILLed as a group, as a host that loses power, and started again
    after `NODE_REBOOT_S`, as the host would come back; the job must meanwhile run elsewhere."""

    def __init__(self, home: Path, redis_url: str, settings: dict[str, str]) -> None:
        self._env = {k: v for k, v in os.environ.items() if not k.startswith("E31_")}
        self._env.update(E31_HOME=str(home), E31_REDIS_URL=redis_url, **settings)
        self._home = home
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._halt = threading.Event()
        self._keeper = threading.Thread(target=self._keep, daemon=True)

    def start(self, count: int) -> None:
        for k in range(count):
            self._spawn(f"soak-n{k}")
        self._keeper.start()

    def _spawn(self, host: str) -> None:
        with open(self._home / f"node-{host}.log", "ab") as out:
            self._procs[host] = subprocess.Popen(
                [sys.executable, "-m", "e31.cli", "worker", "--cpu-slots", "1", "--hostname", host],
                env=self._env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def _keep(self) -> None:
        while not self._halt.wait(NODE_REBOOT_S):
            for host, proc in list(self._procs.items()):
                if proc.poll() is not None and not self._halt.is_set():
                    self._spawn(host)

    def pick(self, r: redis.Redis) -> Callable[[], tuple[int, str | None] | None]:
        """A live node to kill, a busy one first: (its launcher's pid, its job)."""
        def choose() -> tuple[int, str | None] | None:
            live = {h: p for h, p in self._procs.items() if p.poll() is None}
            if not live:
                return None
            busy = {}
            for host in live:
                raw = r.get(keys.worker(f"cpu0@{host}"))
                if raw and (job := json.loads(raw).get("busy_job")):
                    busy[host] = job
            host = random.choice(sorted(busy) or sorted(live))
            return -live[host].pid, busy.get(host)   # a negative pid: the whole group
        return choose

    def stop(self) -> None:
        self._halt.set()
        self._keeper.join()
        for proc in self._procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self._procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


class Killer(threading.Thread):
    """SIGKILLs `pick()`'s (pid, job) every `every_s` seconds until stopped; keeps the kills."""

    def __init__(self, pick: Callable[[], tuple[int, str | None] | None], every_s: float,
                 seed: int, kills_max: int | None = None) -> None:
        super().__init__(daemon=True)
        self._pick, self._every_s, self._kills_max = pick, every_s, kills_max
        self._halt = threading.Event()
        self.kills: list[Kill] = []
        random.seed(seed)

    def run(self) -> None:
        while not self._halt.wait(self._every_s):
            if self._kills_max is not None and len(self.kills) >= self._kills_max:
                return
            target = self._pick()
            if target is None:
                continue
            try:   # a negative pid is a whole process group (a node, `--kill node`)
                if target[0] < 0:
                    os.killpg(-target[0], signal.SIGKILL)
                else:
                    os.kill(target[0], signal.SIGKILL)
                self.kills.append(Kill(time.time(), abs(target[0]), target[1]))
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        self._halt.set()
        self.join()


def _is_worker(pid: int) -> bool:
    try:
        return b"e31_worker.node.celery_process" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def read_trail(trail: Path) -> dict[str, list[tuple[str, float, int]]]:
    """Per job: (event, time, pid of the process that ran it) in file order."""
    events: dict[str, list[tuple[str, float, int]]] = defaultdict(list)
    for path in trail.iterdir():
        for line in path.read_text().splitlines():
            kind, ts, _attempt, pid = line.split()
            events[path.name].append((kind, float(ts), int(pid)))
    return events


def _overlap(path: Path) -> bool:
    """Whether two of a job's completed runs (by attempt, from its trail file) overlapped in
    time: one started before another had done."""
    runs: dict[str, dict[str, float]] = defaultdict(dict)
    for line in path.read_text().splitlines():
        kind, ts, attempt, _pid = line.split()
        runs[attempt][kind] = float(ts)
    done = sorted((r["start"], r["done"]) for r in runs.values() if {"start", "done"} <= set(r))
    return any(b[0] < a[1] for a, b in zip(done, done[1:], strict=False))


def tally(ids: list[str], trail: Path, kills: list[Kill]) -> dict[str, Any]:
    """Lost, completed more than once, and recovery times (the kill of the worker running
    a job, to that job's next start) from the trail files and the kills."""
    events = read_trail(trail)
    lost = [i for i in ids if not any(k == "done" for k, _, _ in events.get(i, []))]
    twice = [i for i in ids if sum(k == "done" for k, _, _ in events.get(i, [])) > 1]
    # Two runs of one job at the same time: what fencing must never allow. A job completed
    # twice one after the other is a node that died after the job's code returned and before
    # its outcome was stored (with its files: `--kill node`); a worker process's successor
    # records such an outcome instead (`--kill worker`: none).
    at_once = [i for i in twice if _overlap(trail / i)]
    recoveries = []
    for i in ids:
        starts = sorted((t, pid) for k, t, pid in events.get(i, []) if k == "start")
        for (before, pid), (after, _) in zip(starts, starts[1:], strict=False):
            # E31: the heartbeat named the job; bare Celery: the task ran in the worker's pid
            hit = [k for k in kills if before <= k.at <= after and (k.job == i or k.pid == pid)]
            if hit:
                recoveries.append(after - hit[0].at)
    recoveries.sort()

    def pct(p: float) -> float | None:
        return round(recoveries[min(len(recoveries) - 1, int(p * len(recoveries)))], 2) \
            if recoveries else None

    return {"jobs": len(ids), "kills": len(kills),
            "kills_of_busy_workers": sum(k.job is not None for k in kills),
            "lost": len(lost), "completed_more_than_once": len(twice),
            "ran_twice_at_once": len(at_once),
            "interrupted_and_rerun": len(recoveries),
            "recovery_s_p50": pct(0.5), "recovery_s_p99": pct(0.99),
            "recovery_s_max": round(recoveries[-1], 2) if recoveries else None}


def shared_dir(path: Path, mode: int) -> Path:
    """`path`, made with `mode` whatever the umask: what a sandboxed job's uid may use."""
    path.mkdir()
    path.chmod(mode)
    return path


def soak_e31(args: argparse.Namespace, url: str, tmp: Path) -> dict[str, Any]:
    # The job's uid reads its module and writes its trail; the sandbox binds the module's
    # directory (on PYTHONPATH) and the trail (sandbox_writable_dirs), never `tmp` itself,
    # which holds the stack's home.
    trail = shared_dir(tmp / "e31-trail", 0o777)
    code = shared_dir(tmp / "jobs", 0o755)
    (code / "soakjob.py").write_text(SOAK_JOB)
    (code / "soakjob.py").chmod(0o644)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")])
    settings = {"E31_SANDBOX_WRITABLE_DIRS": str(trail)}
    if args.heartbeat_interval_s is not None:
        settings["E31_HEARTBEAT_INTERVAL_S"] = str(args.heartbeat_interval_s)
    if args.lease_ttl_s is not None:
        settings["E31_LEASE_TTL_S"] = str(args.lease_ttl_s)
    r = redis.Redis.from_url(url)

    def pick() -> int | None:
        beats = [json.loads(v) for k in r.scan_iter(match=keys.worker_pattern())
                 if (v := r.get(k))]
        # A heartbeat can outlive its process by a few seconds, and its pid may already be
        # a job's: kill only a live worker process.
        beats = [b for b in beats if _is_worker(b["pid"])]
        busy = [b for b in beats if b.get("busy_job")]
        if not beats:
            return None
        chosen = random.choice(busy or beats)
        return chosen["pid"], chosen.get("busy_job")

    nodes = Nodes(tmp / "e31home", url, settings) if args.kill == "node" else None
    stack_slots = 1 if nodes is not None else args.workers
    with private_stack(tmp / "e31home", ["--cpu-slots", str(stack_slots)],
                       redis_url=url, settings=settings) as client:
        if nodes is not None:   # the stack's own node plus workers - 1 that may be killed
            nodes.start(args.workers - 1)
            pick = nodes.pick(r)
        specs = [{"entrypoint": "soakjob:run", "resources": {"gpus": 0},
                  "retries": {"max": 0, "max_lost": 10},
                  "params": {"trail": str(trail), "seconds": args.job_s}}] * args.jobs
        start = time.monotonic()
        handles = submit_all(client, specs)
        killer = Killer(pick, args.kill_every, args.seed, args.kills_max)
        killer.start()
        final: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + args.max_wait_s
        while len(final) < len(handles) and time.monotonic() < deadline:
            for h in handles:
                if h.id not in final and (st := h.status())["state"] in FINAL_STATES:
                    final[h.id] = st
            time.sleep(1)
        killer.stop()
        elapsed = time.monotonic() - start
        if nodes is not None:
            nodes.stop()
    result = tally([h.id for h in handles], trail, killer.kills)
    states = defaultdict(int)
    for st in final.values():
        states[st["state"]] += 1
    lost_attempts = sum(a["reason"] == "lost" for st in final.values() for a in st["attempts"])
    result.update(elapsed_s=round(elapsed, 1), states=dict(states),
                  not_final=len(handles) - len(final), lost_attempts_recorded=lost_attempts,
                  succeeded_recorded_more_than_once=0)  # one row per job: at most one success
    return result


def soak_celery(args: argparse.Namespace, url: str, tmp: Path) -> dict[str, Any]:
    trail = shared_dir(tmp / "celery-trail", 0o755)   # bare Celery runs as this user
    script = tmp / "soak_celery.py"
    script.write_text(CELERY_APP)
    env = dict(os.environ, PYTHONPATH=str(tmp))
    procs: dict[str, subprocess.Popen[bytes]] = {}
    stop = threading.Event()

    def spawn(name: str) -> None:
        procs[name] = subprocess.Popen(
            [sys.executable, str(script), url, name, str(args.celery_visibility_s)], env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def supervise() -> None:  # restart killed workers, as a launcher or systemd would
        while not stop.wait(1.0):
            for name, proc in list(procs.items()):
                if proc.poll() is not None:
                    spawn(name)

    for i in range(args.workers):
        spawn(f"soak{i}@bench")
    threading.Thread(target=supervise, daemon=True).start()
    sys.path.insert(0, str(tmp))
    from celery import Celery
    app = Celery("soak", broker=url)
    app.conf.update(accept_content=["json"], task_serializer="json",
                    broker_transport_options={"visibility_timeout": args.celery_visibility_s})
    celery_workers_ready(app, args.workers)
    ids = [f"t{i:05d}" for i in range(args.jobs)]
    start = time.monotonic()
    for job_id in ids:
        app.send_task("soak.run", args=[str(trail), job_id, args.job_s], queue="soak")
    killer = Killer(lambda: (random.choice(list(procs.values())).pid, None), args.kill_every,
                    args.seed, args.kills_max)
    killer.start()

    def done() -> int:
        events = read_trail(trail)
        return sum(any(k == "done" for k, _, _ in events.get(i, [])) for i in ids)

    deadline = time.monotonic() + args.max_wait_s
    while done() < len(ids) and time.monotonic() < deadline:
        time.sleep(1)
    killer.stop()
    elapsed = time.monotonic() - start
    stop.set()
    for proc in procs.values():
        proc.send_signal(signal.SIGTERM)
    for proc in procs.values():
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    result = tally(ids, trail, killer.kills)
    result.update(elapsed_s=round(elapsed, 1), visibility_timeout_s=args.celery_visibility_s)
    return result


SMOKE = {"jobs": 6, "workers": 2, "job_s": 1.0, "kill_every": 2.0, "kills_max": 2,
         "heartbeat_interval_s": 0.5, "lease_ttl_s": 4.0, "max_wait_s": 100.0, "only": "e31"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--job-s", type=float, default=0.5, help="each job's work, seconds")
    ap.add_argument("--kill-every", type=float, default=3.0, help="seconds between SIGKILLs")
    ap.add_argument("--celery-visibility-s", type=int, default=60)
    ap.add_argument("--max-wait-s", type=float, default=900,
                    help="per run: stop waiting for the last jobs after this long")
    ap.add_argument("--kills-max", type=int, default=None, help="stop killing after this many")
    ap.add_argument("--heartbeat-interval-s", type=float, default=None,
                    help="E31's heartbeat interval (default: the pool's setting)")
    ap.add_argument("--lease-ttl-s", type=float, default=None,
                    help="E31's lease (default: the pool's setting)")
    ap.add_argument("--kill", choices=["worker", "node"], default="worker",
                    help="worker: a worker process, its launcher restarting it; node: a whole "
                         "node (launcher, worker, job), started again after a few seconds")
    ap.add_argument("--seed", type=int, default=31)
    ap.add_argument("--only", choices=["e31", "celery"], default=None)
    args = parse(ap, SMOKE)
    # SIGTERM unwinds like Ctrl-C, so the private stack and workers it started are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tmp = Path(tempfile.mkdtemp(prefix="e31-soak-"))
    tmp.chmod(0o755)   # mkdtemp's 0700 would keep the jobs' uid out of the shared dirs below
    redis_proc, url = start_redis(tmp / "redis")
    report: dict[str, Any] = {"args": vars(args)}
    try:
        if args.only in (None, "e31"):
            report["e31"] = soak_e31(args, url, tmp)
            save(args, report)
        if args.only in (None, "celery"):
            redis.Redis.from_url(url).flushall()
            report["bare_celery_acks_late"] = soak_celery(args, url, tmp)
            save(args, report)
    finally:
        redis_proc.terminate()
        redis_proc.wait()
    print(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
