"""The API fuzzed for longer than CI does: schemathesis with every check, as each kind of caller;
on demand, not in CI.

    python bench/fuzz_api.py --minutes 10            # split between the callers below
    python bench/fuzz_api.py --minutes 2 --callers tenant,admin
    python bench/fuzz_api.py --smoke --out fuzz.json   # the suite's run: 9 s as a tenant

Starts a private redis-server and `e31 api` over a fresh SQLite store (the same helpers as
tests/integration/test_api_fuzz.py: a tenant, another tenant, an admin, a revoked token and no
token), gives each caller its share of the time (`SHARE`) with every phase and
`--examples` examples per operation, and prints per caller: operations tested, test cases
generated, failures, and the seed; the exit status is 1 if any run found a failure. The
figures of the last run are in docs/security.md ("Fuzzing the API"). `--out FILE` writes
them as JSON.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e31.edge.settings import Settings
from e31.local.redisserver import free_port
from e31.store import Repo
from e31.store.db import make_engine
from e31.store.migrate import upgrade
from tests.integration.test_api_fuzz import (
    caller_tokens,
    running_api,
    schemathesis_run,
)

from report import parse, save

# Each caller's share of the time: the tenant and the admin reach the most code.
SHARE = {"tenant": 0.3, "other tenant": 0.1, "revoked": 0.05, "none": 0.1, "admin": 0.45}
FIGURES = {"tested": r"Tested: (\d+)", "generated": r"(\d+) generated",
           "failures": r"(\d+) failures?", "seed": r"Seed: (\d+)"}
# 9 s of fuzzing: schemathesis spends the first seconds loading the document, and with 3 s on
# a loaded machine it tested nothing (a full suite beside four test runs)
SMOKE = {"minutes": 0.15, "examples": 2, "callers": "tenant"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--examples", type=int, default=200, help="examples per operation")
    ap.add_argument("--callers", default=",".join(SHARE))
    args = parse(ap, SMOKE)
    callers_seen: dict[str, dict[str, int]] = {}
    callers = [c for c in args.callers.split(",") if c]
    total = sum(SHARE[c] for c in callers)
    tmp = Path(tempfile.mkdtemp(prefix="e31-fuzz-"))
    port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(port), "--save", "",
                              "--appendonly", "no"], stdout=subprocess.DEVNULL)
    failed = False
    try:
        engine = make_engine(f"sqlite:///{tmp / 'e31.db'}")
        upgrade(engine)
        repo = Repo(engine, half_life_s=Settings().fair_share_half_life_s)
        tokens = caller_tokens(repo)
        with running_api(repo, f"redis://127.0.0.1:{port}/0", tmp) as base:
            print(f"{'caller':<13} {'seconds':>7} {'tested':>6} {'cases':>7} {'failures':>8}  seed")
            for who in callers:
                seconds = int(args.minutes * 60 * SHARE[who] / total)
                run = schemathesis_run(base, tokens[who], max_time_s=seconds, cwd=tmp,
                                       examples=args.examples)
                report = run.stdout + run.stderr
                got = {k: (m.group(1) if (m := re.search(p, report)) else "0")
                       for k, p in FIGURES.items()}
                callers_seen[who] = {"seconds": seconds, "exit_status": run.returncode,
                                          **{k: int(v) for k, v in got.items()}}
                print(f"{who:<13} {seconds:>7} {got['tested']:>6} {got['generated']:>7} "
                      f"{got['failures']:>8}  {got['seed']}", flush=True)
                if run.returncode != 0:
                    failed = True
                    (tmp / f"report-{who.replace(' ', '-')}.txt").write_text(report)
        if failed:
            print(f"failures: the reports are in {tmp}")
    finally:
        redis.terminate()
        redis.wait()
    save(args, {"minutes": args.minutes, "examples": args.examples, "callers": callers_seen})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
