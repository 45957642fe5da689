"""Where the CPU of a tiny job goes across the API, the scheduler and the worker; on demand.

    python bench/profile_job_path.py --jobs 200 --cpu-slots 2
    python bench/profile_job_path.py --smoke --out profile.json   # the suite's run: 4 jobs

A private `e31 up` stack (its own redis-server and SQLite store) runs `--jobs`
command jobs `python3 -c pass` (each in its own child, sandboxed as the pool is configured;
`--kind entrypoint`: `e31_worker.examples:hello` through the job runner instead),
submitted from 8 threads and followed with `JobHandle.wait()` from 8 threads, as a user
would; with `--array`, as the items of one array, one submit and one wait for the whole
(`--chain N` sets the stack's `array_chain_items`: 0 publishes every item). Before and
after the batch (after a warm-up batch, so start-up costs stay out) it
reads, for every process of the stack:

- CPU seconds (user + system, from each process's CPU-time clock; the processes found in
  /proc through psutil, `bench/stack.py`'s `cpu_s`), and the CPU of the children each reaped
  (the jobs themselves, on the worker processes and the warm zygote; /proc);
- SQL statements (a `before_cursor_execute` listener on every SQLAlchemy engine, by verb) and
  transactions (`commit` events);
- artifact-store calls by method (`e31.edge.artifacts.ArtifactStore`);

and for the whole run: Redis commands (`INFO commandstats` of the stack's redis-server, by
command), the HTTP requests the client sent (by method and route), and the client's own CPU.

The counters are installed by a `sitecustomize` module on the stack's PYTHONPATH, in the
stack's processes only (`e31.cli …` and `e31_worker.node…`), never in a job's child. Prints
a table per job, or JSON with `--json` (docs/performance.md, "Dispatch and the control path");
`--out FILE` also writes the JSON there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis

from e31.local.redisserver import start_redis

from report import parse, save
from stack import JOB_REAPERS, cpu_s, own_cpu_s, private_stack, role, submit_all

CHILD = ["python3", "-c", "pass"]
PROFILE_DIR_ENV = "PROFILE_JOB_PATH_DIR"   # not E31_*: private_stack drops those

SITECUSTOMIZE = r'''
import os


def _e31_profile():
    where = os.environ.get("PROFILE_JOB_PATH_DIR")
    if not where:
        return
    try:
        with open("/proc/self/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return
    if "e31.cli" not in cmd and "e31_worker.node" not in cmd:
        return
    import json, threading, time
    from collections import Counter
    from sqlalchemy import event
    from sqlalchemy.engine import Engine
    counts = {"sql": Counter(), "tx": 0, "artifacts": Counter(), "texts": Counter()}
    texts = os.environ.get("PROFILE_JOB_PATH_STATEMENTS") == "1"
    lock = threading.Lock()

    def on_sql(conn, cursor, statement, *rest):
        verb = statement.lstrip().split(None, 1)[0].upper() if statement.strip() else "?"
        with lock:
            counts["sql"][verb] += 1
            if texts:
                counts["texts"][" ".join(statement.split())[:110]] += 1

    def on_commit(conn):
        with lock:
            counts["tx"] += 1

    event.listen(Engine, "before_cursor_execute", on_sql)
    event.listen(Engine, "commit", on_commit)
    import e31.edge.artifacts as artifacts

    def counted(name, fn):
        def wrapper(*a, **k):
            with lock:
                counts["artifacts"][name] += 1
            return fn(*a, **k)
        return wrapper

    for name in ("put_file", "put_tree", "get_tree", "list_outputs", "log_sizes", "log_view",
                 "read_range", "footprint", "open_output", "remove_job"):
        setattr(artifacts.ArtifactStore, name,
                counted(name, getattr(artifacts.ArtifactStore, name)))
    path = os.path.join(where, f"{os.getpid()}.json")

    def dump():
        last = None
        while True:
            with lock:
                snap = json.dumps({"cmd": cmd, "sql": counts["sql"], "tx": counts["tx"],
                                   "artifacts": counts["artifacts"], "texts": counts["texts"]})
            if snap != last:
                with open(path + ".tmp", "w") as f:
                    f.write(snap)
                os.replace(path + ".tmp", path)
                last = snap
            time.sleep(0.1)

    threading.Thread(target=dump, name="profile-dump", daemon=True).start()


_e31_profile()
'''

ROUTE = re.compile(r"/j-[0-9a-f]{20}")


def snapshot(up_pid: int, prof_dir: Path, r: redis.Redis) -> dict[str, Any]:
    """CPU per role, SQL and artifact calls per role, Redis commands: now."""
    cpu, children = cpu_s([up_pid])
    sql: dict[str, Counter[str]] = {}
    texts: dict[str, Counter[str]] = {}
    tx: Counter[str] = Counter()
    arts: Counter[str] = Counter()
    for f in prof_dir.glob("*.json"):
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        name = role(data["cmd"])
        sql.setdefault(name, Counter()).update(data["sql"])
        texts.setdefault(name, Counter()).update(data.get("texts", {}))
        tx[name] += data["tx"]
        arts.update({f"{name}.{k}": v for k, v in data["artifacts"].items()})
    stats = r.info("commandstats")
    cmds = Counter({k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()})
    return {"cpu": cpu, "children": children, "sql": sql, "texts": texts, "tx": tx,
            "artifacts": arts,
            "redis": cmds, "self_cpu": own_cpu_s(), "t": time.monotonic()}


SMOKE = {"jobs": 4, "warmup": 2, "cpu_slots": 1}

JOBS = {"command": {"command": CHILD, "resources": {"gpus": 0}},
        "entrypoint": {"entrypoint": "e31_worker.examples:hello", "resources": {"gpus": 0}}}


def run_batch(client: Any, n: int, kind: str, array: bool = False) -> list[str]:
    """`n` jobs of `kind`, each submitted and waited for as a user would; with `array`, as the
    items of one array (one submit, one wait for the whole); their final states."""
    if array:
        status = client.submit_many([{} for _ in range(n)], name="profile",
                                    **JOBS[kind]).wait(timeout=3600)
        return [item["state"] for item in status["items"]]
    handles = submit_all(client, [JOBS[kind]] * n)
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda h: h.wait()["state"], handles))


def diff(before: dict[str, Any], after: dict[str, Any], http: Counter[str], n: int,
         ) -> dict[str, Any]:
    per = 1.0 / n
    roles = sorted(set(after["cpu"]) | set(after["sql"]))
    sql = {name: {k: v * per for k, v in (after["sql"].get(name, Counter())
                                          - before["sql"].get(name, Counter())).items()}
           for name in roles}
    redis_calls = after["redis"] - before["redis"]
    redis_calls.pop("info", None)
    return {
        "jobs": n,
        "wall_s": round(after["t"] - before["t"], 2),
        "cpu_ms_per_job": {name: round(1000 * (after["cpu"][name] - before["cpu"][name]) * per, 2)
                           for name in roles}
        | {"client": round(1000 * (after["self_cpu"] - before["self_cpu"]) * per, 2)},
        "job_children_cpu_ms_per_job": round(1000 * sum(
            after["children"][k] - before["children"][k] for k in JOB_REAPERS) * per, 2),
        "sql_per_job": {name: round(sum(v.values()), 2) for name, v in sql.items()},
        "sql_by_verb_per_job": {name: {k: round(v, 2) for k, v in sorted(verbs.items())}
                                for name, verbs in sql.items() if verbs},
        "statements_per_job": {
            name: {k: round(v * per, 2) for k, v in (after["texts"].get(name, Counter())
                                                     - before["texts"].get(name, Counter())
                                                     ).most_common()}
            for name in roles if after["texts"].get(name)},
        "transactions_per_job": {name: round((after["tx"][name] - before["tx"][name]) * per, 2)
                                 for name in roles},
        "artifact_calls_per_job": {k: round(v * per, 2) for k, v in
                                   sorted((after["artifacts"] - before["artifacts"]).items())},
        "redis_commands_per_job": round(sum(redis_calls.values()) * per, 2),
        "redis_by_command_per_job": {k: round(v * per, 2)
                                     for k, v in redis_calls.most_common()},
        "http_requests_per_job": round(sum(http.values()) * per, 2),
        "http_by_route_per_job": {k: round(v * per, 2) for k, v in http.most_common()},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--cpu-slots", type=int, default=2)
    ap.add_argument("--kind", choices=sorted(JOBS), default="command",
                    help="command: `python3 -c pass` in its own child (default); entrypoint: "
                         "e31_worker.examples:hello through the job runner (warm where the "
                         "worker has a warm start)")
    ap.add_argument("--array", action="store_true",
                    help="submit the batch (and the warm-up) as the items of one array")
    ap.add_argument("--chain", type=int, metavar="N",
                    help="the stack's array_chain_items (default: the setting's default)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--statements", action="store_true",
                    help="also count each SQL statement's text (its first 110 characters) by "
                         "process, and list them per job: what the store calls cost, by call")
    ap.add_argument("--plot", nargs=3, metavar=("BEFORE", "AFTER", "SVG"), type=Path,
                    help="run nothing: draw two --json results (medians if a path holds a "
                         "glob) as bars of CPU ms per job and process, into SVG")
    ap.add_argument("--py-spy", metavar="DIR", type=Path,
                    help="also sample the api, scheduler and worker processes with py-spy "
                         "(on PATH) during the batch: collapsed stacks in DIR/<role>-<pid>.txt")
    ap.add_argument("--py-spy-gil", action="store_true",
                    help="with --py-spy: sample only the thread holding the GIL (py-spy --gil), "
                         "so that the samples follow the process's Python CPU rather than its "
                         "threads' waits")
    args = parse(ap, SMOKE)
    if args.plot:
        before, after, out = args.plot
        out.write_text(svg_bars(medians(before), medians(after)))
        return
    tmp = Path(tempfile.mkdtemp(prefix="e31-profile-"))
    tmp.chmod(0o755)   # the site directory is on every job's PYTHONPATH: its uid reads it
    (tmp / "site").mkdir(mode=0o755)
    (tmp / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (tmp / "prof").mkdir()
    os.environ[PROFILE_DIR_ENV] = str(tmp / "prof")
    if args.statements:
        os.environ["PROFILE_JOB_PATH_STATEMENTS"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(tmp / "site"), os.environ.get("PYTHONPATH")) if p)
    redis_proc, url = start_redis(tmp / "redis")
    try:
        result = profile(args, tmp, url)
    finally:
        redis_proc.terminate()
        redis_proc.wait()
    save(args, result)
    print(json.dumps(result, indent=2) if args.json else table(result))


def profile(args: argparse.Namespace, tmp: Path, url: str) -> dict[str, Any]:
    http: Counter[str] = Counter()
    counting = threading.Event()
    lock = threading.Lock()

    def count(request: httpx.Request) -> None:
        if counting.is_set():
            with lock:
                http[f"{request.method} {ROUTE.sub('/{id}', request.url.path)}"] += 1

    r = redis.Redis.from_url(url)
    up_args = ["--cpu-slots", str(args.cpu_slots)]
    settings = {} if args.chain is None else {"E31_ARRAY_CHAIN_ITEMS": str(args.chain)}
    with private_stack(tmp / "home", up_args, redis_url=url, settings=settings) as client:
        client._http.event_hooks["request"].append(count)
        up_pid = json.loads((tmp / "home" / "stack.json").read_text())["pid"]
        warm = run_batch(client, args.warmup, args.kind, args.array)
        time.sleep(0.5)
        spies = start_spies(up_pid, args.py_spy, gil=args.py_spy_gil) if args.py_spy else []
        before = snapshot(up_pid, tmp / "prof", r)
        counting.set()
        states = run_batch(client, args.jobs, args.kind, args.array)
        counting.clear()
        for spy in spies:
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=60)
        time.sleep(0.5)   # the counters are written every 0.1 s
        after = snapshot(up_pid, tmp / "prof", r)
    lost = [s for s in warm + states if s != "succeeded"]
    if lost:
        raise SystemExit(f"not every job succeeded: {Counter(lost)}")
    return {"cpu_slots": args.cpu_slots, "database": "sqlite", "kind": args.kind,
            "array": args.array, "array_chain_items": args.chain,
            **diff(before, after, http, args.jobs)}


def start_spies(up_pid: int, out: Path, *, gil: bool = False) -> list[subprocess.Popen[bytes]]:
    out.mkdir(parents=True, exist_ok=True)
    spies = []
    for p in psutil.Process(up_pid).children(recursive=True):
        name = role(" ".join(p.cmdline()))
        if name in ("api", "scheduler", "worker"):
            spies.append(subprocess.Popen(
                ["py-spy", "record", "--pid", str(p.pid), "--format", "raw", "--rate", "250",
                 *(["--gil"] if gil else []),
                 "--nonblocking", "--output", str(out / f"{name}-{p.pid}.txt")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(1.0)   # attached
    return spies


PLOTTED = ("api", "scheduler", "worker", "spawner", "client")   # spawner: the cold forks


def medians(path: Path) -> dict[str, float]:
    """CPU ms per job and process: of one --json result, or the medians of those a glob names."""
    runs = [json.loads(p.read_text()) for p in sorted(Path(path.anchor or ".").glob(
        str(path.relative_to(path.anchor)) if path.is_absolute() else str(path)))]
    return {name: statistics.median(r["cpu_ms_per_job"].get(name, 0.0) for r in runs)
            for name in PLOTTED} | {"runs": len(runs)}


def svg_bars(before: dict[str, float], after: dict[str, float]) -> str:
    """Two bars per process (before grey, after blue) and the totals, as a small SVG."""
    rows = [*PLOTTED, "sum"]
    value = {"before": before | {"sum": sum(before[k] for k in PLOTTED)},
             "after": after | {"sum": sum(after[k] for k in PLOTTED)}}
    top = max(value["before"]["sum"], value["after"]["sum"])
    width, left, bar, gap = 640, 90, 14, 12
    scale = (width - left - 80) / top
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" '
             f'height="{40 + len(rows) * (2 * bar + gap) + 30}" font-family="sans-serif" '
             f'font-size="12">',
             f'<text x="{left}" y="18" font-weight="bold">CPU ms per tiny job, by process '
             f'(medians of {int(before["runs"])} and {int(after["runs"])} runs)</text>']
    y = 34
    for name in rows:
        parts.append(f'<text x="{left - 8}" y="{y + bar + 4}" text-anchor="end">{name}</text>')
        for kind, colour in (("before", "#9e9e9e"), ("after", "#1f77b4")):
            ms = value[kind][name]
            parts.append(f'<rect x="{left}" y="{y}" width="{ms * scale:.1f}" height="{bar - 2}" '
                         f'fill="{colour}"/><text x="{left + ms * scale + 4:.1f}" '
                         f'y="{y + bar - 4}">{ms:.1f}</text>')
            y += bar
        y += gap
    parts.append(f'<rect x="{left}" y="{y + 4}" width="10" height="10" fill="#9e9e9e"/>'
                 f'<text x="{left + 14}" y="{y + 13}">before</text>'
                 f'<rect x="{left + 70}" y="{y + 4}" width="10" height="10" fill="#1f77b4"/>'
                 f'<text x="{left + 84}" y="{y + 13}">after</text></svg>')
    return "\n".join(parts) + "\n"


def table(res: dict[str, Any]) -> str:
    lines = [f"{res['jobs']} {res['kind']} jobs on {res['cpu_slots']} cpu slots, "
             f"{res['database']}, {res['wall_s']} s ({res['jobs'] / res['wall_s']:.1f} jobs/s)", "",
             f"{'process':<10} {'CPU ms/job':>10} {'SQL/job':>8} {'tx/job':>7}"]
    for name, ms in res["cpu_ms_per_job"].items():
        lines.append(f"{name:<10} {ms:>10.2f} {res['sql_per_job'].get(name, 0):>8.2f} "
                     f"{res['transactions_per_job'].get(name, 0):>7.2f}")
    total = sum(res["cpu_ms_per_job"].values())
    lines += [f"{'total':<10} {total:>10.2f}",
              f"the jobs' own children: {res['job_children_cpu_ms_per_job']} ms/job", "",
              f"SQL by verb per job: {json.dumps(res['sql_by_verb_per_job'])}",
              f"artifact calls per job: {json.dumps(res['artifact_calls_per_job'])}",
              f"Redis commands per job: {res['redis_commands_per_job']} "
              f"{json.dumps(res['redis_by_command_per_job'])}",
              f"HTTP requests per job: {res['http_requests_per_job']} "
              f"{json.dumps(res['http_by_route_per_job'])}"]
    for name, stmts in res["statements_per_job"].items():
        lines += ["", f"SQL statements per job, {name}:"]
        lines += [f"  {n:6.2f}  {text}" for text, n in stmts.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
