"""A private `e31 up` stack for the bench scripts: its own home, ports and Redis; and the
CPU its processes spent, by the part of the stack each one is."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from e31.client import Client, JobHandle
from e31.core.states import FINAL_STATES
from e31.local.redisserver import free_port
from e31.local.state import stack_ready

UP_SHOWN_CHARS = 4_000   # the end of `e31 up`'s output when it fails to start

# The processes of an `e31 up` stack by their command lines. Any other under it (a job's
# bubblewrap and child, slirp4netns) is the job's own: it counts once reaped, in the CPU of
# its parent's children.
ROLES = (("api", re.compile(r"e31\.cli api\b")), ("scheduler", re.compile(r"e31\.cli scheduler")),
         ("worker", re.compile(r"e31_worker\.node\.celery_process")),
         ("launcher", re.compile(r"e31\.cli worker\b")), ("up", re.compile(r"e31\.cli up\b")),
         ("zygote", re.compile(r"e31_worker\.child\.zygote")),   # the warm start's fork server
         ("spawner", re.compile(r"e31_worker\.child\.spawner")))  # forks the cold children
# What carries a job to its run: the spawner's forks were the worker process's own before it.
CONTROL_PATH = ("api", "scheduler", "worker", "spawner", "launcher", "up")
JOB_REAPERS = ("worker", "zygote", "spawner")   # their reaped children are the jobs' own
CPUCLOCK_SCHED = 2   # Linux's CPU-time clock of a process, in ns (include/linux/posix-timers.h)


@contextmanager
def private_stack(home: Path, up_args: Sequence[str], *, redis_url: str | None = None,
                  settings: dict[str, str] | None = None) -> Iterator[Client]:
    """`e31 up --no-flower UP_ARGS` under `home` (on `redis_url`, else its own Redis, and
    with `settings`, E31_* variables); yields a client of its default tenant."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("E31_")}
    env.update(E31_HOME=str(home), E31_API_PORT=str(free_port()), **(settings or {}))
    # A benchmark measures the pool, not its tenant's submit rate (docs/configuration.md,
    # "Limits per tenant"): single jobs submitted in a burst would otherwise meet 429.
    env.setdefault("E31_TENANT_SUBMIT_RATE_PER_S", "1000000")
    if redis_url:
        env["E31_REDIS_URL"] = redis_url
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "up.out", "wb") as out:
        up = subprocess.Popen([sys.executable, "-m", "e31.cli", "up", "--no-flower", *up_args],
                              env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        while not stack_ready(home):
            if up.poll() is not None:
                sys.exit(f"e31 up failed:\n{(home / 'up.out').read_text()[-UP_SHOWN_CHARS:]}")
            time.sleep(0.2)
        profile = json.loads((home / "profile.json").read_text())
        yield Client(profile["url"], profile["token"])
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=120)


def role(cmd: str) -> str:
    """Which process of a stack the command line `cmd` is (ROLES); `other` when none."""
    return next((name for name, pat in ROLES if pat.search(cmd)), "other")


def cpu_s(roots: Iterable[int], role_of: Callable[[str], str] = role,
          ) -> tuple[defaultdict[str, float], defaultdict[str, float]]:
    """CPU seconds so far of the processes `roots` and their descendants by `role_of` their
    command line (`process_cpu_s`), and of the children each of them reaped (read from /proc
    through psutil), by the same role. A process of role `other` is left out while it lives,
    so that it counts once: when reaped, in its parent's children."""
    own: defaultdict[str, float] = defaultdict(float)
    reaped: defaultdict[str, float] = defaultdict(float)
    for pid in roots:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for p in procs:
            try:
                name = role_of(" ".join(p.cmdline()))
                if name == "other":
                    continue
                t = p.cpu_times()
                used_s = process_cpu_s(p.pid)
            except (psutil.Error, OSError):   # gone, or a zombie not yet reaped
                continue
            own[name] += used_s
            reaped[name] += t.children_user + t.children_system
    return own, reaped


def process_cpu_s(pid: int) -> float:
    """CPU seconds so far (user + system, every thread, ended ones too) of the live process
    `pid`, to the nanosecond: its CPU-time clock, whose id is made as glibc's
    clock_getcpuclockid(3) makes it. /proc/PID/stat gives the same total in 10 ms ticks: a
    process that spent 6 ms over a four-job window reads there as 0 or 10. OSError once it
    has ended."""
    return time.clock_gettime_ns((~pid << 3) | CPUCLOCK_SCHED) / 1e9


def own_cpu_s() -> float:
    """The CPU seconds so far (user + system, every thread) of this process: the client."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def celery_workers_ready(app: Any, count: int, timeout_s: float = 60.0) -> None:
    """Wait until `count` bare Celery workers of `app` answer a ping (connected, consuming),
    so that a timer started next measures the work, not their start."""
    deadline = time.monotonic() + timeout_s
    while len(app.control.ping(timeout=0.5)) < count:
        if time.monotonic() > deadline:
            sys.exit(f"{count} Celery workers did not answer within {timeout_s:g} s")


def submit_all(client: Client, specs: Sequence[dict[str, Any]]) -> list[JobHandle]:
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda s: client.submit(s), specs))


def wait_all(handles: Sequence[JobHandle], poll_s: float = 0.5) -> list[dict[str, Any]]:
    """The final status of every job."""
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda h: next(st for st in h.watch(poll_s=poll_s)
                                             if st["state"] in FINAL_STATES), handles))


def job_context(root: Path) -> Any:
    """A `JobContext` on fresh directories under `root`, for running a workload's entrypoint
    in this process as its worker would (the in-process side of a workload benchmark)."""
    from e31_worker.child.context import JobContext
    dirs = {name: root / name for name in ("output", "checkpoints", "work")}
    for d in dirs.values():
        d.mkdir(parents=True)
    return JobContext(job_id="bench", attempt=1, params={}, output_dir=dirs["output"],
                      checkpoint_dir=dirs["checkpoints"], work_dir=dirs["work"],
                      progress_path=root / "progress.json", gpus="")
