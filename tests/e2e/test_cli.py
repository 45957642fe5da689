"""The `e31` command line against a running stack, as a user types it."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

from e31.local.redisserver import free_port
from tests.conftest import wait_for

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


class Follower:
    """`e31 logs -f JOB` as a process, its stdout read line by line as it comes."""

    def __init__(self, stack: Stack, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "e31.cli", "logs", "-f", *args],
                                     env=dict(stack.env, PYTHONUNBUFFERED="1"),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def has(self, text: str) -> bool:
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return text in self.seen

    def wait_for_line(self, text: str) -> None:
        wait_for(lambda: self.has(text), timeout_s=60, what=f"{text!r} in e31 logs -f")


def test_logs_follow_streams_a_running_jobs_lines_as_they_are_written(
        stack: Stack, shared_tmp: Path) -> None:
    # Given a running job that prints a line, then waits for a file this test creates
    go = shared_tmp / "go"
    job_id = stack.e31("submit", "--gpus", "0", "--", "sh", "-c",
                       f"echo first-line; while [ ! -e {go} ]; do sleep 0.1; done; "
                       "echo second-line").stdout.strip()

    # When its log is followed
    follower = Follower(stack, job_id)

    # Then the first line shows under its attempt's header while the job still waits
    follower.wait_for_line("first-line")
    assert follower.seen[:2] == ["=== attempt 1 ===", "first-line"]
    assert not follower.has("second-line")
    assert json.loads(stack.e31("status", job_id, "--json").stdout)["state"] == "running"

    # And the second once the job writes it; the follower ends with the job, exit 0
    go.touch()
    follower.wait_for_line("second-line")
    assert follower.proc.wait(timeout=60) == 0


def test_logs_follow_moves_to_the_next_attempt_under_its_header(
        stack: Stack, shared_tmp: Path) -> None:
    # Given a job whose first attempt fails and whose retry succeeds
    mark = shared_tmp / "tried"
    job_id = stack.e31("submit", "--gpus", "0", "--retries", "1", "--backoff", "0", "--",
                       "sh", "-c", f"if [ -e {mark} ]; then echo try-two; else touch {mark}; "
                                   "echo try-one; exit 3; fi").stdout.strip()

    # When its log is followed from the start to the end
    follower = Follower(stack, job_id)
    assert follower.proc.wait(timeout=120) == 0
    follower.has("")

    # Then each attempt's lines come under its own header, in order
    assert [line for line in follower.seen if line] == \
        ["=== attempt 1 ===", "try-one", "=== attempt 2 ===", "try-two"]


def test_logs_of_an_attempt_the_job_lacks_and_result_json_of_a_failed_job(
        stack: Stack) -> None:
    # Given a job that failed in its one attempt
    job_id = stack.client().submit(command=["sh", "-c", "exit 4"], resources={"gpus": 0}).id
    wait_for(lambda: stack.client().get(job_id).status()["state"] == "failed", timeout_s=60,
             what="the job to fail")

    # When its fifth attempt's log is asked for: exit 2, one line naming how many it has
    missing = stack.e31("logs", job_id, "--attempt", "5")
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.strip() == f"error: job {job_id} has 1 attempt; --attempt takes 1 to 1"

    # And its result as JSON: the status with reason and error on stdout, exit 1
    result = stack.e31("result", job_id, "--json")
    assert result.returncode == 1
    status = json.loads(result.stdout)
    assert status["state"] == "failed" and "exited with code 4" in status["error"]


def test_a_workload_job_is_named_after_its_workload_and_the_new_flags_reach_the_api(
        stack: Stack) -> None:
    # Given the example of docs/jobs.md ("Every field as a flag"), as a dry run
    checked = stack.e31("submit", "-w", "train", "--gpus", "0", "--mem-gb", "4", "--retries", "2",
                        "--backoff", "5", "--backoff-max", "60", "--max-lost", "2",
                        "-p", "epochs=1", "--dry-run", "--json")

    # Then the API takes it, named after the workload, with every flag in its spec
    assert checked.returncode == 0, checked.stderr
    answer = json.loads(checked.stdout)
    assert answer["name"] == "train"
    assert answer["spec"]["resources"]["mem_gb"] == 4
    assert answer["spec"]["retries"] == {"max": 2, "backoff_s": 5, "backoff_max_s": 60,
                                         "max_lost": 2}


def test_each_exit_code_of_the_table_comes_from_a_real_case(stack: Stack) -> None:
    # 0: done. 1: the job failed, in test_wait_exits_non_zero_when_the_job_failed and
    # test_logs_of_an_attempt_the_job_lacks_and_result_json_of_a_failed_job above.
    assert stack.e31("ls").returncode == 0
    # 2: bad input, refused by the API (an unknown job; a bad spec in the test above)
    unknown = stack.e31("status", "j-" + "f" * 20)
    assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1
    # 3: the API cannot be reached
    env = dict(stack.env, E31_URL=f"http://127.0.0.1:{free_port()}", E31_TOKEN=stack.token)
    down = subprocess.run([sys.executable, "-m", "e31.cli", "ls"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert down.returncode == 3 and down.stderr.count("\n") == 1, down.stderr
    # 130: Ctrl-C while following a running job's log
    job = stack.client().submit(command=["sh", "-c", "echo started; sleep 60"],
                                resources={"gpus": 0})
    follower = Follower(stack, job.id)
    follower.wait_for_line("started")
    os.kill(follower.proc.pid, signal.SIGINT)
    assert follower.proc.wait(timeout=30) == 130
    job.cancel()


def test_a_job_no_worker_can_take_says_so_and_its_wait_grows(stack: Stack) -> None:
    # Given a stack of gpu24, gpu48 and cpu workers, and a job that needs a gpu80 GPU
    job = stack.client().submit(entrypoint="e2ejobs:where", resources={"gpu_mem_gb": 70})
    try:
        # When its owner asks why it waits
        shown = stack.e31("status", job.id)
        first = job.status()

        # Then no worker of its class runs, with no estimate, and its wait so far grows
        assert first["pending"]["reason"] == "no_workers", first["pending"]
        assert first["pending"]["estimated_start"] is None
        assert "no worker serves e31.gpu80" in shown.stdout
        assert "estimated start  none: no worker of its class is running" in shown.stdout
        wait_for(lambda: job.status()["queued_seconds"] > first["queued_seconds"] + 0.5,
                 timeout_s=60, what="queued_seconds to grow")
    finally:
        job.cancel()


def test_drain_and_undrain_print_their_answer_and_no_alembic_log_lines(stack: Stack) -> None:
    # When an operator drains a node and puts it back in service (one no worker runs as:
    # nothing else changes, and the undrain clears what the drain recorded)
    said = ""
    for args in (["--drain", "--no-wait"], ["--undrain"]):
        done = subprocess.run([sys.executable, "-m", "e31.cli", "worker", *args, "--node",
                               "gpu9@nowhere"], env=stack.env_with_redis(), capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert "gpu9@nowhere" in done.stdout
        said += done.stdout + done.stderr
    # Then each says what it did, and nothing of the store's migrations (issue 32: seven
    # `alembic.runtime.plugins INFO` lines)
    assert "alembic" not in said, said


def test_tables_off_a_terminal_are_whole_at_their_own_width(stack: Stack) -> None:
    # Given a job with an attempt, and a shell whose output is a pipe, with no COLUMNS
    job = stack.client().submit(entrypoint="e31_worker.examples:hello", resources={"gpus": 0},
                                name="a-name-long-enough-to-have-been-cut-at-eighty-columns")
    job.wait(timeout=120)
    env = {k: v for k, v in stack.env.items() if k != "COLUMNS"}
    # When its status, the queue and the pool's view are piped (CI logs, `| cat`, `watch`)
    for args in (["status", job.id], ["queue"], ["top", "--once"], ["ls"]):
        done = subprocess.run([sys.executable, "-m", "e31.cli", *args], env=env,
                              capture_output=True, text=True, timeout=60)
        # Then no cell is cut (issue 32: `atte… work… star… reas…` at rich's 80 columns)
        assert done.returncode == 0, (args, done.stderr)
        assert "…" not in done.stdout, (args, done.stdout)
    shown = subprocess.run([sys.executable, "-m", "e31.cli", "status", job.id], env=env,
                           capture_output=True, text=True, timeout=60).stdout
    assert job.id in shown and "a-name-long-enough-to-have-been-cut-at-eighty-columns" in shown
    for header in ("attempt", "worker", "started", "reason"):
        assert header in shown, shown
