"""What a cold child's fork costs the worker: `Popen` with a `preexec_fn`, or the spawner.

    python bench/cold_fork.py                       # 200 children each way, 2 rounds
    python bench/cold_fork.py --torch               # the same in a process holding torch
    python bench/cold_fork.py --smoke --out fork.json   # the suite's run: 10 children

In this process, after the imports a worker process makes (`e31_worker.node.celery_process`,
and torch with `--torch`), each round starts `--children` children `true` the old way
(`subprocess.Popen(..., preexec_fn=child_setup(...))`: a full fork of this process, since a
`preexec_fn` rules vfork out) and then the same through a `Spawner`
(`e31_worker.attempt.spawn`), and waits for each. Per child, for each way: this process's CPU
(`time.process_time`), the spawner's own CPU (user + system from /proc, its children's not
counted), and the wall time from the start to the child's end. A ratio of the two ways in
one run, never a limit (docs/performance.md, "A cold child's fork").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from report import parse, save

SMOKE = {"children": 10, "rounds": 1}


def spawner_cpu_s(pid: int) -> float:
    """A process's own CPU seconds so far (utime + stime), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_way(children: int, start: Any, spawner_pid: int | None) -> dict[str, float]:
    """Start and wait for `children` children with `start`; CPU and wall ms per child."""
    spawner_before = spawner_cpu_s(spawner_pid) if spawner_pid else 0.0
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(children):
        child = start()
        assert child.stdout is not None
        child.stdout.read()
        if child.wait() != 0:
            raise SystemExit(f"a child failed: {child.returncode}")
        child.stdout.close()
        if hasattr(child, "close"):
            child.close()
    return {"worker_cpu_ms": (time.process_time() - cpu) / children * 1000,
            "spawner_cpu_ms": ((spawner_cpu_s(spawner_pid) - spawner_before) / children * 1000
                               if spawner_pid else 0.0),
            "wall_ms": (time.perf_counter() - wall) / children * 1000}


def measure(children: int, rounds: int, torch: bool) -> dict[str, Any]:
    import e31_worker.node.celery_process  # noqa: F401 - what a worker process holds
    if torch:
        import torch as _torch  # noqa: F401
    from e31_worker.attempt.spawn import Spawner
    from e31_worker.child.spawner import child_setup

    env, cwd = dict(os.environ), "/"
    spawner = Spawner()
    first = spawner.spawn(["true"], env, cwd=cwd)   # started before the clock runs
    if first is None:
        raise SystemExit("the spawner did not start")
    first.wait()
    first.close()

    def popen() -> Any:
        return subprocess.Popen(["true"], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=child_setup([], None))

    def spawned() -> Any:
        return spawner.spawn(["true"], env, cwd=cwd)

    runs = []
    try:
        for _ in range(rounds):
            runs.append({"popen": one_way(children, popen, None),
                         "spawner": one_way(children, spawned, spawner.pid)})
    finally:
        spawner.close()
    rss_kb = int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0])
    return {"children": children, "rounds": runs, "torch": "torch" in sys.modules,
            "worker_rss_mb": round(rss_kb / 1024, 1), "load": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--children", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--torch", action="store_true", help="import torch first, as a process "
                    "that holds it (a warm process) would")
    args = parse(ap, SMOKE)
    result = measure(args.children, args.rounds, args.torch)
    save(args, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
