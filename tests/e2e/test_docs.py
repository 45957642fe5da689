"""README.md and docs/ as a reader follows them (issue 17): the blocks a reader is meant to
run are run against a real stack, and the output they show is compared (tests/docblocks.py
says how a page marks them). A shell block with no mark fails
`test_every_shell_block_is_run_or_says_why_not`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from e31.local.redisserver import free_port
from tests.conftest import wait_for
from tests.docblocks import (
    ROOT,
    Block,
    Ran,
    console_steps,
    doc,
    doc_paths,
    output_contains,
    output_matches,
    python_shown_output,
    run_block,
    run_command,
    unmarked_shell_blocks,
)

from .conftest import JOBS_DIR, Stack

# Starting a stack (the session's, or one of its own) counts against the first test that
# uses it: on a busy 2-core machine that alone can take 100 s.
STACK_TEST_TIMEOUT_S = 400

# Every `e31-test=<step>` mark, by page, and the test that runs it (this file, or
# test_runbooks.py): a mark no test runs, or a step a test runs that the page lost, fails.
RUN_STEPS = {
    "README.md": {"tour-up", "tour", "tour-refused",
                  "functions"},                    # functions: test_functions.py
    "docs/notebooks.md": {"functions-tour", "functions-failed"},   # test_functions.py
    "docs/workloads.md": {"inference", "train", "forty-hours", "forty-hours-cli",
                          "openai-batch", "batch-cli"},   # test_llm_batches.py
    "docs/scheduling.md": {"tenants"},
    "docs/jobs.md": {"dry-run", "refused", "byo", "byo-python", "wait-timeout", "sweeps",
                     "sweep-refused", "idle"},    # idle: test_runbooks.py, with E31JobsIdle
    "docs/operations.md": {"heartbeat", "metrics", "top", "promtool", "gc",
                           "xid",                    # xid: test_runbooks.py, with XID's drain
                           "celery"},                # celery: test_celery_app.py
    "docs/reliability.md": {"resume"},
    "docs/security.md": {"too-large", "log-chunk", "secrets"},
    "docs/runbooks/drain-a-worker.md": {"drain", "verify", "undrain"},
    "docs/runbooks/redis-restart.md": {"verify"},
    "docs/runbooks/database-migrations.md": {"upgrade"},
    "docs/runbooks/stuck-queued-job.md": {"diagnose", "fix"},
    "docs/runbooks/worker-node-down.md": {"check"},
    "docs/runbooks/E31ClassWithoutWorkers.md": {"confirm"},
    "docs/runbooks/E31GpuXidError.md": {"confirm", "undrain"},
    "docs/runbooks/E31GpuEccErrors.md": {"drain", "undrain", "owners"},
    "docs/runbooks/E31MetricsDown.md": {"embedded"},
    "docs/runbooks/E31SchedulerNotTicking.md": {"confirm"},
    "docs/runbooks/E31BrokerErrors.md": {"confirm"},      # with redis-restart.md's test
    "docs/runbooks/E31PoolFaults.md": {"confirm"},
    "docs/runbooks/E31JobsFailedByPool.md": {"confirm"},
    "docs/runbooks/E31LeaseExpiriesRising.md": {"confirm"},
    "docs/runbooks/E31JobsIdle.md": {"confirm"},
    "docs/runbooks/store-outage.md": {"symptoms", "find", "verify", "embedded"},
    "docs/runbooks/artifact-retention.md": {"gc"},
    "docs/runbooks/rotate-a-token.md": {"rotate"},   # tests/e2e/test_runbook_rotate_token.py
    "docs/console.md": {"curl"},   # tests/e2e/test_console_browser.py
}

def _first_line(block: Block) -> str:
    return block.text.strip().partition("\n")[0].strip()


def _benchmark(block: Block) -> bool:
    """A block that only runs scripts of bench/ (and installs what they need): run on demand,
    never by the tests, as docs/performance.md says of each."""
    lines = [line.strip() for line in block.text.splitlines()
             if line.strip() and not line.strip().startswith("#")]
    return bool(lines) and all(line.startswith(("python bench/", "pip install"))
                               for line in lines)


def test_every_shell_block_is_run_or_says_why_not() -> None:
    unmarked = {(str(b.path), _first_line(b)) for b in unmarked_shell_blocks(doc_paths())
                if not _benchmark(b)}
    assert not unmarked, ("shell blocks neither marked e31-test (and run by a test) nor saying "
                          "'# not run by the tests: <why>' (tests/docblocks.py):\n"
                          + "\n".join(f"  {page}: {line}" for page, line in sorted(unmarked)))


def test_every_e31_test_mark_is_a_step_a_test_runs() -> None:
    marked: dict[str, set[str]] = {}
    for path in doc_paths():
        for block in doc(path).blocks:
            if block.run_name is not None:
                marked.setdefault(str(path), set()).add(block.run_name)
    assert marked == RUN_STEPS


def _env(st: Stack, **extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(Path(sys.executable).parent), st.env.get("PATH", "")])
    # COLUMNS: the CLI's lines as a wide terminal prints them, not wrapped at 80 columns
    return dict(st.env, PATH=path, COLUMNS="200", **extra)


def _at(st: Stack, command: str) -> str:
    """A page's command with the default address and home (`localhost:8031`, `~/.e31`) of
    `e31 up` replaced by the test stack's."""
    address = urlsplit(st.url).netloc
    return (command.replace("localhost:8031", address).replace("127.0.0.1:8031", address)
            .replace("~/.e31", str(st.home)))


def _steps(block: Block, env: dict[str, str], cwd: Path,
           st: Stack) -> list[tuple[str, list[str], Ran]]:
    """A console block's commands, one by one, as a reader types them (`cd` included)."""
    done = []
    for command, shown in console_steps(block):
        if command.startswith("cd "):
            cwd = cwd / command[3:].strip()
            continue
        done.append((command, shown, run_command(_at(st, command), env=env, cwd=cwd)))
    return done


def _workdir(tmp_path: Path) -> Path:
    """A reader's directory with the repository's examples/ (a copy: bundles are its tree)."""
    work = tmp_path / "work"
    shutil.copytree(ROOT / "examples", work / "examples",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return work


@pytest.mark.timeout(STACK_TEST_TIMEOUT_S)
def test_workloads_page_prints_what_it_shows(stack: Stack, tmp_path: Path) -> None:
    page = doc("docs/workloads.md")
    for step in ("inference", "train"):
        for block in page.run_blocks(step):
            ran = run_command(f"python3 - <<'PY'\n{block.text}PY", env=_env(stack), cwd=tmp_path,
                              timeout_s=400)
            assert ran.returncode == 0, f"{block.where}\n{ran.output}"
            shown = python_shown_output(block)
            assert output_matches(shown, ran.output), f"{block.where}: {shown}\n{ran.output}"


@pytest.mark.timeout(STACK_TEST_TIMEOUT_S)
def test_scheduling_page_tenant_commands(stack: Stack, tmp_path: Path) -> None:
    for block in doc("docs/scheduling.md").run_blocks("tenants"):
        for command, shown in console_steps(block):
            ran = run_command(command, env=_env(stack), cwd=tmp_path)
            assert ran.returncode == 0, f"{block.where}: {command}\n{ran.output}"
            if shown:
                assert output_matches(shown, ran.output), f"{command}\n{ran.output}"


@pytest.mark.timeout(2 * STACK_TEST_TIMEOUT_S)
def test_the_readme_tour(tmp_path: Path) -> None:
    """The tour as written, from `e31 up -d` on: a stack of its own, stopped at the end."""
    page = doc("README.md")
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("E31_")}
    env.update(E31_HOME=str(home), E31_API_PORT=str(free_port()),
               E31_FLOWER_PORT=str(free_port()), E31_HEARTBEAT_INTERVAL_S="0.5",
               E31_KILL_GRACE_S="2", E31_SCHEDULER_TICK_S="1",
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
               PYTHONPATH=os.pathsep.join([str(JOBS_DIR), os.environ.get("PYTHONPATH", "")]))
    work = tmp_path / "work"
    work.mkdir()
    (work / "examples").symlink_to(ROOT / "examples")
    try:
        [up] = page.run_blocks("tour-up")
        ran = run_block(up, env=env, cwd=work, timeout_s=300)
        assert ran.returncode == 0, ran.output
        assert "E31 Batch is ready: API http://127.0.0.1:" in ran.output
        done = re.search(r"(j-\w+) succeeded: .*\"greeting\": \"hello, world\"", ran.output)
        assert done, ran.output
        assert '"cuda_visible_devices": "1"' in ran.output     # the 48 GB one, as it says
        job = done.group(1)
        [tour] = page.run_blocks("tour")
        # The page's placeholder id `j-…` stands for a job of yours: this one.
        ran = run_command(tour.text.replace("j-…", job), env=env, cwd=work, timeout_s=400)
        assert ran.returncode == 0, ran.output
        assert (work / "out").is_dir()
        [refused] = page.run_blocks("tour-refused")
        for command, shown in console_steps(refused):
            ran = run_command(command, env=env, cwd=work)
            assert ran.returncode == 2, ran.output
            assert output_matches(shown, ran.output), f"{shown}\n{ran.output}"
    finally:
        run_command("e31 down", env=env, cwd=work, timeout_s=200)


@pytest.mark.timeout(STACK_TEST_TIMEOUT_S)
def test_jobs_page_commands(stack: Stack, tmp_path: Path) -> None:
    page, env, work = doc("docs/jobs.md"), _env(stack, TOKEN=stack.token), _workdir(tmp_path)
    # A dry run with the flags of every retry and resource field
    [dry] = page.run_blocks("dry-run")
    ran = run_block(dry, env=env, cwd=work)
    assert ran.returncode == 0, ran.output
    assert re.search(r"^ name +train *$", ran.output, re.M), ran.output
    assert "dry run: nothing was submitted" in ran.output

    # Refused specs: the CLI exits 2 in one line, the API answers 422 naming the field
    [refused] = page.run_blocks("refused")
    for command, shown, ran in _steps(refused, env, work, stack):
        assert ran.returncode == (2 if command.startswith("e31 ") else 0), ran.output
        assert output_matches(shown, ran.output), f"{command}: {shown}\n{ran.output}"

    # examples/byo: its result, and the second submit uploads nothing. Whether the first one
    # uploads its bundles depends on what the stack saw before (test_bundles.py sends the same
    # tree), so "uploaded (…)" stands for either answer.
    [byo] = page.run_blocks("byo")
    for command, shown, ran in _steps(byo, env, work, stack):
        assert ran.returncode == 0, f"{command}\n{ran.output}"
        shown = [re.sub(r" uploaded \(.*\)$", " …", line) for line in shown]
        assert output_contains(shown, ran.output), f"{command}: {shown}\n{ran.output}"

    # `e31 wait --timeout`: exit 4 while the job runs on (issue 17)
    [timeout] = page.run_blocks("wait-timeout")
    ran = run_block(timeout, env=env, cwd=work)
    assert ran.returncode == 0, ran.output
    assert re.search(r"error: job j-\w+ still (queued|running) after 1 s", ran.output), ran.output
    assert "exit 4" in ran.output

    # Sweeps, from a file with a base, a list, and --sweep over flags and over a spec file
    [sweeps] = page.run_blocks("sweeps")
    ran = run_block(sweeps, env=env, cwd=work)
    assert ran.returncode == 0, ran.output
    assert re.search(r"^a-\w+ succeeded, 4/4 done: 4 succeeded$", ran.output, re.M), ran.output
    assert re.search(r"^a-\w+ succeeded, 2/2 done: 2 succeeded$", ran.output, re.M), ran.output
    assert '"name": "greet-sweep"' in ran.output and '"total": 3' in ran.output

    # and one bad item refuses the whole array (names.yaml: the block above wrote it)
    [bad] = page.run_blocks("sweep-refused")
    for command, shown, ran in _steps(bad, env, work, stack):
        assert ran.returncode == 2, ran.output
        assert output_matches(shown, ran.output), f"{command}: {shown}\n{ran.output}"


def _header_words(lines: list[str]) -> list[list[str]]:
    """The words of a table's title and header lines (what does not change from run to run)."""
    heads = ("classes", "GPUs", "running", "class ", "node ", "job ")
    return [line.split() for line in lines if line.strip().startswith(heads)]


@pytest.mark.timeout(STACK_TEST_TIMEOUT_S)
def test_operations_page_commands(stack: Stack, tmp_path: Path) -> None:
    page = doc("docs/operations.md")
    env = _env(stack, E31_REDIS_URL=stack.redis_url)
    # The heartbeats in Redis, with the fields the page shows (of a node of this host)
    [beats] = page.run_blocks("heartbeat")
    (scan, _), (get, shown) = console_steps(beats)
    node = f"gpu1@{socket.gethostname()}"     # the page's gpu1@nodeA: this host's gpu48 node
    # (a stack is ready at its first worker's beat: this one's may come a moment later)
    wait_for(lambda: f"e31:worker:{node}" in run_command(scan, env=env, cwd=tmp_path).output,
             timeout_s=30, what=f"{node} to beat")
    ran = run_command(scan, env=env, cwd=tmp_path)
    assert ran.returncode == 0 and f"e31:worker:{node}" in ran.output, ran.output
    got = run_command(get.replace("gpu1@nodeA", node), env=env, cwd=tmp_path)
    assert got.returncode == 0, got.output
    # (the last line: redis-cli warns on stderr first of a password on its command line)
    beat = json.loads(got.output.strip().splitlines()[-1])
    page_beat = json.loads(shown[0])
    assert beat.keys() == page_beat.keys(), got.output
    assert beat["gpus_telemetry"][0].keys() == page_beat["gpus_telemetry"][0].keys()

    # /metrics with the token `e31 up` made
    [metrics] = page.run_blocks("metrics")
    ran = run_command(_at(stack, metrics.text), env=env, cwd=tmp_path)
    assert ran.returncode == 0 and "\ne31_store_up 1.0\n" in ran.output, ran.output

    # `e31 top --once`: the tables and columns the page shows
    [top] = page.run_blocks("top")
    [(_, shown, ran)] = _steps(top, env, tmp_path, stack)
    assert ran.returncode == 0, ran.output
    assert _header_words(shown) == _header_words(ran.output.splitlines()), ran.output
    assert ran.output.rstrip().endswith("GPU sim: simulated, its readings made up")

    # `e31 gc`: a dry run, then --delete, then JSON with the keys the page names (this stack's
    # jobs are all younger than the retention: nothing to remove)
    [gc] = page.run_blocks("gc")
    (_, dry_shown, dry), (_, del_shown, deleted), (_, _, as_json) = _steps(gc, env, tmp_path,
                                                                          stack)
    for shown, ran in ((dry_shown, dry), (del_shown, deleted)):
        assert ran.returncode == 0, ran.output
        assert ran.output.startswith(shown[0].partition(" 412 ")[0]), (shown, ran.output)
    answer = json.loads(as_json.output)
    assert {"deleted", "job_count", "files", "bytes", "jobs"} <= answer.keys()
    assert answer["deleted"] is False


def test_operations_page_promtool_checks() -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool not on PATH: install Debian's `prometheus` package, as .ci/run does")
    [checks] = doc("docs/operations.md").run_blocks("promtool")
    ran = run_block(checks, env=os.environ, cwd=ROOT)
    assert ran.returncode == 0, ran.output
    assert "SUCCESS" in ran.output


@pytest.mark.timeout(STACK_TEST_TIMEOUT_S)
def test_reliability_page_resumable_job(stack: Stack, tmp_path: Path) -> None:
    # The job fails at step 4, and its retry (after a back-off of 1 s) resumes there
    [resume] = doc("docs/reliability.md").run_blocks("resume")
    ran = run_block(resume, env=_env(stack), cwd=tmp_path)
    assert ran.returncode == 0, ran.output
    shown = [line.removeprefix("# ") for line in resume.text.splitlines()
             if line.startswith("# j-")]
    assert output_contains(shown, ran.output), f"{shown}\n{ran.output}"


@pytest.mark.timeout(STACK_TEST_TIMEOUT_S)
def test_security_page_requests(stack: Stack, tmp_path: Path) -> None:
    page, env = doc("docs/security.md"), _env(stack, TOKEN=stack.token)
    # A body over max_request_bytes (16 MiB) is refused with 413's answer; the page makes its
    # huge.json itself (issue 32: it never showed how, so a reader could not run the curl)
    [huge] = page.run_blocks("too-large")
    [(_, _, made), (command, shown, ran)] = _steps(huge, env, tmp_path, stack)
    assert made.returncode == 0 and (tmp_path / "huge.json").stat().st_size > 17 << 20
    assert ran.returncode == 0 and output_matches(shown, ran.output), f"{shown}\n{ran.output}"

    # A log read in chunks: the first 4 bytes of a job that printed "hello, world"
    job = stack.client().submit(command=["echo", "hello, world"], resources={"gpus": 0})
    job.wait(timeout=120)
    [chunk] = page.run_blocks("log-chunk")
    [(command, shown, ran)] = _steps(chunk, dict(env, J=job.id), tmp_path, stack)
    assert ran.returncode == 0 and output_contains(shown, ran.output), f"{shown}\n{ran.output}"
    assert ran.output.rstrip().endswith("hell")


@pytest.mark.timeout(STACK_TEST_TIMEOUT_S)
def test_security_page_secret_reaches_the_job_it_shows(stack: Stack, tmp_path: Path) -> None:
    """Secrets as the page shows them (issue 32: its job.yaml lacked `workdir` and the page
    never showed `fetch.py`): its job.yaml and fetch.py written as they are, its commands run."""
    yaml_block, fetch_block, commands = doc("docs/security.md").run_blocks("secrets")
    (tmp_path / "job.yaml").write_text(yaml_block.text)
    (tmp_path / "fetch.py").write_text(fetch_block.text)
    value = "hf_" + "x" * 37
    ran = run_block(commands, env=_env(stack, HF_TOKEN=value), cwd=tmp_path)
    assert ran.returncode == 0, ran.output
    assert "HF_TOKEN: 40 characters" in ran.output, ran.output
    assert value not in ran.output


@pytest.mark.timeout(STACK_TEST_TIMEOUT_S)
def test_jobs_page_workdir_example_runs_in_examples_byo(stack: Stack, tmp_path: Path) -> None:
    """"Your code: workdir" as written, in examples/byo (issue 32: it lacked its `inputs`, and
    a reader who pasted it alone had no `client`: the block makes its own)."""
    [block] = doc("docs/jobs.md").run_blocks("byo-python")
    work = _workdir(tmp_path) / "examples" / "byo"
    script = block.text + "print(job.wait(timeout=120)['state'], job.result())\n"
    ran = run_command(f"python3 - <<'PY'\n{script}PY", env=_env(stack), cwd=work,
                      timeout_s=200)
    assert ran.returncode == 0, ran.output
    assert re.search(r"^succeeded \{'words': 11, ", ran.output, re.M), ran.output
