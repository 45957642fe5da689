"""A burst of short jobs through a real `e31 up` stack; on demand, not in CI.

    python bench/burst.py --jobs 300 --cpu-slots 2 --simulate-gpus 2x24
    python bench/burst.py --smoke --out burst.json   # the test suite's run (tests/bench): 8 jobs

Starts a private stack (its own Redis, SQLite unless E31_DATABASE_URL is set), submits
`--jobs` trivial entrypoint jobs at once (half cpu, half gpu24 when GPUs are simulated),
waits for all, and prints: jobs by final state, wall time, jobs/s, queue wait p50/p99, and
whether any process logged "database is locked" (the store must never say it). `--out FILE`
writes the same figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from e31_worker.node.gpus import parse_simulated

from report import parse, save
from stack import private_stack, submit_all, wait_all

SMOKE = {"jobs": 8, "cpu_slots": 1, "simulate_gpus": "1x24"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=300)
    ap.add_argument("--cpu-slots", type=int, default=2)
    ap.add_argument("--simulate-gpus", default="2x24")
    args = parse(ap, SMOKE)

    home = Path(tempfile.mkdtemp(prefix="e31-burst-"))
    up_args = ["--cpu-slots", str(args.cpu_slots), "--simulate-gpus", args.simulate_gpus]
    with private_stack(home, up_args) as client:
        started = time.monotonic()
        specs = [{"entrypoint": "e31_worker.examples:sleep", "params": {"seconds": 0.0, "steps": 1},
                  "resources": {"gpus": 0 if i % 2 or not args.simulate_gpus else 1}}
                 for i in range(args.jobs)]
        handles = submit_all(client, specs)
        submitted = time.monotonic() - started
        finals = wait_all(handles, poll_s=1.0)
        wall = time.monotonic() - started
        states: dict[str, int] = {}
        for st in finals:
            states[st["state"]] = states.get(st["state"], 0) + 1
        waits = sorted(st["queued_seconds"] for st in finals)
        locked = [p.name for p in (home / "logs").glob("*.log")
                  if "database is locked" in p.read_text()]
        report = {
            "jobs": args.jobs, "states": states, "submit_s": round(submitted, 2),
            "wall_s": round(wall, 2), "jobs_per_s": round(args.jobs / wall, 2),
            "queue_wait_p50_s": round(statistics.median(waits), 2),
            "queue_wait_p99_s": round(waits[int(0.99 * (len(waits) - 1))], 2),
            "workers": args.cpu_slots
            + len(parse_simulated(args.simulate_gpus) if args.simulate_gpus else []),
            "database_is_locked_in": locked,
            "attempts_per_job_max": max(len(st["attempts"]) for st in finals),
        }
        save(args, report)
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
