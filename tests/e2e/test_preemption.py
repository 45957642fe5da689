"""Preemption on a real stack (issue 15, docs/scheduling.md "Preemption"): one simulated GPU,
team a's preemptible training job on it, team b's job waiting past the grace. The scheduler
stops a's job (SIGTERM through its worker's lease), b's job runs, and a's resumes from its
checkpoint and ends with the weights of a run never stopped."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import wait_for

from .stacks import own_stack

WAIT_S = 180
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
# 2 epochs of 10 steps (320 digits, 32 a batch), a checkpoint every 5 steps, 0.4 s a step
TRAINING = {"model": "workload_helpers:slow_digits_mlp", "model_kwargs": {"step_s": 0.4},
            "dataset": "e31_worker.workloads.data:digits", "dataset_kwargs": {"limit": 320},
            "epochs": 2, "batch_size": 32, "val_fraction": 0.0, "checkpoint_every_steps": 5}


@pytest.fixture
def pool(tmp_path_factory: pytest.TempPathFactory):
    with own_stack(tmp_path_factory.mktemp("home"), "--simulate-gpus", "1x24",
                   E31_PREEMPT_GRACE_S="2", E31_PREEMPT_MIN_RUNTIME_S="2") as st:
        yield st


def test_a_training_job_is_preempted_for_a_team_below_its_share_and_resumes_to_the_same_weights(
        pool, tmp_path: Path) -> None:
    b_token = json.loads(pool.e31("tenant", "create", "team-b", "--json").stdout)["token"]

    # Given team a's training job (preemptible: the training workload's default) a few steps
    # into the pool's only GPU
    a = pool.client().submit(entrypoint="e31_worker.workloads.training:run", params=TRAINING,
                             resources={"gpus": 1}, env=ONE_THREAD, name="train-a")
    wait_for(lambda: (a.status().get("progress") or {}).get("done", 0) >= 6, timeout_s=WAIT_S,
             what="a's training six steps in", evidence=lambda: a.status())

    # When team b, which holds no GPU, submits a job that needs it
    b = pool.client(b_token).submit(entrypoint="e2ejobs:timed", params={"seconds": 1},
                                    resources={"gpus": 1}, name="short-b")

    # Then a's attempt is preempted, b's job runs on the GPU, and a's runs again afterwards
    b_done = b.wait(timeout=WAIT_S)
    a_done = a.wait(timeout=WAIT_S)
    assert b_done["state"] == "succeeded" and a_done["state"] == "succeeded", (a_done, b_done)
    first, second = a_done["attempts"]
    assert (first["reason"], second["reason"]) == ("preempted", "succeeded")
    assert "preempted" in first["error"]
    [b_attempt] = b_done["attempts"]
    at = datetime.fromisoformat
    assert at(first["ended_at"]) <= at(b_attempt["started_at"])
    assert at(b_attempt["ended_at"]) <= at(second["started_at"])
    # it resumed from its last checkpoint, and did all 20 steps
    result = a_done["result"]
    assert result["resumed_from_step"] in (5, 10, 15) and result["steps"] == 20
    # b is billed nothing of a's; a for both attempts' running time
    assert a_done["gpu_seconds"] > 0 and b_done["gpu_seconds"] < a_done["gpu_seconds"]
    shown = subprocess.run([sys.executable, "-m", "e31.cli", "status", a.id],
                           env={**pool.env, "COLUMNS": "200"}, capture_output=True, text=True,
                           timeout=60)
    assert "preempted" in shown.stdout, shown.stdout + shown.stderr

    # And its weights equal those of the same run never stopped (not preemptible here)
    ref = pool.client().submit(entrypoint="e31_worker.workloads.training:run",
                               params={**TRAINING, "model_kwargs": {"step_s": 0}},
                               resources={"gpus": 1}, env=ONE_THREAD, preemptible=False,
                               name="train-reference")
    assert ref.wait(timeout=WAIT_S)["state"] == "succeeded"
    a.download(tmp_path / "a")
    ref.download(tmp_path / "ref")
    ours, theirs = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("a", "ref"))
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert ((tmp_path / "a" / "metrics.json").read_text()
            == (tmp_path / "ref" / "metrics.json").read_text())
