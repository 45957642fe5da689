"""The `e31` command line against a running stack, as a user types it."""

from __future__ import annotations

import json
from pathlib import Path

from .conftest import Stack


def test_submit_from_a_spec_file_then_wait_status_result_and_download(
        stack: Stack, tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text("name: greet-cli\nentrypoint: e31_worker.examples:hello\n"
                    "params: {name: cli}\nresources: {gpus: 0}\n")
    submitted = stack.e31("submit", str(spec))
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()

    waited = stack.e31("wait", job_id, "--json")
    assert waited.returncode == 0, waited.stderr
    assert json.loads(waited.stdout)["result"]["greeting"] == "hello, cli"

    status = json.loads(stack.e31("status", job_id, "--json").stdout)
    assert status["name"] == "greet-cli" and status["state"] == "succeeded"
    assert set(status) >= {"id", "state", "size_class", "queue", "submitted_at", "started_at",
                           "ended_at", "gpu_seconds", "result", "attempts"}

    fetched = stack.e31("result", job_id, "--download", str(tmp_path / "dl"), "--json")
    assert fetched.returncode == 0, fetched.stderr
    assert (tmp_path / "dl" / "greeting.txt").read_text() == "hello, cli\n"

    listed = json.loads(stack.e31("ls", "--json").stdout)
    assert job_id in [j["id"] for j in listed]


def test_a_command_job_after_double_dash_and_its_log(stack: Stack) -> None:
    submitted = stack.e31("submit", "--gpus", "0", "--wait", "--json",
                          "--", "sh", "-c", "echo from-argv")
    assert submitted.returncode == 0, submitted.stderr
    job_id = json.loads(submitted.stdout)["id"]
    assert "from-argv" in stack.e31("logs", job_id).stdout
    assert "from-argv" in stack.e31("logs", job_id, "--follow").stdout
    assert "from-argv" in json.loads(stack.e31("logs", job_id, "--json").stdout)["logs"]["1"]


def test_wait_exits_non_zero_when_the_job_failed(stack: Stack) -> None:
    job_id = stack.e31("submit", "--gpus", "0", "--", "sh", "-c", "exit 4").stdout.strip()
    waited = stack.e31("wait", job_id)
    assert waited.returncode == 1
    assert "exited with code 4" in waited.stderr


def test_a_bad_spec_is_one_line_on_stderr_and_exit_code_2(stack: Stack) -> None:
    before = len(json.loads(stack.e31("ls", "--json", "--limit", "1000").stdout))
    refused = stack.e31("submit", "-e", "e2ejobs:where", "--priority", "42")
    assert refused.returncode == 2
    assert refused.stderr.strip().count("\n") == 0
    assert "priority" in refused.stderr
    assert len(json.loads(stack.e31("ls", "--json", "--limit", "1000").stdout)) == before


def test_usage_shows_jobs_by_state_and_gpu_seconds_per_class(stack: Stack) -> None:
    job_id = stack.e31("submit", "-e", "e2ejobs:timed", "-p", "seconds=0.5",
                       "--gpu-mem", "20").stdout.strip()
    assert stack.e31("wait", job_id).returncode == 0
    status = json.loads(stack.e31("status", job_id, "--json").stdout)

    rows = json.loads(stack.e31("usage", "--json").stdout)

    gpu24 = next(r for r in rows if r["size_class"] == "gpu24")
    assert gpu24["tenant"] == "default" and gpu24["jobs"]["succeeded"] >= 1
    assert gpu24["gpu_seconds"] >= status["gpu_seconds"] >= 0.5
    assert gpu24["queued_seconds"] >= 0
    assert "gpu-seconds" in stack.e31("usage").stdout
