"""Start latency of an attempt, warm and cold, and the memory of a worker; on demand, not in CI.

    python bench/start_latency.py --runs 20 --cold-runs 6
    python bench/start_latency.py --smoke --out start.json   # the suite's run (tests/bench)

Part 1, the worker directly: a `Supervisor` with this host's sandbox (as a sandboxed worker
runs it; `--isolation process` where there is none) and a warm process, running a plain job
and a job that imports torch at its top, warm and cold; for warm attempts also the CPU time
each one costs (its start, the tiny job and its end: this process and the warm process with
its reaped children), which the load of other processes does not change. (Not for cold ones:
a sandboxed cold job's processes are killed with their namespace, never reaped by their
parents, so their CPU time reaches no one's getrusage.)
Measured: from the moment the attempt starts (`Supervisor.run`, before its directories and
job file) to the first line of the job's function, which reports `time.monotonic()` (one
clock for both). Also shown: `start_ms`, what the worker records (to the runner's import of
the entrypoint).

Part 2, the embedded stack: `e31 up --cpu-slots 1` in a temporary home; `--stack-jobs` tiny
entrypoint jobs, and the `start` / `start_ms` their attempts recorded. Then the resident
memory (RSS and PSS, /proc/PID/smaps_rollup) of its idle worker process and its warm process,
and of a bare Celery worker (`celery -A tinyapp worker -P threads -c 1`) on the same Redis.
`--out FILE` writes both parts' figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from e31.core.records import Claim
from e31.core.spec import JobSpec
from e31.edge.settings import Settings
from e31_worker.attempt.plan import AttemptPlan, Directive
from e31_worker.attempt.sandbox import Sandbox, sandbox_unavailable
from e31_worker.attempt.supervisor import Supervisor
from e31_worker.attempt.warm import WarmStarter, warm_env

from report import parse, save
from stack import celery_workers_ready, private_stack, submit_all, wait_all

JOBS = {
    "plain": "import time\n\ndef main(ctx):\n    return time.monotonic()\n",
    "torch": "import time\nimport torch\n\ndef main(ctx):\n    return time.monotonic()\n",
}
TINY_CELERY_APP = (
    "import os\nfrom celery import Celery\n"
    "app = Celery('tinyapp', broker=os.environ['BENCH_BROKER'])\n"
    "@app.task\ndef noop():\n    return None\n")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def direct(runs: int, cold_runs: int, base: Path) -> list[dict[str, Any]]:
    """Part 1: the Supervisor with a WarmStarter, as a worker process runs attempts."""
    jobs = base / "jobs"
    jobs.mkdir(parents=True)
    base.chmod(0o755)
    for name, source in JOBS.items():
        (jobs / f"bench_{name}.py").write_text(source)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(jobs), os.environ.get("PYTHONPATH")) if p)
    home = base / "home"
    home.mkdir(mode=0o700)
    settings = Settings.load({"home": str(home)}, environ={})
    why = sandbox_unavailable(settings)
    sandbox = Sandbox.from_settings(settings) if why is None else None
    print(f"isolation: {'sandbox' if sandbox else 'process (' + str(why) + ')'}")
    warm = WarmStarter(env=warm_env(os.environ))
    began = time.monotonic()
    warm.start()
    if not warm.wait_ready(600):
        sys.exit("the warm process did not start")
    print(f"warm process ready in {time.monotonic() - began:.1f} s (imports torch, numpy)")
    rows = []
    n = 0
    try:
        for how, count in (("warm", runs), ("cold", cold_runs)):
            for job in JOBS:
                to_code, recorded = [], []
                cpu_before = cpu_seconds(warm.pid)
                for _ in range(count):
                    n += 1
                    spec = JobSpec.parse({"entrypoint": f"bench_{job}:main"})
                    plan = AttemptPlan(job_id=f"j-bench{n}", attempt=1, spec=spec, gpus="",
                                       root=settings.resolved_work_dir / f"j-bench{n}" / "a1",
                                       kill_grace_s=1, log_max_bytes=1 << 20,
                                       tick_interval_s=1)
                    claim = Claim(job_id=plan.job_id, tenant_id="t-bench", token=1, attempt=1,
                                  spec=spec, gpus=0)
                    starts: list[tuple[float, Any]] = []
                    t0 = time.monotonic()
                    outcome = Supervisor(
                        plan, tick=lambda _: Directive.CONTINUE,
                        sandbox=sandbox.for_attempt(claim) if sandbox else None,
                        on_start=lambda ms, start, s=starts: s.append((ms, start.value)),
                        warm=warm if how == "warm" else None).run()
                    if outcome.result is None:
                        sys.exit(f"{job} {how} failed: {outcome}: "
                                 f"{plan.log_path.read_text()[-2000:]}")
                    assert starts and starts[0][1] == how, starts
                    to_code.append((outcome.result - t0) * 1000)
                    recorded.append(starts[0][0])
                    shutil.rmtree(plan.root.parent, ignore_errors=True)
                time.sleep(1.5)   # the warm process reaps its children (and their CPU) each second
                cpu_ms = (cpu_seconds(warm.pid) - cpu_before) * 1000 / count
                rows.append({"job": job, "start": how, "runs": count,
                             "p50_ms": pct(to_code, 0.5), "p99_ms": pct(to_code, 0.99),
                             "recorded_p50_ms": pct(recorded, 0.5), "cpu_ms": cpu_ms})
                r = rows[-1]
                print(f"{job:6} {how:5} n={count:3}  to user code p50 {r['p50_ms']:8.1f} ms  "
                      f"p99 {r['p99_ms']:8.1f} ms   start_ms recorded p50 "
                      f"{r['recorded_p50_ms']:8.1f} ms" + (
                          f"   CPU per attempt {cpu_ms:7.1f} ms" if how == "warm" else ""),
                      flush=True)
    finally:
        warm.close()
    return rows


def svg_chart(rows: list[dict[str, Any]], path: Path, note: str) -> None:
    """A bar chart of the p50 (solid) and p99 (light) per job and start, on a log scale."""
    import math
    width, bar_h, left, top = 640, 22, 150, 30
    lo, hi = 10.0, max(r["p99_ms"] for r in rows) * 1.5
    x = lambda ms: left + (width - left - 20) * math.log10(max(ms, lo) / lo) / math.log10(hi / lo)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" '
           f'height="{top + len(rows) * (bar_h + 10) + 40}" font-family="sans-serif" '
           f'font-size="12">', f'<text x="10" y="18">attempt start to the job\'s first line '
           f'(ms, log scale; p50 solid, p99 light) — {note}</text>']
    for i, r in enumerate(rows):
        y = top + i * (bar_h + 10)
        color = "#2b7bb9" if r["start"] == "warm" else "#c0392b"
        out += [f'<text x="10" y="{y + 15}">{r["job"]} job, {r["start"]}</text>',
                f'<rect x="{left}" y="{y}" width="{x(r["p99_ms"]) - left:.1f}" '
                f'height="{bar_h}" fill="{color}" opacity="0.35"/>',
                f'<rect x="{left}" y="{y}" width="{x(r["p50_ms"]) - left:.1f}" '
                f'height="{bar_h}" fill="{color}"/>',
                f'<text x="{x(r["p99_ms"]) + 4:.1f}" y="{y + 15}">{r["p50_ms"]:.0f} / '
                f'{r["p99_ms"]:.0f}</text>']
    axis_y = top + len(rows) * (bar_h + 10) + 10
    for tick in (10, 100, 1000, 10000):
        if tick <= hi:
            out.append(f'<text x="{x(tick) - 10:.1f}" y="{axis_y + 12}">{tick}</text>')
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")


def cpu_seconds(zygote: int | None) -> float:
    """CPU time of this process, its reaped children (cold attempts) and the warm process with
    its reaped children (warm attempts): what the attempts cost, whatever the host's load."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    if zygote is not None:
        stat = Path(f"/proc/{zygote}/stat").read_text()
        ticks = [int(f) for f in stat[stat.rindex(")") + 2:].split()[11:15]]
        total += sum(ticks) / os.sysconf("SC_CLK_TCK")
    return total


def memory_kb(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of `pid` in kB."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0])
    return fields["Rss"], fields["Pss"]


def processes(marker: str, home: Path) -> list[int]:
    """This stack's processes (E31_HOME is its home) whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode() \
                        and f"E31_HOME={home}".encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def warm_process_of(worker: int) -> int | None:
    """The worker process's warm process (its environment holds no E31_* to find it by)."""
    for task in Path(f"/proc/{worker}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                if b"e31_worker.child.zygote" in Path(f"/proc/{child}/cmdline").read_bytes():
                    return int(child)
            except OSError:
                continue
    return None


def on_stack(jobs: int, base: Path, settle_s: float) -> dict[str, Any]:
    """Part 2: recorded starts of tiny jobs on `e31 up`, then the memory of idle workers
    (`settle_s` after the last job, and after the bare Celery worker answers)."""
    home = base / "stack"
    home.mkdir()
    out: dict[str, Any] = {"jobs": jobs}
    with private_stack(home, ["--cpu-slots", "1"]) as client:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:   # its warm process is ready once torch is mapped
            workers = processes("e31_worker.node.celery_process", home)
            zygote = warm_process_of(workers[0]) if workers else None
            if zygote and "libtorch" in Path(f"/proc/{zygote}/maps").read_text():
                break
            time.sleep(1)
        time.sleep(settle_s)
        specs = [{"entrypoint": "e31_worker.examples:sleep", "params": {"seconds": 0.0},
                  "resources": {"gpus": 0}} for _ in range(jobs)]
        statuses = wait_all(submit_all(client, specs))
        attempts = [s["attempts"][-1] for s in statuses if s["state"] == "succeeded"]
        warm_ms = [a["start_ms"] for a in attempts if a["start"] == "warm"]
        cold_ms = [a["start_ms"] for a in attempts if a["start"] == "cold"]
        out.update(succeeded=len(attempts), warm=len(warm_ms), cold=len(cold_ms))
        print(f"stack: {len(attempts)}/{jobs} succeeded, {len(warm_ms)} warm, "
              f"{len(cold_ms)} cold")
        if warm_ms:
            out.update(warm_start_ms_p50=pct(warm_ms, 0.5), warm_start_ms_p99=pct(warm_ms, 0.99))
            print(f"stack: recorded start_ms of warm attempts p50 {pct(warm_ms, 0.5):.1f} ms, "
                  f"p99 {pct(warm_ms, 0.99):.1f} ms")
        time.sleep(settle_s)   # idle again
        [worker] = processes("e31_worker.node.celery_process", home)
        zygote = warm_process_of(worker)
        out["worker_rss_pss_kb"] = rss, pss = memory_kb(worker)
        print(f"idle worker process  RSS {rss / 1024:7.1f} MiB  PSS {pss / 1024:7.1f} MiB")
        if zygote:
            out["warm_process_rss_pss_kb"] = rss, pss = memory_kb(zygote)
            print(f"its warm process     RSS {rss / 1024:7.1f} MiB  PSS {pss / 1024:7.1f} MiB")
        redis_url = json.loads((home / "profile.json").read_text())["redis_url"]
        app_dir = base / "tinyapp"
        app_dir.mkdir()
        (app_dir / "tinyapp.py").write_text(TINY_CELERY_APP)
        env = dict(os.environ, BENCH_BROKER=redis_url,
                   PYTHONPATH=os.pathsep.join([str(app_dir), os.environ.get("PYTHONPATH", "")]))
        celery = subprocess.Popen([sys.executable, "-m", "celery", "-A", "tinyapp", "worker",
                                   "-P", "threads", "-c", "1", "--without-gossip",
                                   "--without-mingle", "-Q", "bench-idle"], env=env,
                                  cwd=app_dir, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        try:
            from celery import Celery
            celery_workers_ready(Celery("tinyapp", broker=redis_url), 1)
            time.sleep(settle_s)
            out["bare_celery_rss_pss_kb"] = rss, pss = memory_kb(celery.pid)
            print(f"bare Celery worker   RSS {rss / 1024:7.1f} MiB  PSS {pss / 1024:7.1f} MiB")
        finally:
            celery.terminate()
            celery.wait(timeout=30)
    return out


SMOKE = {"runs": 2, "cold_runs": 1, "stack_jobs": 2, "settle_s": 1.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20, help="warm attempts per job")
    ap.add_argument("--cold-runs", type=int, default=6, help="cold attempts per job")
    ap.add_argument("--stack-jobs", type=int, default=20)
    ap.add_argument("--skip-stack", action="store_true")
    ap.add_argument("--skip-direct", action="store_true")
    ap.add_argument("--svg", type=Path, help="write a bar chart of part 1 here")
    ap.add_argument("--settle-s", type=float, default=5.0,
                    help="part 2: the wait before the jobs and before each memory reading")
    args = parse(ap, SMOKE)
    report: dict[str, Any] = {"cpus": os.cpu_count()}
    base = Path(tempfile.mkdtemp(prefix="e31-start-"))
    print(f"host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    try:
        if not args.skip_direct:
            report["direct"] = rows = direct(args.runs, args.cold_runs, base)
            if args.svg:
                svg_chart(rows, args.svg, f"{os.cpu_count()} CPUs, load average "
                                          f"{os.getloadavg()[0]:.0f}")
        if not args.skip_stack:
            report["stack"] = on_stack(args.stack_jobs, base, args.settle_s)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    save(args, report)
    print(f"load average at the end {os.getloadavg()[0]:.1f}; mean of the host: "
          f"{statistics.mean(os.getloadavg()):.1f}")


if __name__ == "__main__":
    main()
