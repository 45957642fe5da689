"""Every example the README and docs point at runs against a real stack."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import Stack

EXAMPLES = Path(__file__).parents[2] / "examples"


@pytest.mark.parametrize("spec", sorted(p.name for p in EXAMPLES.iterdir()
                                        if p.suffix in (".yaml", ".json")))
def test_each_example_spec_runs_to_success(stack: Stack, spec: str) -> None:
    submitted = stack.e31("submit", str(EXAMPLES / spec), "--wait", "--json", timeout_s=120)
    assert submitted.returncode == 0, submitted.stderr
    assert json.loads(submitted.stdout)["state"] == "succeeded"


def test_the_python_client_tour_runs_as_written(stack: Stack, tmp_path: Path) -> None:
    tour = subprocess.run([sys.executable, str(EXAMPLES / "client_tour.py")], env=stack.env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert tour.returncode == 0, tour.stderr
    assert "result {'greeting': 'hello, python'" in tour.stdout
    assert re.search(r"^ran on GPU 1 of \S+@", tour.stdout, re.M), tour.stdout   # the 48 GB one
    assert "as expected: cancelled" in tour.stdout
    assert (tmp_path / "out" / "hello" / "greeting.txt").read_text() == "hello, python\n"


def test_the_resumable_example_of_the_reliability_page_resumes_from_its_checkpoint(
        stack: Stack) -> None:
    # Given the documented job, made to fail its first attempt at step 3
    # When it is submitted as the page shows (with a short step and back-off)
    done = stack.e31("submit", "-e", "e31_worker.examples:resumable", "-p", "steps=5",
                     "-p", "step_s=0.2", "-p", "crash_at=3", "--gpus", "0", "--retries", "1",
                     "--backoff", "0", "--wait", "--json", timeout_s=120)

    # Then the retry starts from the checkpoint the first attempt stored
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert status["result"] == {"attempt": 2, "resumed_from": 3}
    assert [a["reason"] for a in status["attempts"]] == ["error", "succeeded"]
