"""`e31 demo`: the README's main job — a realistic pipeline on the embedded stack, no download.

On the stack of E31_HOME (started detached, as `e31 up -d --no-flower`, when none runs, and
stopped at the end, on Ctrl-C or on an error, unless `--keep`; a stack the user started is
used and left running), with scikit-learn's bundled digits and a clip the demo renders:

1. `demo-train`     a digits MLP (the training workload); its weights are downloaded to --out
2. `demo-inference` the held-out digits through those weights (batch inference)
3. `demo-footage`   every frame of the clip through the colour model (footage)
4. `demo-sweep`     the training over four learning rates, as one array
5. `demo-prompts`   twelve prompts to the built-in chat model, as a batch (`demoprompts`)

Train and inference are the critical path and go first (priority); footage and the sweep
fill the other slots. Every job asks for one GPU when the stack has GPU workers, else the cpu
class. Rich progress bars while they run, then a summary table (or `--json`) and where the
outputs are. The demo needs the worker extra (torch, scikit-learn, PyAV), imported lazily.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from e31.client import ArrayHandle, Client, JobHandle
from e31.client.profile import read_profile
from e31.core.errors import ClientError, ConfigError, E31Error
from e31.core.states import FINAL_STATES
from e31.local.demoprompts import DemoPrompts
from e31.local.state import STATE_FILE, pid_alive, stack_ready

READY_TIMEOUT_S = 120.0      # `e31 up -d`'s own limit for a stack to come up
STOP_TIMEOUT_S = 120.0       # `e31 down`'s: workers drain running jobs first
DEMO_TIMEOUT_S = 900.0       # the whole pipeline; it takes well under a minute on 2 CPU cores
JOB_TIMEOUT_S = 600          # per attempt
POLL_S = 0.5
HEALTH_TIMEOUT_S = 2.0
FIRST = 5                    # priority of the critical path (train, then inference): a
#                              tenant's highest by default (tenant_max_priority)
WORKER_MODULES = ("torch", "sklearn", "av", "safetensors", "e31_worker")

MLP = "e31_worker.workloads.models:digits_mlp"
TRAIN: dict[str, Any] = {"model": MLP, "model_kwargs": {"hidden": 64},
                         "dataset": "e31_worker.workloads.data:digits", "epochs": 3,
                         "batch_size": 64, "lr": 0.01, "checkpoint_every_steps": 50}
SWEEP_LRS = (0.001, 0.003, 0.01, 0.03)
VIDEO_S, VIDEO_FPS = 6, 10   # 60 frames: 20 red, 20 green, 20 blue
# Tiny models run fastest on one thread, and a small machine's cores are shared by the jobs.
JOB_ENV = {"OMP_NUM_THREADS": "1"}
SUMMARY_CHARS = 120          # of a failed job's error, in the table (--json has all of it)


@dataclass(frozen=True)
class DemoOptions:
    home: Path
    out: Path | None = None
    keep: bool = False
    as_json: bool = False


@dataclass
class Step:
    """One job of the demo as it is followed: its handle once submitted, its last status."""

    name: str
    kind: str
    job: JobHandle | None = None
    status: dict[str, Any] = field(default_factory=dict)
    outputs: Path | None = None
    result: dict[str, Any] = field(default_factory=dict)
    summary: str = ""

    @property
    def state(self) -> str:
        return str(self.status.get("state") or ("skipped" if self.job is None else "queued"))


def run(options: DemoOptions, *, out: Console, err: Console) -> int:
    """The whole demo; returns the exit code (0: every job succeeded)."""
    missing = [m for m in WORKER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"e31 demo runs the built-in workloads and needs the worker extra "
                          f"({', '.join(missing)} missing): pip install -e '.[worker]'")
    started_at = time.monotonic()
    home = options.home.expanduser().resolve()
    out_dir = (options.out or home / "demo" / datetime.now().strftime("%Y%m%d-%H%M%S")).resolve()
    with _stack(home, keep=options.keep, err=err) as stack, _sigterm_as_interrupt():
        inputs = _prepare_inputs(out_dir / "inputs")
        stack.wait_ready()
        profile = read_profile(home)
        with Client(profile["url"], profile["token"]) as client:
            resources = _resources(client, local_gpus=stack.started)
            steps, sweep = _pipeline(client, inputs, out_dir, resources, show=not options.as_json,
                                     err=err)
        stack_info = {"started": stack.started, "kept": stack.started and options.keep,
                      "url": profile["url"], "pids": stack.pids}
    summary = _summary(steps, sweep, home=home, out_dir=out_dir, inputs=inputs,
                       resources=resources, stack=stack_info,
                       wall_s=round(time.monotonic() - started_at, 1))
    if options.as_json:
        out.print_json(json.dumps(summary))
    else:
        _print_summary(summary, out)
    return 0 if summary["ok"] else 1


# -- the stack ---------------------------------------------------------------------------

@dataclass
class _Stack:
    home: Path
    proc: subprocess.Popen[bytes] | None = None
    pids: list[int] = field(default_factory=list)

    @property
    def started(self) -> bool:
        return self.proc is not None

    def wait_ready(self) -> None:
        if self.proc is None:
            return
        log_path = self.home / "logs" / "up.log"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not stack_ready(self.home):
            if self.proc.poll() is not None:
                raise E31Error(f"e31 up exited with code {self.proc.returncode}; see {log_path}")
            if time.monotonic() > deadline:
                raise E31Error(f"the stack was not ready in {READY_TIMEOUT_S:g} s; see {log_path}")
            time.sleep(POLL_S)
        state = json.loads((self.home / STATE_FILE).read_text())
        self.pids = [int(state["pid"]), *(int(p) for p in state["children"].values())]


@contextmanager
def _stack(home: Path, *, keep: bool, err: Console) -> Iterator[_Stack]:
    """The running stack of `home`, else one started detached (not yet ready: `wait_ready`),
    stopped on the way out unless `keep` — never one the demo did not start."""
    if _answers(home):
        err.print(f"Using the stack running from {home}.", highlight=False)
        yield _Stack(home)
        return
    if stack_ready(home):
        pid = int(json.loads((home / STATE_FILE).read_text())["pid"])
        if pid_alive(pid):
            raise E31Error(f"the stack running from {home} (pid {pid}) does not answer; see "
                           f"{home / 'logs'}, or `e31 down` it")
        (home / STATE_FILE).unlink(missing_ok=True)   # its stack died without cleaning up
    err.print(f"Starting a stack in {home} (e31 up -d --no-flower) …", highlight=False)
    (home / "logs").mkdir(parents=True, exist_ok=True)
    with open(home / "logs" / "up.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "e31.cli", "up", "--no-flower"],
                                env=dict(os.environ, E31_HOME=str(home)), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)  # Ctrl-C reaches the demo, not the stack
    stack = _Stack(home, proc)
    try:
        yield stack
    finally:
        if keep and stack_ready(home):
            err.print(f"The stack keeps running (--keep): `e31 down --home {home}` stops it.",
                      highlight=False)
        else:
            # What `e31 down` does, but on the child itself: `stop_stack` polls the pid, and
            # an exited child stays a zombie (alive to a poll) until its parent reaps it.
            err.print("Stopping the stack the demo started …")
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                (home / STATE_FILE).unlink(missing_ok=True)


def _answers(home: Path) -> bool:
    """Whether `home` has a ready stack whose API answers."""
    url = read_profile(home).get("url")
    if not stack_ready(home) or not url:
        return False
    try:
        return httpx.get(f"{url}/v1/health", timeout=HEALTH_TIMEOUT_S).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so that the demo cancels its jobs and stops its stack."""
    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _resources(client: Client, *, local_gpus: bool) -> dict[str, int]:
    """One GPU per job when the stack has GPU workers (their heartbeats, or, for a stack the
    demo just started, whose GPU workers may not beat yet, this machine's GPUs), else none."""
    classes = client.queue()["classes"]
    if any(c["size_class"] != "cpu" and c["gpus"] > 0 for c in classes):
        return {"gpus": 1}
    if local_gpus:
        from e31_worker.node.gpus import discover
        return {"gpus": 1 if discover() else 0}
    return {"gpus": 0}


# -- the pipeline ------------------------------------------------------------------------

def _prepare_inputs(directory: Path) -> dict[str, Path]:
    """The held-out digits as batch-inference records, and a short clip, rendered here."""
    from e31_worker.workloads.data import write_digits_jsonl
    from e31_worker.workloads.video import render_test_video
    directory.mkdir(parents=True, exist_ok=True)
    digits = directory / "digits-test.jsonl"
    write_digits_jsonl(digits, split="test")
    clip = render_test_video(directory / "clip.mp4", seconds=VIDEO_S, fps=VIDEO_FPS)
    return {"digits": digits, "video": clip}


def _pipeline(client: Client, inputs: dict[str, Path], out_dir: Path, resources: dict[str, int],
              *, show: bool, err: Console) -> tuple[list[Step], dict[str, Any]]:
    """Submit, follow with progress bars, download; returns the steps (sweep items last) and
    the sweep's array status. Ctrl-C or the deadline cancels what still runs."""
    common: dict[str, Any] = {"resources": resources, "env": JOB_ENV, "timeout_s": JOB_TIMEOUT_S,
                              "retries": {"max": 1}}
    train, infer = Step("demo-train", "train"), Step("demo-inference", "batch-inference")
    footage = Step("demo-footage", "footage")
    train.job = client.submit(name=train.name, workload="train", params=TRAIN, priority=FIRST,
                              **common)
    # Files travel with the jobs as their inputs: a sandboxed job reads nothing else of
    # this machine (docs/security.md), and a worker elsewhere could not anyway.
    footage.job = client.submit(name=footage.name, workload="footage", params={
        "path": inputs["video"].name, "fps": VIDEO_FPS, "batch_size": 16},
        inputs={inputs["video"].name: str(inputs["video"])}, **common)
    array = client.submit_many([{"params": {"lr": lr}} for lr in SWEEP_LRS], name="demo-sweep",
                               workload="train", params=TRAIN, **common)
    items = [Step(f"demo-sweep[{i}]", "sweep") for i in range(len(SWEEP_LRS))]
    for item, job in zip(items, array.jobs(), strict=True):
        item.job = job
    prompts = DemoPrompts(client)
    prompts.submit()
    jobs = [train, infer, footage]
    deadline = time.monotonic() + DEMO_TIMEOUT_S
    with Progress(TextColumn("{task.description:<16}"), BarColumn(),
                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=err,
                  disable=not show) as bars:
        tasks = {s.name: bars.add_task(s.name, total=None, info="queued") for s in jobs}
        bars.update(tasks[infer.name], info=f"waits for {train.name}")
        sweep_task = bars.add_task("demo-sweep", total=len(items), info="queued")
        prompts_task = bars.add_task("demo-prompts", total=None, info="queued")
        try:
            while True:
                for step in jobs:
                    _poll(step, bars, tasks[step.name])
                sweep = array.status(items=False)
                bars.update(sweep_task, completed=sweep["done"], info=_counts(sweep))
                done, total, said = prompts.poll()
                bars.update(prompts_task, total=total or None, completed=done, info=said)
                if train.state == "succeeded" and infer.job is None:
                    weights = _fetch(train, out_dir / "train") / "model.safetensors"
                    infer.job = client.submit(
                        name=infer.name, workload="batch-inference", priority=FIRST, params={
                            "path": inputs["digits"].name, "model": MLP, "batch_size": 128,
                            "model_kwargs": TRAIN["model_kwargs"], "weights": weights.name},
                        inputs={inputs["digits"].name: str(inputs["digits"]),
                                weights.name: str(weights)}, **common)
                elif train.state in ("failed", "cancelled"):
                    bars.update(tasks[infer.name], info=f"skipped: {train.name} {train.state}")
                live = [s for s in jobs if s.job is not None and s.state not in FINAL_STATES]
                if not live and sweep["done"] >= sweep["total"] and prompts.done:
                    break
                if time.monotonic() > deadline:
                    err.print(f"the demo took more than {DEMO_TIMEOUT_S:g} s: cancelling its jobs")
                    _cancel(client, jobs, array)
                    prompts.cancel()
                    break
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            err.print("interrupted: cancelling the demo's jobs")
            _cancel(client, jobs, array)
            prompts.cancel()
            raise
    for step in [*jobs, *items]:
        if step.job is not None:
            step.status = step.job.status()
    _results(train, infer, footage, items, inputs, out_dir)
    return [*jobs, _prompts_step(prompts, out_dir), *items], array.status(items=False)


def _prompts_step(prompts: DemoPrompts, out_dir: Path) -> Step:
    """The demo's batch of prompts as a step of the summary."""
    status = prompts.status(out_dir / "prompts")
    step = Step("demo-prompts", "prompts", status=status, result=status.get("result") or {},
                summary=status.get("summary", ""))
    step.outputs = Path(status["outputs"]) if status.get("outputs") else None
    return step


def _poll(step: Step, bars: Progress, task: TaskID) -> None:
    if step.job is None or step.state in FINAL_STATES:
        return
    step.status = step.job.status()
    prog = step.status.get("progress") or {}
    if step.state == "succeeded":
        total = bars.tasks[task].total or 1
        bars.update(task, total=total, completed=total, info="succeeded")
        return
    info = f"failed: {step.status.get('reason')}" if step.state == "failed" else step.state
    bars.update(task, total=prog.get("total") or None, completed=prog.get("done") or 0, info=info)


def _counts(st: dict[str, Any]) -> str:
    shown = [f"{st[k]} {k}" for k in ("running", "succeeded", "failed", "cancelled", "queued")
             if st.get(k)]
    return ", ".join(shown) or "queued"


def _cancel(client: Client, jobs: list[Step], array: ArrayHandle) -> None:
    """Best effort: the stack may be on its way down already."""
    for step in jobs:
        if step.job is not None and step.state not in FINAL_STATES:
            try:
                step.job.cancel()
            except ClientError:
                pass
    try:
        array.cancel()
    except ClientError:
        pass


def _fetch(step: Step, directory: Path) -> Path:
    if step.job is None:
        raise ValueError(f"{step.name} was never submitted")
    step.job.download(directory)
    step.outputs = directory
    return directory


def _results(train: Step, infer: Step, footage: Step, items: list[Step],
             inputs: dict[str, Path], out_dir: Path) -> None:
    """Download the outputs of the jobs that succeeded and say what each one found."""
    runs: list[tuple[Step, Path, float | None]] = [(train, out_dir / "train", None)]
    runs += [(item, out_dir / "sweep" / str(i), lr)
             for i, (item, lr) in enumerate(zip(items, SWEEP_LRS, strict=True))]
    for step, directory, lr in runs:
        if step.state == "succeeded":
            if step.outputs is None:
                _fetch(step, directory)
            metrics = step.status["result"]["metrics"]
            step.result = {"val_accuracy": round(metrics["val_accuracy"], 4),
                           "epochs": metrics["epoch"]}
            step.summary = f"val acc {metrics['val_accuracy']:.3f}"
        if lr is not None:
            step.result["lr"] = lr
            step.summary = f"lr {lr:g}, {step.summary}" if step.summary else f"lr {lr:g}"
    done = [s for s in items if s.state == "succeeded"]
    if done:
        best = max(done, key=lambda s: s.result["val_accuracy"])
        best.result["best"] = True
        best.summary += " (best)"
    if infer.state == "succeeded":
        _fetch(infer, out_dir / "inference")
        labels = {r["custom_id"]: r["label"] for r in _rows(inputs["digits"])}
        scored = _rows(out_dir / "inference" / "results.jsonl")
        right = sum(1 for r in scored if r["label"] == labels.get(r["custom_id"]))
        res = infer.status["result"]
        infer.result = {"total": res["total"], "succeeded": res["succeeded"],
                        "failed": res["failed"], "accuracy": round(right / max(len(scored), 1), 4)}
        infer.summary = (f"{res['succeeded']}/{res['total']} scored, "
                         f"acc {infer.result['accuracy']:.3f}")
    if footage.state == "succeeded":
        _fetch(footage, out_dir / "footage")
        res = footage.status["result"]
        footage.result = {"frames": res["frames"], "class_counts": res["class_counts"]}
        counts = ", ".join(f"{v} {k}" for k, v in sorted(res["class_counts"].items()))
        footage.summary = f"{res['frames']} frames: {counts}"


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- the summary -------------------------------------------------------------------------

def _summary(steps: list[Step], sweep: dict[str, Any], *, home: Path, out_dir: Path,
             inputs: dict[str, Path], resources: dict[str, int], stack: dict[str, Any],
             wall_s: float) -> dict[str, Any]:
    jobs: list[dict[str, Any]] = []
    for s in steps:
        st = s.status
        jobs.append({"name": s.name, "kind": s.kind,
                     "id": s.job.id if s.job else st.get("id"),
                     "state": s.state, "size_class": st.get("size_class"),
                     "queued_s": st.get("queued_seconds"), "run_s": st.get("run_seconds"),
                     "gpu_seconds": st.get("gpu_seconds"), "result": s.result,
                     "summary": s.summary or st.get("error") or st.get("reason") or "",
                     "outputs": str(s.outputs) if s.outputs else None})
    best = next((j for j in jobs if j["result"].get("best")), None)
    best_item = None if best is None else {"name": best["name"], "id": best["id"], **best["result"]}
    # A batch of prompts skipped for want of the built-in models (no `.[llm]`) fails nothing.
    ok = all(j["state"] == "succeeded" or (j["kind"], j["state"]) == ("prompts", "skipped")
             for j in jobs)
    return {"ok": ok, "wall_s": wall_s,
            "home": str(home), "out": str(out_dir), "stack": stack, "resources": resources,
            "inputs": {k: str(v) for k, v in inputs.items()},
            "sweep": {"id": sweep["id"], "name": sweep["name"], "state": sweep["state"],
                      "best": best_item},
            "jobs": jobs}


def _print_summary(summary: dict[str, Any], out: Console) -> None:
    verdict = "every job succeeded" if summary["ok"] else "FAILED"
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,
                  title=f"e31 demo: {verdict} in {summary['wall_s']:.0f} s")
    for name in ("job", "class", "state"):
        table.add_column(name, no_wrap=True)
    for name in ("queued s", "run s", "GPU-s"):
        table.add_column(name, justify="right")
    table.add_column("result")
    for j in summary["jobs"]:
        state = j["state"] if j["state"] == "succeeded" else f"[red]{j['state']}[/red]"
        table.add_row(j["name"], j["size_class"] or "-", state, _num(j["queued_s"]),
                      _num(j["run_s"]), _num(j["gpu_seconds"]),
                      escape(j["summary"][:SUMMARY_CHARS]))
    out.print(table)
    out.print(f"Inputs and outputs in {summary['out']}/", highlight=False)
    out.print(f"  {'inputs/':<16}{_listing(Path(summary['inputs']['digits']).parent)}",
              highlight=False)
    shown = set()
    for j in summary["jobs"]:
        if j["outputs"]:
            rel = Path(j["outputs"]).relative_to(summary["out"]).as_posix()
            where = "sweep/N/" if j["kind"] == "sweep" else f"{rel}/"
            if where not in shown:
                shown.add(where)
                out.print(f"  {where:<16}{_listing(Path(j['outputs']))}", highlight=False)
        elif j["id"] and j["state"] != "succeeded":
            out.print(f"{j['name']} {j['state']}: `e31 logs {j['id']}` says why", highlight=False)
    if summary["stack"]["kept"] or not summary["stack"]["started"]:
        out.print("The stack is still running: `e31 ls`, `e31 usage`, `e31 down`.", highlight=False)


def _listing(directory: Path) -> str:
    return ", ".join(sorted(p.relative_to(directory).as_posix()
                            for p in directory.rglob("*") if p.is_file()))


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
