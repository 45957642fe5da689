"""What a new user of `e31` sees in the first hour (issue 32, its rough edges 1, 3, 5 and 7):
`J=$(e31 submit --wait …)` holds the id alone, a token the API refuses or no API known at
all is the user's setup (exit 2, as `e31 --help`'s table says), `e31 gc --older-than 0`
is refused saying what to give instead, and `e31 status` shows an attempt's error whole.

The commands run in-process with typer's CliRunner against a stand-in for the client
(`e31.client.Client` replaced), as tests/unit/test_cli_flags.py does; `main()` itself, where
the exit code is made, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import e31.client
from e31.cli import app
from e31.cli.common import EXIT_CODES, EXIT_FAILED, EXIT_INPUT, EXIT_UNAVAILABLE
from e31.core.errors import ClientError, JobFailed

JOB_ID = "j-" + "0" * 20


class FakeClient:
    """The client as `submit --wait` and `ls` use it: a job that ends as told, or a refusal."""

    def __init__(self, *, ends: dict[str, Any] | None = None,
                 refused: ClientError | None = None) -> None:
        self.ends = ends or {"state": "succeeded", "result": None}
        self.refused = refused
        self.last_bundles: list[Any] = []

    def _wait(self, timeout: float | None = None, progress: bool = False) -> dict[str, Any]:
        if self.ends["state"] != "succeeded":
            raise JobFailed(self.ends)
        return self.ends

    def submit(self, body: dict[str, Any]) -> Any:
        return types.SimpleNamespace(id=JOB_ID, wait=self._wait)

    def get(self, job_id: str) -> Any:
        return types.SimpleNamespace(status=lambda: self.ends)

    def list(self, **_: Any) -> list[dict[str, Any]]:
        if self.refused is not None:
            raise self.refused
        return []


def _with(monkeypatch: pytest.MonkeyPatch, fake: FakeClient) -> FakeClient:
    monkeypatch.setattr(e31.client, "Client", lambda: fake)
    return fake


def test_submit_wait_prints_the_id_alone_on_stdout_and_the_outcome_on_stderr(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a job that succeeds with no result (issue 32: `J=$(…)` got "j-… succeeded:
    # null")
    _with(monkeypatch, FakeClient())
    # When it is submitted with --wait
    done = CliRunner().invoke(app, ["submit", "-e", "pkg.mod:main", "--wait"])
    # Then stdout is the id alone, and the outcome is on stderr
    assert done.exit_code == 0, done.output
    assert done.stdout == f"{JOB_ID}\n"
    assert f"{JOB_ID} succeeded: null" in done.stderr


def test_submit_wait_of_a_failed_job_still_gives_the_id_and_exits_1(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _with(monkeypatch, FakeClient(ends={"id": JOB_ID, "state": "failed", "reason": "error",
                                        "error": "boom"}))
    done = CliRunner().invoke(app, ["submit", "-e", "pkg.mod:main", "--wait"])
    assert done.exit_code == EXIT_FAILED
    assert done.stdout == f"{JOB_ID}\n"
    assert "error" in done.stderr


def test_submit_wait_json_is_the_status_alone_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    _with(monkeypatch, FakeClient(ends={"id": JOB_ID, "state": "succeeded", "result": 1}))
    done = CliRunner().invoke(app, ["submit", "-e", "pkg.mod:main", "--wait", "--json"])
    assert done.exit_code == 0, done.output
    assert done.stdout.startswith("{") and f'"id": "{JOB_ID}"' in done.stdout


def test_submit_help_says_where_wait_prints_what() -> None:
    shown = CliRunner().invoke(app, ["submit", "--help"], env={"COLUMNS": "200"})
    assert "the id alone on stdout, the outcome on stderr" in " ".join(shown.output.split())


@pytest.mark.parametrize(("status_code", "code"), [(401, EXIT_INPUT), (403, EXIT_INPUT),
                                                   (503, EXIT_UNAVAILABLE)])
def test_a_token_the_api_refuses_is_exit_2_an_outage_3(monkeypatch: pytest.MonkeyPatch,
                                                        status_code: int, code: int) -> None:
    # Given an API that answers 401 (a revoked, unknown or expired token), 403, or 503
    _with(monkeypatch, FakeClient(refused=ClientError("refused", status_code=status_code)))
    # When a user lists their jobs
    done = CliRunner().invoke(app, ["ls"])
    # Then a refusal is theirs to fix (2), an outage is not (3)
    assert done.exit_code == code, done.output


def test_no_api_address_or_token_is_exit_2_in_one_line(tmp_path: Path) -> None:
    # Given a shell with no E31_URL/E31_TOKEN and a home with no profile of `e31 up`
    env = {k: v for k, v in os.environ.items() if not k.startswith("E31_")}
    env["E31_HOME"] = str(tmp_path)
    # When a user runs a job command, and `e31 top --once`
    for args in (["ls"], ["top", "--once"], ["secret", "list"], ["token", "list"]):
        done = subprocess.run([sys.executable, "-m", "e31.cli", *args], env=env,
                              capture_output=True, text=True, timeout=60)
        # Then it says so in one line, with exit 2 (their setup), not 3 (an outage)
        assert done.returncode == EXIT_INPUT, (args, done.stderr)
        assert done.stderr.startswith("error: no API address or token"), (args, done.stderr)
        assert done.stderr.count("\n") == 1


def test_the_help_table_says_2_for_a_refused_token_and_no_api() -> None:
    meaning = dict(EXIT_CODES)[EXIT_INPUT]
    assert "401" in meaning and "no API address or token" in meaning


def test_gc_older_than_0_is_refused_saying_what_to_give(tmp_path: Path) -> None:
    # When `e31 gc --older-than 0` runs (issue 32: it said "artifacts are kept forever")
    for days in ("0", "-1"):
        done = CliRunner().invoke(app, ["gc", "--older-than", days, "--home", str(tmp_path)])
        # Then it is refused with exit 2, naming the flag that takes every ended job
        assert done.exit_code == EXIT_INPUT, done.output
        said = " ".join(done.stderr.split())
        assert f"--older-than {days}: must be a number of days above 0" in said
        assert "--older-than 0.001 takes every job that ended more than 86 s ago" in said
        # and nothing was opened: no store was made in the home
        assert not any(tmp_path.iterdir())


def test_status_shows_an_attempts_error_whole_off_a_terminal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a job whose lost attempt's error is longer than the 80 characters it was cut to
    error = ("worker gpu0@node7 went silent (no heartbeat for 2.0 s): its node died or was cut "
             "off; the job was queued again on the pool's account (infra_retries 1 of 3)")
    attempt = {"n": 1, "worker": "gpu0@node7", "gpus": "0", "started_at": "2026-12-06T01:00:00",
               "setup_s": None, "ended_at": "2026-12-06T01:00:09", "reason": "lost",
               "error": error}
    _with(monkeypatch, FakeClient(ends={"id": JOB_ID, "state": "queued", "attempts": [attempt]}))
    # When its status is printed to a pipe (CliRunner's output is not a terminal)
    done = CliRunner().invoke(app, ["status", JOB_ID], env={"COLUMNS": ""})
    # Then the error is there whole (issue 32: cut at 80 characters even at 300 columns)
    assert done.exit_code == 0, done.output
    assert error in done.output, done.output
