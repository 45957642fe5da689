"""The `e31` command is complete and consistent (issue 17): a `submit` flag for every spec
field, help on every option naming its environment variable, `--version`, the exit-code table
the same in `e31 --help` and docs/operations.md, and the edges a user hit first (a spec with
NaN, cut ids, a missing attempt, `result --json` of a failed job, a workload's name).

The commands run in-process with typer's CliRunner against a plain stand-in for the client
(`e31.client.Client` replaced): what is checked here is what the CLI sends and prints. The
same commands against a real stack are in tests/e2e/test_cli.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, get_args

import pytest
import typer
from pydantic import BaseModel
from typer.testing import CliRunner

import e31.client
from e31.cli import app, jobs
from e31.cli.common import EXIT_CODES, EXIT_FAILED, EXIT_INPUT
from e31.core.errors import JobFailed
from e31.core.spec import JobSpec

DOCS = Path(__file__).resolve().parents[2] / "docs"
JOB_ID = "j-" + "0" * 20
DIGEST = "sha256:" + "ab" * 32
BASE = ["-e", "pkg.mod:main"]

# Each spec field (a dotted path into JobSpec) -> the submit arguments that set it, and the
# value the spec then holds. A new spec field fails test_every_spec_field_has_a_submit_flag
# until it has a flag here and in `e31 submit`.
FLAGS: dict[str, tuple[list[str], Any]] = {
    "name": (["--name", "n1"], "n1"),
    "entrypoint": (["-e", "pkg.other:fn"], "pkg.other:fn"),
    "params": (["-p", "a=1", "-p", "b=x"], {"a": 1, "b": "x"}),
    "env": (["--env", "A=1"], {"A": "1"}),
    "resources.gpus": (["--gpus", "2"], 2),
    "resources.gpu_mem_gb": (["--gpu-mem", "40"], 40.0),
    "resources.size_class": (["--size-class", "gpu80"], "gpu80"),
    "resources.mem_gb": (["--mem-gb", "8"], 8.0),
    "resources.disk_gb": (["--disk-gb", "200"], 200.0),
    "resources.on_oom": (["--on-oom", "next_class"], "next_class"),
    "allow_pending": (["--allow-pending"], True),
    "preemptible": (["--preemptible"], True),
    "timeout_s": (["--timeout", "60"], 60.0),
    "retries.max": (["--retries", "3"], 3),
    "retries.backoff_s": (["--backoff", "5"], 5.0),
    "retries.backoff_max_s": (["--backoff-max", "120"], 120.0),
    "retries.max_lost": (["--max-lost", "5"], 5),
    "priority": (["--priority", "7"], 7),
    "workload": (["-w", "train"], "train"),
    "after": (["--after", JOB_ID, "--after", "a-" + "1" * 20], [JOB_ID, "a-" + "1" * 20]),
    "python.pip": (["--pip", "tqdm==4.66", "--pip", "rich"], ["tqdm==4.66", "rich"]),
    "python.requirements": (["--requirements", "req.txt", "--code", DIGEST], "req.txt"),
    "code": (["--code", DIGEST], DIGEST),
    "inputs": (["--input", "data=s3://bucket/key"], {"data": "s3://bucket/key"}),
    "network": (["--network", "none"], "none"),
    "idle_timeout_s": (["--idle-timeout", "300"], 300),
    "on_idle": (["--on-idle", "kill"], "kill"),
    "secrets": (["--secret", "HF_TOKEN", "--secret", "WANDB_KEY"], ["HF_TOKEN", "WANDB_KEY"]),
}
# Spec fields without a flag of their own, and why.
EXCLUDED = {
    "command": "the argv after `--`: e31 submit -- python train.py (tests/e2e/test_cli.py)",
}


def spec_fields(model: type[BaseModel] = JobSpec, prefix: str = "") -> list[str]:
    """Every leaf field of the spec as a dotted path; a nested model's fields, not the model."""
    paths = []
    for name, info in model.model_fields.items():
        nested = [t for t in (info.annotation, *get_args(info.annotation))
                  if isinstance(t, type) and issubclass(t, BaseModel)]
        paths += spec_fields(nested[0], f"{prefix}{name}.") if nested else [prefix + name]
    return paths


class FakeClient:
    """The client as submit, ls, logs and result use it: what was sent, canned answers."""

    def __init__(self, *, jobs_listed: list[dict[str, Any]] | None = None,
                 status: dict[str, Any] | None = None) -> None:
        self.sent: dict[str, Any] | None = None
        self.jobs_listed = jobs_listed or []
        self.last_bundles: list[Any] = []
        self.status = status

    def dry_run(self, body: dict[str, Any]) -> dict[str, Any]:
        self.sent = body
        return {"name": body.get("name"), "uploads": []}

    def list(self, **_: Any) -> list[dict[str, Any]]:
        return self.jobs_listed

    def get(self, job_id: str) -> Any:
        status = self.status
        assert status is not None

        def result() -> Any:
            raise JobFailed(status)

        return types.SimpleNamespace(
            id=job_id, status=lambda: status, result=result,
            log_chunks=lambda attempt=None, offset=0: iter([b"line\n"]))


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> FakeClient:
    fake = FakeClient()
    monkeypatch.setattr(e31.client, "Client", lambda: fake)
    return fake


def invoke(*args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(app, list(args), env=env)


def at(body: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        body = body[part]
    return body


def test_every_spec_field_has_a_submit_flag_or_a_reason_why_not() -> None:
    fields = set(spec_fields())
    missing = fields - set(FLAGS) - set(EXCLUDED)
    assert not missing, f"spec fields without an `e31 submit` flag: {sorted(missing)}"
    assert set(FLAGS) <= fields | {"secrets"}, "a flag for a field the spec does not have"


@pytest.mark.parametrize("path", sorted(FLAGS))
def test_each_flag_sets_its_spec_field_to_a_valid_spec(client: FakeClient, path: str) -> None:
    if path not in spec_fields():
        pytest.skip(f"the spec has no {path} field yet")
    args, value = FLAGS[path]
    base = [] if path in ("entrypoint", "workload") else BASE

    # When submit runs with the flag (a dry run: nothing would be stored)
    result = invoke("submit", "--dry-run", "--json", *base, *args)

    # Then the body it sends holds the value at the field, and is a spec the API takes
    assert result.exit_code == 0, result.output
    assert client.sent is not None and at(client.sent, path) == value
    JobSpec.parse(client.sent)


def test_every_option_has_help_and_names_its_environment_variable() -> None:
    # Given every option of every command, sub-group included
    bare, unnamed = [], []

    def walk(command: Any, path: str) -> None:
        for param in command.params:
            if param.param_type_name != "option":
                continue
            where = f"{path} {'/'.join(param.opts)}"
            if not param.help:
                bare.append(where)
            for var in [param.envvar] if isinstance(param.envvar, str) else param.envvar or []:
                if f"[env {var}" not in param.help and f"env {var}]" not in param.help:
                    unnamed.append(f"{where} ({var})")
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, f"{path} {name}")

    walk(typer.main.get_command(app), "e31")

    # Then each has help text, and one an environment variable sets says which
    assert not bare, f"options without help: {bare}"
    assert not unnamed, f"options whose help does not name their variable: {unnamed}"


def test_version_prints_e31_and_the_version() -> None:
    from e31 import __version__
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.output.strip() == f"e31 {__version__}"
    assert re.fullmatch(r"e31 \d+\.\d+\.\d+", result.output.strip())


def table_in(text: str) -> dict[int, str]:
    """The exit-code rows of `text`: `  N    meaning` lines (help) or `| N | meaning |` rows."""
    rows = re.findall(r"^\s{2,}(\d+)\s{2,}(\S.*?)\s*$", text, re.M) or \
        re.findall(r"^\| `?(\d+)`? \| (.*?) \|", text, re.M)
    return {int(code): meaning.strip() for code, meaning in rows}


def test_the_exit_code_table_is_the_same_in_the_help_and_the_docs() -> None:
    # Given the table `e31 --help` ends with and the one in docs/operations.md
    help_text = invoke("--help").output.split("Exit codes", 1)[1]
    docs = (DOCS / "operations.md").read_text()
    section = docs.split("## Exit codes", 1)[1].split("\n## ", 1)[0]

    # Then both hold every code the CLI uses, with the same meaning
    assert table_in(help_text) == dict(EXIT_CODES)
    assert table_in(section) == dict(EXIT_CODES)


def test_a_spec_with_nan_is_one_line_and_exit_2(client: FakeClient, tmp_path: Path) -> None:
    # Given a spec whose params hold YAML's .nan, and a flag's NaN
    spec = tmp_path / "job.yaml"
    spec.write_text("entrypoint: pkg.mod:main\nparams: {a: .nan}\n")

    # When they are submitted
    from_file = invoke("submit", str(spec))
    from_flag = invoke("submit", *BASE, "-p", "b=[1, -Infinity]")

    # Then each is refused in one line that names the field, with exit 2, and nothing sent
    assert from_file.exit_code == EXIT_INPUT and from_flag.exit_code == EXIT_INPUT
    assert from_file.output.strip().count("\n") == 0
    assert "params.a" in from_file.output and "params.b[1]" in from_flag.output
    assert client.sent is None


def test_ls_never_cuts_an_id_in_a_narrow_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given jobs with long names, listed in a 60-column terminal
    listed = [{"id": f"j-{i:020x}", "name": "a-rather-long-job-name-" * 3, "state": "succeeded",
               "size_class": "gpu24", "submitted_at": "2026-01-01T00:00:00+00:00",
               "gpu_seconds": 1.5, "gpus": 1, "priority": 5, "reason": "succeeded"}
              for i in range(3)]
    monkeypatch.setattr(e31.client, "Client", lambda: FakeClient(jobs_listed=listed))
    monkeypatch.setattr(jobs.out, "_width", 60)

    # When they are listed, plain and --wide
    plain, wide = invoke("ls"), invoke("ls", "--wide")

    # Then every id is there whole with its state; the plain list fits the terminal (the
    # name gave way) and the wide one has every column and the whole name
    assert plain.exit_code == 0 and wide.exit_code == 0, plain.output + wide.output
    for job in listed:
        assert re.search(rf"^{job['id']} .* succeeded ", plain.output, re.M), plain.output
        assert f"{job['id']}  {job['name']}" in wide.output, wide.output
    assert max(len(line.rstrip()) for line in plain.output.splitlines()) <= 60
    assert "priority" in wide.output and "priority" not in plain.output


def test_logs_of_an_attempt_the_job_does_not_have_is_exit_2(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a finished job with one attempt
    status = {"id": JOB_ID, "state": "succeeded", "attempts": [{"n": 1, "ended_at": "x"}]}
    monkeypatch.setattr(e31.client, "Client", lambda: FakeClient(status=status))

    # When its fifth attempt's log is asked for
    result = invoke("logs", JOB_ID, "--attempt", "5")

    # Then that is an error naming how many it has, not an empty log and exit 0
    assert result.exit_code == EXIT_INPUT
    assert f"job {JOB_ID} has 1 attempt" in result.output
    assert invoke("logs", JOB_ID, "--attempt", "1").output == "line\n"


def test_result_json_of_a_failed_job_prints_its_status_and_exits_1(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a failed job
    status = {"id": JOB_ID, "state": "failed", "reason": "error", "error": "exited with code 4",
              "attempts": []}
    monkeypatch.setattr(e31.client, "Client", lambda: FakeClient(status=status))

    # When a script asks for its result as JSON
    result = CliRunner().invoke(app, ["result", JOB_ID, "--json"])

    # Then stdout is the status JSON with the reason and error, and the exit code is 1
    assert result.exit_code == EXIT_FAILED
    printed = json.loads(result.stdout)
    assert printed["reason"] == "error" and printed["error"] == "exited with code 4"


def test_a_workload_job_is_named_after_the_workload_unless_named(client: FakeClient) -> None:
    assert invoke("submit", "--dry-run", "-w", "train").exit_code == 0
    assert client.sent is not None and client.sent["name"] == "train"
    assert invoke("submit", "--dry-run", "-w", "train", "--name", "mine").exit_code == 0
    assert client.sent["name"] == "mine"


def test_db_upgrade_and_down_print_json_a_script_reads(tmp_path: Path) -> None:
    # Given a fresh home (a SQLite store in it) and no stack running from it
    env = {"E31_HOME": str(tmp_path), "E31_DATABASE_URL": ""}

    # When the store is migrated and the stack stopped, each with --json
    upgraded = CliRunner().invoke(app, ["db", "upgrade", "--json"], env=env)
    stopped = CliRunner().invoke(app, ["down", "--json"], env=env)

    # Then each prints one JSON document: the revision reached, and that nothing ran
    assert upgraded.exit_code == 0, upgraded.output
    assert re.fullmatch(r"\d{4}\w*", json.loads(upgraded.stdout)["revision"])
    assert stopped.exit_code == 0, stopped.output
    assert json.loads(stopped.stdout) == {"stopped": False, "home": str(tmp_path)}


def test_up_json_says_where_the_stack_listens_and_holds_no_secret(tmp_path: Path) -> None:
    from e31.cli import stack
    from e31.edge.settings import Settings
    profile = {"url": "http://127.0.0.1:8031", "token": "e31_secret", "flower_password": "pw",
               "flower_url": "http://127.0.0.1:5555", "redis_url": "redis://:pw@127.0.0.1:1/0"}
    line = json.dumps(stack._ready(Settings(home=tmp_path), profile))
    assert json.loads(line)["url"] == "http://127.0.0.1:8031"
    assert "secret" not in line and "pw" not in line


def test_a_flag_click_refuses_is_one_line_and_exit_2() -> None:
    # When `e31` (its main(), as the shell runs it) gets a flag no command has
    done = subprocess.run([sys.executable, "-m", "e31.cli", "submit", "--no-such-flag"],
                          capture_output=True, text=True, timeout=60)

    # Then it says so in one line naming the flag and where to look, with exit 2
    assert done.returncode == EXIT_INPUT and done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith("error: No such option: --no-such-flag (see ")


def test_status_and_queue_say_why_there_is_no_estimate_and_that_the_broker_is_down(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a job held by a quota of 0, and a queue view read while Redis was down
    pending = {"reason": "quota", "detail": "gpu24", "position": None, "estimated_start": None,
               "text": "tenant quota for gpu24 is 0 GPUs and the job needs 1: it starts only "
                       "after an admin raises the quota",
               "no_estimate": "the tenant's gpu24 quota (0 GPUs) is below what it needs"}
    status = {"id": JOB_ID, "state": "queued", "queue": "e31.gpu24", "attempts": [],
              "pending": pending}
    view = {"broker": "unreachable", "tenants": [], "drained": [],
            "classes": [{"size_class": "gpu24", "gpus": 0, "busy_gpus": 0, "queued": 1,
                         "tenants": [], "isolation": []}]}
    fake = FakeClient(status=status)
    fake.queue = lambda: view  # type: ignore[attr-defined]
    monkeypatch.setattr(e31.client, "Client", lambda: fake)

    # When its status and the queue are shown
    shown = CliRunner().invoke(app, ["status", JOB_ID])
    queued = CliRunner().invoke(app, ["queue"])

    # Then the estimate says none and why; the queue shows unknown GPUs, not zero, and why
    assert "estimated start  none: the tenant's gpu24 quota (0 GPUs)" in shown.output
    row = next(line for line in queued.stdout.splitlines() if "gpu24" in line)
    assert [cell for cell in row.split() if cell != "│"][:4] == ["gpu24", "?", "?", "1"]
    assert "broker (Redis) is unreachable" in queued.stderr


def test_result_of_a_job_still_running_is_exit_2_and_says_to_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a running job (no result yet)
    status = {"id": JOB_ID, "state": "running", "attempts": [{"n": 1, "ended_at": None}]}
    monkeypatch.setattr(e31.client, "Client", lambda: FakeClient(status=status))

    # When its result is asked for
    result = invoke("result", JOB_ID)

    # Then that is the caller's to fix (wait first), not an unavailable service
    assert result.exit_code == EXIT_INPUT
    assert f"job {JOB_ID} is running: no result yet (e31 wait {JOB_ID}" in result.output


def test_a_workload_submitted_from_python_is_named_after_it_too() -> None:
    assert JobSpec.parse({"workload": "train"}).display_name == "train"
    assert JobSpec.parse({"workload": "train", "name": "mine"}).display_name == "mine"
    assert JobSpec.parse({"entrypoint": "pkg.mod:main"}).display_name == "main"
