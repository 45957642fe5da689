"""The cold-start spawner (`e31_worker.attempt.spawn`, `e31_worker.child.spawner`) with real
processes: its children are started, seen and ended as `Popen`'s were, but forked by it and
not by the worker; a broken spawner is replaced, and it and its children end with the worker.
Its sandboxed children are test_sandbox.py's (every test there runs both ways)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from e31.core.spec import JobSpec
from e31.core.states import AttemptReason
from e31_worker.attempt.plan import AttemptPlan, Directive
from e31_worker.attempt.spawn import Spawner
from e31_worker.attempt.supervisor import Supervisor
from tests.conftest import process_alive, wait_for


@pytest.fixture
def spawner() -> Iterator[Spawner]:
    made = Spawner()
    try:
        yield made
    finally:
        made.close()


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_spawned_child_is_the_spawners_and_reads_as_popens_would(
        spawner: Spawner, tmp_path: Path) -> None:
    # Given the spawner, and a child that says where it runs, then waits for its input's end
    script = "import os, sys; print(os.getcwd(), os.getsid(0) == os.getpid(), flush=True); " \
             "sys.stdin.read(); sys.exit(3)"
    child = spawner.spawn([sys.executable, "-c", script], dict(os.environ), cwd=str(tmp_path))

    # Then it runs, forked by the spawner and not by this process, in its own session
    assert child is not None
    try:
        assert child.stdout.readline().decode().split() == [str(tmp_path), "True"]
        assert parent_of(child.pid) == spawner.pid != os.getpid()
        assert child.poll() is None
    finally:
        # And its stdin is /dev/null: it ends at once, its exit status read as Popen's
        assert child.wait(timeout=30) == 3
        child.close()

    # And a child killed by a signal reads as Popen's: minus the signal
    killed = spawner.spawn(["sh", "-c", "kill -9 $$"], dict(os.environ), cwd=str(tmp_path))
    assert killed is not None
    assert killed.wait(timeout=30) == -signal.SIGKILL
    killed.close()


def test_what_popen_raises_the_spawner_raises(spawner: Spawner, tmp_path: Path) -> None:
    env = dict(os.environ)
    # A program that is not there, and a cwd that is not: the errno of each
    with pytest.raises(FileNotFoundError):
        spawner.spawn([str(tmp_path / "no-such-program")], env, cwd=str(tmp_path))
    with pytest.raises(FileNotFoundError):
        spawner.spawn(["true"], env, cwd=str(tmp_path / "no-such-dir"))
    with pytest.raises(PermissionError):
        (tmp_path / "not-executable").write_text("#!/bin/sh\n")
        spawner.spawn([str(tmp_path / "not-executable")], env, cwd=str(tmp_path))
    # A NUL in an argument or a variable: ValueError, before the spawner sees it
    with pytest.raises(ValueError, match="null"):
        spawner.spawn(["true", "a\0b"], env, cwd=str(tmp_path))
    # A setup that fails (here a sandbox's uid that is no number): SubprocessError
    with pytest.raises(subprocess.SubprocessError, match="setup failed"):
        spawner.spawn(["true"], env, cwd=str(tmp_path), enter={"uid": "nobody", "staged": []})
    # And the spawner still serves
    ok = spawner.spawn(["true"], env, cwd=str(tmp_path))
    assert ok is not None and ok.wait(timeout=30) == 0
    ok.close()


def test_a_killed_spawner_takes_its_children_and_the_next_start_gets_another(
        spawner: Spawner, tmp_path: Path) -> None:
    # Given a running child of the spawner
    child = spawner.spawn(["sleep", "60"], dict(os.environ), cwd=str(tmp_path))
    assert child is not None
    first = spawner.pid
    assert first is not None

    # When the spawner is killed
    os.kill(first, signal.SIGKILL)

    # Then its child dies with it (never left running unsupervised) and reads as killed
    assert child.wait(timeout=30) == -signal.SIGKILL
    child.close()

    # And the next cold start gets a new spawner
    again = spawner.spawn(["true"], dict(os.environ), cwd=str(tmp_path))
    assert again is not None and again.wait(timeout=30) == 0
    again.close()
    assert spawner.pid not in (None, first)


WORKER = textwrap.dedent("""
    import os, sys, time
    from e31_worker.attempt.spawn import Spawner
    spawner = Spawner()
    child = spawner.spawn(["sleep", "60"], dict(os.environ), cwd="/")
    print(spawner.pid, child.pid, flush=True)
    time.sleep(60)
""")


def test_the_spawner_and_its_children_end_with_the_worker_process() -> None:
    # Given a worker process with a spawner and a child it runs
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, text=True)
    assert worker.stdout is not None
    spawner_pid, child_pid = map(int, worker.stdout.readline().split())
    assert process_alive(spawner_pid) and process_alive(child_pid)

    # When the worker process is killed (a crash: it closes nothing)
    worker.kill()
    worker.wait()

    # Then the spawner notices and ends, and the child with it
    wait_for(lambda: not process_alive(spawner_pid) and not process_alive(child_pid),
             timeout_s=10, what="the spawner and its child to end with the worker")


def test_a_supervised_attempt_runs_its_cold_child_through_the_spawner(
        spawner: Spawner, tmp_path: Path) -> None:
    # Given a command job that writes its parent's pid
    p = AttemptPlan(job_id="j-spawned", attempt=1, gpus="",
                    spec=JobSpec.parse({"command": ["sh", "-c", "echo $PPID > ppid"]}),
                    root=tmp_path / "attempt", kill_grace_s=1.0, log_max_bytes=1 << 20,
                    tick_interval_s=0.1)

    # When a supervisor with the spawner runs it, and one without
    outcome = Supervisor(p, tick=lambda _: Directive.CONTINUE, spawner=spawner).run()
    spawned_by = int((p.cwd / "ppid").read_text())
    forked = Supervisor(p, tick=lambda _: Directive.CONTINUE).run()
    forked_by = int((p.cwd / "ppid").read_text())

    # Then both succeed, the first forked by the spawner, the second by this process
    assert outcome.reason is AttemptReason.SUCCEEDED and forked.reason is AttemptReason.SUCCEEDED
    assert (spawned_by, forked_by) == (spawner.pid, os.getpid())


def test_a_spawner_that_cannot_start_leaves_the_worker_forking_its_children(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Given a worker whose spawner's interpreter exits at once (a broken install)
    monkeypatch.setattr("e31_worker.attempt.spawn.sys.executable", "/bin/false")
    spawner = Spawner()
    p = AttemptPlan(job_id="j-fallback", attempt=1, gpus="",
                    spec=JobSpec.parse({"command": ["sh", "-c", "echo $PPID > ppid"]}),
                    root=tmp_path / "attempt", kill_grace_s=1.0, log_max_bytes=1 << 20,
                    tick_interval_s=0.1)

    # When it runs attempts, more than the spawner's failures allowed in a row
    outcomes = [Supervisor(p, tick=lambda _: Directive.CONTINUE, spawner=spawner).run()
                for _ in range(4)]

    # Then every attempt ran, forked by the worker itself, and the spawner was given up on once
    assert [o.reason for o in outcomes] == [AttemptReason.SUCCEEDED] * 4
    assert int((p.cwd / "ppid").read_text()) == os.getpid()
    assert spawner.disabled_because is not None and spawner.pid is None
    assert sum("spawner_disabled" in r.getMessage() for r in caplog.records) == 1
    spawner.close()
