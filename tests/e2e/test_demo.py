"""`e31 demo` as a user runs it: on a stack it starts and stops, and on one already running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from e31.local.redisserver import free_port
from e31.local.state import STATE_FILE, stack_ready
from tests.conftest import process_alive, wait_for

from .conftest import Stack

pytest.importorskip("torch")
pytest.importorskip("sklearn")
pytest.importorskip("av")
pytestmark = pytest.mark.torch

DEMO_S = 240        # the demo promises 3 minutes on 2 CPU cores, its stack included
NAMES = ["demo-train", "demo-inference", "demo-footage", "demo-prompts",
         "demo-sweep[0]", "demo-sweep[1]", "demo-sweep[2]", "demo-sweep[3]"]
JOB_FIELDS = {"name", "kind", "id", "state", "size_class", "queued_s", "run_s", "gpu_seconds",
              "result", "summary", "outputs"}


def demo(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "e31.cli", "demo", "--json", *args], env=env,
                          check=False, capture_output=True, text=True, timeout=DEMO_S)


def processes_of(home: Path) -> list[int]:
    """Processes whose environment names `home` as E31_HOME: the stack and its jobs."""
    marker = f"E31_HOME={home}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker in environ and process_alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def assert_every_job_succeeded_with_its_outputs(summary: dict[str, Any]) -> None:
    assert summary["ok"] is True
    assert [j["name"] for j in summary["jobs"]] == NAMES
    for job in summary["jobs"]:
        assert JOB_FIELDS <= set(job), job
        assert job["state"] == "succeeded", job
        assert job["queued_s"] >= 0 and job["run_s"] > 0 and job["summary"], job
        assert Path(job["outputs"]).is_dir(), job
    out = Path(summary["out"])
    assert all(Path(path).is_file() for path in summary["inputs"].values())
    assert (out / "train" / "model.safetensors").is_file()
    results = (out / "inference" / "results.jsonl").read_text().splitlines()
    assert len(results) == 360                     # the whole held-out fifth of the digits
    assert (out / "footage" / "summary.json").is_file()
    assert all((out / "sweep" / str(i) / "metrics.json").is_file() for i in range(4))
    jobs = {j["name"]: j for j in summary["jobs"]}
    assert jobs["demo-train"]["result"]["val_accuracy"] > 0.8
    assert jobs["demo-inference"]["result"]["succeeded"] == 360
    assert jobs["demo-footage"]["result"]["class_counts"] == {"red": 20, "green": 20, "blue": 20}
    prompts = jobs["demo-prompts"]["result"]
    assert (prompts["requests"], prompts["completed"], prompts["failed"]) == (12, 12, 0)
    assert prompts["tokens_in"] > 0 and prompts["tokens_out"] > 0
    answers = (Path(jobs["demo-prompts"]["outputs"]) / f"{jobs['demo-prompts']['id']}_output.jsonl")
    assert len(answers.read_text().splitlines()) == 12
    best = summary["sweep"]["best"]
    assert best["val_accuracy"] == max(jobs[n]["result"]["val_accuracy"] for n in NAMES[4:])


@pytest.mark.timeout(DEMO_S + 60)
def test_demo_without_a_stack_starts_one_runs_every_job_and_stops_it(tmp_path: Path) -> None:
    # Given a fresh home and no stack running from it
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("E31_")}
    env.update(E31_HOME=str(home), E31_API_PORT=str(free_port()))

    # When the demo runs
    done = demo(env)

    # Then every job succeeded, on the cpu class of this GPU-less machine
    assert done.returncode == 0, done.stderr + _log(home / "logs" / "up.log")
    summary = json.loads(done.stdout)
    assert_every_job_succeeded_with_its_outputs(summary)
    assert summary["resources"] == {"gpus": 0}
    assert {j["size_class"] for j in summary["jobs"]} == {"cpu"}
    # And its outputs went to a new directory under the home
    assert Path(summary["out"]).parent == home / "demo"
    # And the stack it started is gone, every process of it
    assert summary["stack"]["started"] is True and summary["stack"]["kept"] is False
    assert not (home / STATE_FILE).exists()
    pids = summary["stack"]["pids"]
    assert len(pids) == 5                          # e31 up, api, scheduler, worker, redis
    wait_for(lambda: not any(process_alive(pid) for pid in pids), timeout_s=30,
             what=f"the stack's processes {pids} to exit")
    wait_for(lambda: not processes_of(home), timeout_s=30, what="no process of the demo's stack")


@pytest.mark.timeout(DEMO_S + 60)
def test_demo_on_a_running_stack_uses_its_gpu_workers_and_leaves_it_running(
        stack: Stack, tmp_path: Path) -> None:
    # Given the session's stack, with its simulated GPUs, running from E31_HOME
    # When the demo runs with its outputs in a directory of our choosing
    done = demo(stack.env, "--out", str(tmp_path / "out"))

    # Then every job succeeded, each on one (simulated) GPU of the smallest class, billed
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert_every_job_succeeded_with_its_outputs(summary)
    assert summary["out"] == str(tmp_path / "out")
    assert summary["resources"] == {"gpus": 1}
    assert {j["size_class"] for j in summary["jobs"]} == {"gpu24"}
    assert all(j["gpu_seconds"] > 0 for j in summary["jobs"])
    # And the stack was used, not started, and still runs
    assert summary["stack"]["started"] is False
    assert stack_ready(stack.home)
    assert stack.client().queue()["classes"]


def _log(path: Path) -> str:
    return path.read_text() if path.exists() else ""
