"""A job's own Python environment (`python:` in a spec) through real processes: built with uv
on a real worker from the package index, reused from the host's cache by a later job that asks
the same, its setup time recorded and not billed, and a requirement that cannot be installed
failing its job at once with reason `setup`.

Each build downloads from the package index: the tests build two environments in all (and
one that fails at its resolution)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from e31.core.errors import JobFailed

from .conftest import Stack

PACKAGE = "tomli-w==1.2.0"       # small, pure Python, on the index; not in the workers' env
MISSING = "nonexistent-package-e31-xyz==0.0.1"
WAIT_S = 180                     # a build resolves and downloads from the package index


def envs_dir(stack: Stack) -> Path:
    """The host's environment cache: work_dir/.envs (work_dir defaults to home/work)."""
    return stack.home / "work" / ".envs"


def built_envs(stack: Stack) -> list[str]:
    return sorted(p.name for p in envs_dir(stack).iterdir()
                  if p.is_dir() and not p.name.startswith("."))


def wall_s(attempt: dict[str, Any]) -> float:
    return (datetime.fromisoformat(attempt["ended_at"])
            - datetime.fromisoformat(attempt["started_at"])).total_seconds()


def test_a_job_gets_a_package_the_worker_lacks_and_a_second_job_asking_the_same_builds_nothing(
        stack: Stack) -> None:
    # Given a package that the workers' environment (this interpreter's) lacks
    assert importlib.util.find_spec("tomli_w") is None
    client = stack.client()

    # When a job on a (simulated) GPU asks for it and computes with it
    job = client.submit(entrypoint="envjobs:toml_of", params={"data": {"epochs": 3}},
                        python={"pip": [PACKAGE]}, resources={"gpus": 1})
    status = job.wait(timeout=WAIT_S)

    # Then it returns what the package computed, in an environment of the host's cache
    assert status["result"]["toml"] == "epochs = 3\n"
    env = Path(status["result"]["prefix"])
    assert env.parent == envs_dir(stack)
    record = json.loads((env / "e31-env.json").read_text())
    assert record["installed"] == [PACKAGE]
    assert f"environment {env.name}: built" in job.logs()

    # And its setup is recorded on the attempt, shown by e31 status, and not billed: the
    # GPU-seconds are the attempt's time after its setup
    [attempt] = status["attempts"]
    assert attempt["setup_s"] > 0
    assert status["gpu_seconds"] == pytest.approx(wall_s(attempt) - attempt["setup_s"], abs=0.01)
    assert status["gpu_seconds"] < wall_s(attempt)
    shown = stack.e31("status", job.id, "--json")
    assert json.loads(shown.stdout)["attempts"][0]["setup_s"] == attempt["setup_s"]
    table = subprocess.run([sys.executable, "-m", "e31.cli", "status", job.id],
                           env=dict(stack.env, COLUMNS="250"), capture_output=True, text=True,
                           timeout=60).stdout
    assert "setup" in table and f"{attempt['setup_s']:.1f} s" in table

    # When a second job, a command job, asks for the same package, spelled otherwise
    cached = built_envs(stack)
    second = client.submit(command=["python", "-c", "import sys, tomli_w; print(sys.prefix); "
                                                    "print(tomli_w.dumps({'a': 1}))"],
                           python={"pip": ["Tomli_W == 1.2.0"]}, resources={"gpus": 0})
    second.wait(timeout=WAIT_S)

    # Then its `python` is the same environment's, found in the cache: nothing was built
    log = second.logs()
    assert f"environment {env.name}: cached" in log
    assert f"{env}\na = 1" in log
    assert "uv pip" not in log
    assert json.loads((env / "e31-env.json").read_text()) == record
    assert built_envs(stack) == cached and env.name in cached


def test_a_requirement_that_cannot_be_installed_fails_the_job_at_once_with_reason_setup(
        stack: Stack) -> None:
    # Given a job asking for a package the index does not have, with retries to spare
    job = stack.client().submit(command=["python", "-c", "print('the job ran')"],
                                python={"pip": [MISSING]}, retries={"max": 3, "backoff_s": 0.1},
                                resources={"gpus": 0})

    # When it runs
    with pytest.raises(JobFailed) as failed:
        job.wait(timeout=WAIT_S)

    # Then it failed with reason setup after one attempt (the user's error: no retry), the
    # installer's message in its error and in its log, and the job never started
    status = failed.value.status
    assert (status["state"], status["reason"]) == ("failed", "setup")
    assert [a["reason"] for a in status["attempts"]] == ["setup"]
    assert MISSING.split("==")[0] in status["error"]
    log = job.logs()
    assert "e31: $ uv pip compile" in log
    assert any(line.startswith(("error:", "  cause:")) and MISSING.split("==")[0] in line
               for line in log.splitlines())
    assert "e31: setup failed" in log and "the job ran" not in log
    assert status["attempts"][0]["setup_s"] is not None


def test_a_requirements_file_of_the_jobs_code_is_installed_for_it(stack: Stack,
                                                                   tmp_path: Path) -> None:
    # Given a project whose module needs what its requirements file names
    project = tmp_path / "project"
    project.mkdir()
    (project / "requirements.txt").write_text(f"# what train needs\n{PACKAGE}\n")
    (project / "envcalc.py").write_text(
        "import tomli_w\n\n\ndef main(ctx, n):\n    return {'toml': tomli_w.dumps({'n': n})}\n")

    # When it is sent as the job's code, with the file as its environment
    job = stack.client().submit(entrypoint="envcalc:main", params={"n": 3}, workdir=str(project),
                                python={"requirements": "requirements.txt"},
                                resources={"gpus": 0})
    status = job.wait(timeout=WAIT_S)

    # Then its own module ran in an environment built from that file
    assert status["result"] == {"toml": "n = 3\n"}
    [line] = [ln for ln in job.logs().splitlines() if ln.startswith("e31: environment ")]
    key = line.split()[2].rstrip(":")
    record = json.loads((envs_dir(stack) / key / "e31-env.json").read_text())
    assert (record["requirements"], record["installed"]) == ("requirements.txt", [PACKAGE])
