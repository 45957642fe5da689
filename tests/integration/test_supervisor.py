"""The attempt supervisor with real child processes: results, exit codes, timeouts, kills, logs."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from e31.core.spec import JobSpec
from e31.core.states import AttemptReason
from e31_worker.attempt.plan import AttemptPlan, Directive
from e31_worker.attempt.supervisor import Supervisor
from tests.conftest import process_alive, wait_for


def plan(tmp_path: Path, *, log_max_bytes: int = 1 << 20, **spec: object) -> AttemptPlan:
    return AttemptPlan(job_id="j-test", attempt=1, spec=JobSpec.parse(spec), gpus="3",
                       root=tmp_path / "attempt", kill_grace_s=1.0, log_max_bytes=log_max_bytes,
                       tick_interval_s=0.1)


def run(p: AttemptPlan, directive: Directive = Directive.CONTINUE):
    return Supervisor(p, tick=lambda progress: directive).run()


def test_an_entrypoint_returns_its_json_result_and_sees_its_pinned_gpu(tmp_path: Path) -> None:
    p = plan(tmp_path, entrypoint="e31_worker.examples:hello", params={"name": "ada"})
    result = run(p)
    assert result.reason is AttemptReason.SUCCEEDED
    assert result.result["greeting"] == "hello, ada"
    assert result.result["cuda_visible_devices"] == "3"
    assert (p.output_dir / "greeting.txt").read_text() == "hello, ada\n"
    assert "hello, ada from job j-test attempt 1" in p.log_path.read_text()


def test_the_last_progress_of_a_job_that_ends_between_ticks_goes_with_its_outcome(
        tmp_path: Path) -> None:
    # Given a job that reports 3 of 3 steps and ends long before the supervisor's first tick
    p = dataclasses.replace(plan(tmp_path, entrypoint="e31_worker.examples:sleep",
                                 params={"seconds": 0.03, "steps": 3}), tick_interval_s=60.0)
    ticks: list[object] = []

    # When it is supervised to its end
    result = Supervisor(p, tick=lambda progress: ticks.append(progress) or Directive.CONTINUE
                        ).run()

    # Then its outcome carries that progress, and no tick (a lease renewal) was spent on it
    assert result.reason is AttemptReason.SUCCEEDED
    assert result.progress == (3.0, 3.0)
    assert ticks == []


def test_a_command_job_fails_with_its_exit_code_and_its_output_logged(tmp_path: Path) -> None:
    p = plan(tmp_path, command=["sh", "-c", "echo out; echo err >&2; exit 7"])
    result = run(p)
    assert (result.reason, result.exit_code, result.error) == (
        AttemptReason.ERROR, 7, "exited with code 7")
    log = p.log_path.read_text()
    assert "out" in log and "err" in log


def test_an_entrypoint_that_cannot_be_imported_fails_with_that_reason(tmp_path: Path) -> None:
    result = run(plan(tmp_path, entrypoint="no_such_module_e31:main"))
    assert result.reason is AttemptReason.ERROR
    assert "cannot import entrypoint no_such_module_e31:main" in result.error


def test_a_result_that_is_not_json_is_an_error(tmp_path: Path, job_modules) -> None:
    job_modules("nonjson_job", "def main(ctx):\n    return {1, 2}\n")
    result = run(plan(tmp_path, entrypoint="nonjson_job:main"))
    assert result.reason is AttemptReason.ERROR
    assert result.error.startswith("result is not JSON")


def test_a_timeout_kills_the_whole_process_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    script = f"sleep 300 & echo $! > {pidfile}; wait"
    p = plan(tmp_path, command=["sh", "-c", script], timeout_s=1)
    result = run(p)
    assert result.reason is AttemptReason.TIMEOUT
    grandchild = int(pidfile.read_text())
    wait_for(lambda: not process_alive(grandchild), timeout_s=5, what="the grandchild to be gone")


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    script = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "print('up', flush=True); time.sleep(300)")
    p = plan(tmp_path, command=[sys.executable, "-c", script], timeout_s=1)
    result = run(p)
    assert result.reason is AttemptReason.TIMEOUT and result.exit_code == -9


def test_a_cancel_directive_stops_the_job(tmp_path: Path) -> None:
    result = run(plan(tmp_path, command=["sleep", "300"]), Directive.CANCEL)
    assert result.reason is AttemptReason.CANCELLED


def test_the_log_is_capped_and_says_where_it_was_cut(tmp_path: Path) -> None:
    p = plan(tmp_path, log_max_bytes=1000,
             command=[sys.executable, "-c", "print('x' * 100000)"])
    result = run(p)
    assert result.reason is AttemptReason.SUCCEEDED
    log = p.log_path.read_bytes()
    assert log.startswith(b"x" * 1000) and b"[e31: log cut at 1000 bytes" in log
    assert len(log) < 1200


def test_the_job_environment_hides_the_workers_own_settings(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("E31_DATABASE_URL", "postgresql://secret@db/e31")
    p = plan(tmp_path, command=["sh", "-c", "env"], env={"MY_FLAG": "1"})
    run(p)
    env = p.log_path.read_text()
    assert "secret" not in env
    assert "MY_FLAG=1" in env and "CUDA_VISIBLE_DEVICES=3" in env and "E31_JOB_ID=j-test" in env


def test_a_failing_supervisor_never_leaves_the_job_running(tmp_path: Path) -> None:
    # Given a running job, and a supervisor tick that fails once the job has written its pid
    # (or after 30 s), so that the test can find the job
    pidfile = tmp_path / "pid"
    p = plan(tmp_path, command=["sh", "-c", f"echo $$ > {pidfile}; exec sleep 300"])
    started = time.monotonic()

    def broken_tick(progress: object) -> Directive:
        if (pidfile.exists() and pidfile.read_text().strip()) or time.monotonic() - started > 30:
            raise RuntimeError("heartbeat blew up")
        return Directive.CONTINUE

    # When the supervisor fails
    try:
        Supervisor(p, tick=broken_tick).run()
    except RuntimeError:
        pass

    # Then the job does not outlive it
    wait_for(lambda: not process_alive(int(pidfile.read_text())), timeout_s=5,
             what="the job to be killed")


def test_a_process_that_leaves_the_group_does_not_hold_the_attempt_open(tmp_path: Path) -> None:
    import threading
    import time
    escaped = tmp_path / "escaped.pid"
    p = plan(tmp_path, command=["sh", "-c",
                                f"setsid sleep 60 & echo $! > {escaped}; sleep 0.2; echo done"])
    started = time.monotonic()
    try:
        result = run(p)
    finally:  # without a cgroup nothing finds the escaped process: the test ends it itself
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(escaped.read_text()), signal.SIGKILL)
    assert result.reason is AttemptReason.SUCCEEDED
    assert time.monotonic() - started < 10
    assert not [t for t in threading.enumerate() if t.name == "log-j-test"]
    assert "done" in p.log_path.read_text()


def test_reaping_leaves_a_process_group_that_is_not_the_jobs_alone(tmp_path: Path) -> None:
    import subprocess

    from e31_worker.attempt.groups import GroupRegistry
    stranger = subprocess.Popen(["sleep", "30"], start_new_session=True)
    ours = subprocess.Popen(["sleep", "30"], start_new_session=True,
                            env={**os.environ, "E31_JOB_ID": "j-ours"})
    registry = GroupRegistry(tmp_path / "groups")
    registry.add(stranger.pid, "j-recycled")   # a recorded id now used by another program
    registry.add(ours.pid, "j-ours")
    try:
        assert registry.reap() == 1
        assert ours.wait(timeout=5) == -9
        assert stranger.poll() is None
        assert list((tmp_path / "groups").iterdir()) == []
    finally:
        stranger.kill()
        stranger.wait()


def test_a_failure_to_record_the_group_still_stops_the_job(tmp_path: Path) -> None:
    import uuid

    from e31_worker.attempt.groups import GroupRegistry
    mark = uuid.uuid4().hex
    (tmp_path / "not-a-dir").write_text("")
    p = plan(tmp_path, command=["sleep", "300"], env={"TEST_MARK": mark})
    try:
        Supervisor(p, tick=lambda progress: Directive.CONTINUE,
                 groups=GroupRegistry(tmp_path / "not-a-dir" / "groups")).run()
    except OSError:
        pass
    # The job may be killed before or after it got going; either way none of it may live on.
    wait_for(lambda: not _processes_with_env(f"TEST_MARK={mark}".encode()), timeout_s=10,
             what="the unrecorded job to be stopped")


def _processes_with_env(entry: bytes) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                environ = (d / "environ").read_bytes().split(b"\0")
                if entry in environ and process_alive(int(d.name)):
                    found.append(int(d.name))
            except OSError:
                pass
    return found


def test_the_log_is_read_even_when_the_worker_has_over_1024_files_open(tmp_path: Path) -> None:
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip("the hard limit on open files is below 2048")
    resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        p = plan(tmp_path, timeout_s=30, command=[sys.executable, "-c", "print('y' * 200000)"])
        result = run(p)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert result.reason is AttemptReason.SUCCEEDED
    assert p.log_path.stat().st_size == 200001


def test_one_process_per_node_holds_the_node_lock_until_it_dies(tmp_path: Path) -> None:
    import subprocess

    from e31_worker.attempt.groups import NodeLock
    lock_path = tmp_path / "gpu0@h.lock"
    holder = subprocess.Popen([sys.executable, "-c",
                               "import sys, time; from pathlib import Path; "
                               "from e31_worker.attempt.groups import NodeLock; "
                               f"assert NodeLock(Path({str(lock_path)!r})).acquire() is None; "
                               "print('held', flush=True); time.sleep(300)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert NodeLock(lock_path).acquire() == holder.pid
    finally:
        holder.kill()
        holder.wait()
    assert NodeLock(lock_path).acquire() is None


@pytest.fixture
def job_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`job_modules(name, source)` puts a job module on the children's PYTHONPATH for this
    test."""
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    monkeypatch.setenv("PYTHONPATH", str(jobs), prepend=os.pathsep)
    return lambda name, source: (jobs / f"{name}.py").write_text(source)


def test_an_out_of_memory_exception_in_the_job_ends_the_attempt_as_oom(tmp_path: Path,
                                                                       job_modules) -> None:
    job_modules("oom_job", "class OutOfMemoryError(RuntimeError):\n    pass\n\n"
                "def main(ctx):\n"
                "    raise OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')\n")
    result = run(plan(tmp_path, entrypoint="oom_job:main"))
    assert result.reason is AttemptReason.OOM
    assert "CUDA out of memory" in result.error


@pytest.fixture
def cgroups():
    from e31_worker.attempt.cgroups import JobCgroups
    groups = JobCgroups.for_node(f"test-{os.getpid()}@supervisor")
    if groups is None:
        pytest.skip("this machine lets the tests create no memory cgroup")
    yield groups
    groups.reap()


def test_the_kernels_oom_kill_of_a_job_over_its_mem_gb_is_reported_as_oom(
        tmp_path: Path, cgroups) -> None:
    # Given a job capped at 64 MiB of host memory that allocates 1 GiB
    p = plan(tmp_path, command=[sys.executable, "-c", "b = bytearray(1 << 30); print(len(b))"],
             resources={"gpus": 0, "mem_gb": 0.0625})

    # When it runs in its cgroup
    result = Supervisor(p, tick=lambda progress: Directive.CONTINUE, cgroups=cgroups).run()

    # Then the kernel killed it and the attempt says why
    assert result.reason is AttemptReason.OOM, result
    assert result.exit_code == -9
    assert "OOM killer" in result.error and "mem_gb=0.0625" in result.error


def test_a_process_that_left_the_group_is_still_killed_through_the_cgroup(
        tmp_path: Path, cgroups) -> None:
    # Given a job that starts a process in a new session (out of its process group) and exits
    pidfile = tmp_path / "escaped.pid"
    p = plan(tmp_path, command=["sh", "-c", f"setsid sleep 300 & echo $! > {pidfile}"],
             resources={"gpus": 0})

    # When the attempt ends
    result = Supervisor(p, tick=lambda progress: Directive.CONTINUE, cgroups=cgroups).run()

    # Then the escaped process is gone too
    assert result.reason is AttemptReason.SUCCEEDED
    pid = int(pidfile.read_text())
    wait_for(lambda: not process_alive(pid), timeout_s=5, what="the escaped process to be killed")
