"""The built-in workloads through a real stack: submitted, run by real workers, retried."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import Stack

pytest.importorskip("torch")
pytest.importorskip("sklearn")
pytest.importorskip("av")
pytestmark = pytest.mark.torch

WAIT_S = 120
DOC = Path(__file__).parents[2] / "docs" / "workloads.md"
MLP = "e31_worker.workloads.models:digits_mlp"
# Tiny models run fastest on one thread, and the test machine's two cores are shared.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
RETRY_ONCE = {"max": 1, "backoff_s": 0.2}


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_batch_inference_writes_results_and_puts_the_one_bad_record_in_errors(
        stack: Stack, tmp_path: Path) -> None:
    from e31_worker.workloads.data import write_digits_jsonl

    # Given 60 digits records, one of them with a short input
    src = tmp_path / "in.jsonl"
    ids = write_digits_jsonl(src, limit=60, bad_ids=["digit-13"])

    # When a batch-inference job runs them on the cpu class
    job = stack.client().submit(entrypoint="e31_worker.workloads.batch_inference:run",
                                params={"path": "in.jsonl", "model": MLP, "batch_size": 16},
                                inputs={"in.jsonl": str(src)}, resources={"gpus": 0},
                                env=ONE_THREAD, name="infer")
    status = job.wait(timeout=WAIT_S)

    # Then the result counts them, and the outputs key every record by its custom_id
    assert {k: status["result"][k] for k in ("total", "succeeded", "failed")} == {
        "total": 60, "succeeded": 59, "failed": 1}
    job.download(tmp_path / "out")
    assert [r["custom_id"] for r in rows(tmp_path / "out" / "results.jsonl")] == [
        i for i in ids if i != "digit-13"]
    [error] = rows(tmp_path / "out" / "errors.jsonl")
    assert error["custom_id"] == "digit-13" and "shape" in error["error"]


def test_batch_inference_killed_mid_way_resumes_on_retry_without_duplicates(
        stack: Stack, tmp_path: Path) -> None:
    from e31_worker.workloads.data import write_digits_jsonl

    # Given 200 records, batches of 16, a commit every 32 records,
    # and a model whose process is killed at its 7th batch on the first attempt
    src = tmp_path / "in.jsonl"
    ids = write_digits_jsonl(src, limit=200)
    params = {"path": "in.jsonl", "model": "workload_helpers:killed_once_digits_mlp",
              "model_kwargs": {"kill_at_call": 7}, "batch_size": 16,
              "checkpoint_every_records": 32}

    # When the job runs with one retry
    job = stack.client().submit(entrypoint="e31_worker.workloads.batch_inference:run",
                                params=params, inputs={"in.jsonl": str(src)},
                                retries=RETRY_ONCE, resources={"gpus": 0}, env=ONE_THREAD)
    status = job.wait(timeout=WAIT_S)

    # Then the retry started after the 96 records committed before the kill
    assert [a["reason"] for a in status["attempts"]] == ["error", "succeeded"]
    assert status["result"]["resumed_from"] == 96
    assert status["result"]["succeeded"] == 200 and status["result"]["failed"] == 0
    # And results.jsonl has every record exactly once, in input order
    job.download(tmp_path / "out")
    assert [r["custom_id"] for r in rows(tmp_path / "out" / "results.jsonl")] == ids


def test_training_killed_mid_epoch_resumes_from_its_last_checkpoint_on_retry(
        stack: Stack, tmp_path: Path) -> None:
    # Given 2 epochs of 10 steps, a checkpoint every 5 steps,
    # and a model whose process is killed at its 8th step on the first attempt
    params = {"model": "workload_helpers:killed_once_digits_mlp",
              "model_kwargs": {"kill_at_call": 8},
              "dataset": "e31_worker.workloads.data:digits", "dataset_kwargs": {"limit": 320},
              "epochs": 2, "batch_size": 32, "val_fraction": 0.0, "checkpoint_every_steps": 5}

    # When the job runs with one retry
    job = stack.client().submit(entrypoint="e31_worker.workloads.training:run", params=params,
                                retries=RETRY_ONCE, resources={"gpus": 0}, env=ONE_THREAD)
    status = job.wait(timeout=WAIT_S)

    # Then the retry resumed at step 5 and finished all 20 steps with its outputs
    assert [a["reason"] for a in status["attempts"]] == ["error", "succeeded"]
    assert status["result"]["resumed_from_step"] == 5 and status["result"]["steps"] == 20
    job.download(tmp_path / "out")
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert [m["epoch"] for m in metrics] == [1, 2]
    assert (tmp_path / "out" / "model.safetensors").stat().st_size > 0


def test_footage_over_a_rendered_two_second_clip_counts_frames_by_colour(
        stack: Stack, tmp_path: Path) -> None:
    from e31_worker.workloads.footage import render_test_video

    # Given a 2 s clip: red in the first second, green in the second
    clip = render_test_video(tmp_path / "clip.mp4", seconds=2, fps=10)

    # When a footage job samples it at 4 frames a second
    job = stack.client().submit(entrypoint="e31_worker.workloads.footage:run",
                                params={"path": "clip.mp4", "fps": 4, "batch_size": 4},
                                inputs={"clip.mp4": str(clip)}, resources={"gpus": 0},
                                env=ONE_THREAD)
    status = job.wait(timeout=WAIT_S)

    # Then 8 frames were labelled, 4 of each colour, with per-frame rows and a summary
    assert status["result"]["frames"] == 8
    assert status["result"]["class_counts"] == {"green": 4, "red": 4}
    job.download(tmp_path / "out")
    assert len(rows(tmp_path / "out" / "frames.jsonl")) == 8
    [summary] = json.loads((tmp_path / "out" / "summary.json").read_text())["files"]
    assert summary["frames"] == 8 and summary["duration_s"] == pytest.approx(2.0)


# The inference (0) and training (1) examples carry `e31-test` marks and are run, their shown
# output compared, by tests/e2e/test_docs.py; the footage example (2) is run here.
@pytest.mark.parametrize("index,expected", [
    (2, ["[{'green': 2, 'red': 4}, {'blue': 4, 'green': 2}]", '"frames": 6']),
])
def test_each_example_in_the_workloads_doc_runs_against_the_stack_and_prints_what_it_says(
        stack: Stack, tmp_path: Path, index: int, expected: list[str]) -> None:
    # Given the doc's Python example, in an empty directory, with the stack's address
    code = re.findall(r"```python[^\n]*\n(.*?)```", DOC.read_text(), flags=re.DOTALL)[index]
    env = dict(stack.env, E31_URL=stack.url, E31_TOKEN=stack.token)

    # When it runs as a script
    done = subprocess.run([sys.executable, "-c", code], check=False, cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=WAIT_S * 2)

    # Then it succeeds and prints what the doc's comments say
    assert done.returncode == 0, done.stderr
    for text in expected:
        assert text in done.stdout, done.stdout
