"""More of what a new user of `e31` sees in the first hour (issue 32, rough edges 9, 11, 12 and
17): a footage dry run's plan in text, what to do about a `source` outside the pool's input
roots, a tenant's limits in every tenant command, and `e31 top`'s word on simulated GPUs.

The commands run in-process with typer's CliRunner against a stand-in for the client
(`e31.client.Client` replaced), as tests/unit/test_cli_first_hour.py does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import e31.client
from e31.cli import app
from e31.core.bundles import file_input_path
from e31.core.errors import SpecForbidden
from e31.ops.fanout import plan

# A footage dry run's answer as the API gives it (e31.api.services.fanout.FanoutService.dry_run)
FOOTAGE_PLAN = {"dry_run": True, "name": "footage-yard", "fanout": {
    "items": 3, "total_frames": 150, "files": [
        {"name": "yard.mp4", "kind": "video", "url": "file:///data/yard.mp4",
         "duration_s": 120.5, "items": [0, 1]},
        {"name": "[gate].jpg", "kind": "image", "url": "file:///data/[gate].jpg",
         "items": [2]}]}}


class PlanningClient:
    """The client as `submit --dry-run` uses it: the API's answer is given."""

    def __init__(self, answer: dict[str, Any]) -> None:
        self.answer = answer
        self.last_bundles: list[Any] = []

    def dry_run(self, body: dict[str, Any]) -> dict[str, Any]:
        return {**self.answer, "uploads": []}


def test_a_footage_dry_run_prints_its_plan_in_text(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given the API's plan of a footage source: 3 chunk jobs over a video and an image
    monkeypatch.setattr(e31.client, "Client", lambda: PlanningClient(FOOTAGE_PLAN))

    # When it is dry-run without --json
    done = CliRunner().invoke(app, ["submit", "--dry-run", "-w", "footage",
                                    "-p", "source=/data"])

    # Then the text holds the chunks, files and frames, and each file with its chunks
    assert done.exit_code == 0, done.output
    rows = [" ".join(line.split()) for line in done.stdout.splitlines()]
    for row in ("chunks 3 jobs, then one merge job", "files 2", "frames 150",
                "file yard.mp4 (video, 120.5 s, 2 chunks)", "file [gate].jpg (image, 1 chunk)",
                "dry run: nothing was submitted or uploaded"):
        assert row in rows, done.stdout


@pytest.mark.parametrize("roots", [(), ("/srv/footage",)], ids=["no roots", "roots elsewhere"])
def test_a_local_source_the_pool_may_not_read_says_what_to_do(roots: tuple[str, ...],
                                                              tmp_path: Path) -> None:
    # Given a footage source in the user's own directory, outside the pool's input roots
    (tmp_path / "cams").mkdir()

    # When it is planned (what the API does at submit)
    with pytest.raises(SpecForbidden) as refused:
        plan({"source": str(tmp_path / "cams")}, roots=roots, probe=lambda url: 1.0)

    # Then the refusal names the field and what to do, and no upload that never happens
    error = refused.value.errors[0]
    assert error["field"] == "params.source"
    assert "which the client uploads" not in error["reason"]
    assert ("nothing is uploaded: start the pool with E31_INPUT_FILE_ROOTS naming a directory "
            "above it (on one machine: E31_INPUT_FILE_ROOTS=/that/dir e31 up), or give an "
            "s3:// or http(s):// URL") in error["reason"]
    assert (str(tmp_path / "cams") in error["reason"]) == bool(roots)


def test_a_file_input_outside_the_roots_still_says_a_local_path_is_uploaded() -> None:
    # A job's file:// input (not a footage source): its other way is a local path, uploaded
    with pytest.raises(ValueError, match="give a local path, which the client uploads"):
        file_input_path("file:///home/me/data.csv", ())


def test_tenant_create_update_list_and_show_each_print_the_limits(tmp_path: Path) -> None:
    # Given this machine's store (SQLite in a fresh home), no API
    env = {"E31_HOME": str(tmp_path), "E31_DATABASE_URL": "", "E31_URL": "", "E31_TOKEN": ""}

    def e31(*args: str) -> str:
        done = CliRunner().invoke(app, list(args), env=env)
        assert done.exit_code == 0, done.output
        return done.stdout

    # When a tenant is created with a limit, then given another
    created = e31("tenant", "create", "team-a", "--limit", "max_queued=50")
    updated = e31("tenant", "update", "team-a", "--limit", "max_priority=7")

    # Then each command's text names the limits (update printed only the weight before)
    assert created.startswith("tenant team-a created (weight 1, limits max_queued=50);")
    limited = "tenant team-a: weight 1, limits max_priority=7, max_queued=50"
    assert updated.strip() == limited
    assert e31("tenant", "list").strip() == limited
    assert e31("tenant", "show", "team-a").strip() == limited


def test_a_missing_config_file_is_an_error_for_the_job_commands_too(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Given E31_CONFIG naming a file that is not there (and an API a user could reach)
    monkeypatch.setenv("E31_CONFIG", str(tmp_path / "nonexistent.toml"))
    monkeypatch.setenv("E31_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("E31_TOKEN", "e31_x")

    # When a job command runs
    result = CliRunner().invoke(app, ["ls"])

    # Then it refuses, as the operator commands do: the user's setup to fix (exit 2)
    assert result.exit_code == 2, result.output
    assert "E31_CONFIG: no such file" in result.output


def test_top_names_simulated_gpus_only_when_one_is_shown() -> None:
    # Given a snapshot with a simulated GPU, and the same pool with a real one
    from rich.console import Console

    from e31.cli.top import render
    gpu = {"node": "vm", "worker": "gpu0@vm", "gpu": "0", "size_class": "gpu24",
           "state": "idle", "job": None, "utilization": 0.0, "memory_used_bytes": None,
           "memory_total_bytes": None, "temperature_celsius": None, "power_watts": None,
           "simulated": True}
    gpu24 = {"size_class": "gpu24", "slot_kind": "gpu", "workers": 1, "gpus": 1,
             "busy_gpus": 0, "idle_gpus": 1, "draining_gpus": 0, "lost_gpus": 0,
             "utilization": 0.0, "memory_used_bytes": None, "memory_total_bytes": None,
             "queued": 0, "running": 0, "oldest_queued_s": None}

    def shown(simulated: bool) -> str:
        console = Console(width=200, record=True)
        console.print(render({"at": "now", "classes": [gpu24], "running": [], "others": [],
                              "gpus": [{**gpu, "simulated": simulated}]}))
        return console.export_text()

    # Then only the first ends saying its readings are made up; both count 1 GPU slot
    assert shown(True).rstrip().endswith("at now; GPU sim: simulated, its readings made up")
    assert shown(False).rstrip().endswith("at now")
    assert "1 GPU" in shown(False)


class UsageClient:
    """The client as `e31 usage` uses it: one report, the tenant's rows and newest batches."""

    def usage_report(self, *, all_tenants: bool) -> dict[str, Any]:
        return {"usage": [{"tenant": "acme", "size_class": "gpu24", "jobs": {"succeeded": 3},
                           "gpu_seconds": 12.5, "run_seconds": 12.5, "queued_seconds": 1.0}],
                "batches": [{"batch": "batch_7f3a", "tenant": "acme", "status": "completed",
                             "requests": 40, "completed": 39, "failed": 1,
                             "prompt_tokens": 1234, "completion_tokens": 567,
                             "gpu_seconds": 8.25}]}


def test_usage_prints_the_batches_in_text(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a tenant with jobs and one batch of requests (the doc-following run found
    # `e31 usage --batches` printing nothing in text: the rows were read, never shown)
    monkeypatch.setattr(e31.client, "Client", UsageClient)
    monkeypatch.setenv("COLUMNS", "200")

    # When the user asks for the batches alone, then for the whole report
    only = CliRunner().invoke(app, ["usage", "--batches"])
    whole = CliRunner().invoke(app, ["usage"])

    # Then --batches shows the batch's row (its id, requests and tokens), not the jobs' table
    assert only.exit_code == 0, only.output
    assert "batch_7f3a" in only.output and "1234" in only.output and "567" in only.output
    assert "queued s" not in only.output
    # And the plain report shows both tables, as its help says
    assert whole.exit_code == 0, whole.output
    assert "queued s" in whole.output and "batch_7f3a" in whole.output


def test_up_detached_reads_only_its_own_runs_ready_line(tmp_path: Path) -> None:
    # Given an up.log whose earlier run said it was ready (the doc-following run saw `e31 up -d`
    # print that line, with the earlier run's ports, when its state file said ready first)
    from e31.cli.stack import _ready_line
    log = tmp_path / "up.log"
    log.write_text("E31 Batch is ready: API http://127.0.0.1:41001, Flower off.\nstopped\n")
    start = log.stat().st_size

    # When this run has not printed its line yet, then when it has
    before = _ready_line(log, start)
    with log.open("a") as f:
        f.write("E31 Batch is ready: API http://127.0.0.1:42002, Flower off.\n")

    # Then the earlier run's line is never taken for this run's; this run's is
    assert before is None
    assert _ready_line(log, start) == "E31 Batch is ready: API http://127.0.0.1:42002, Flower off."
