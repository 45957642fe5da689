"""The sandbox of an attempt (`e31_worker.attempt.sandbox`) with real processes: the job's
uid and namespaces, its files, stopping it with its grace, its exit status, its network, its
cgroup, and what the worker reads back from it. Skipped, saying why, where this machine
cannot give a sandbox (not root, no bubblewrap, no user namespaces)."""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from e31.core.records import Claim, Outcome
from e31.core.spec import JobSpec
from e31.core.states import AttemptReason
from e31.edge.settings import Settings
from e31_worker.attempt.plan import AttemptPlan, Directive
from e31_worker.attempt.sandbox import Sandbox, sandbox_unavailable
from e31_worker.attempt.spawn import Spawner
from e31_worker.attempt.supervisor import Supervisor
from tests.conftest import job_processes, wait_for

TENANT = "t-0123456789ab"


class Jail:
    """A sandboxed worker's pieces, for one test: settings (E31_HOME 0700 in tmp), its
    Sandbox, and a way to run a job spec through a Supervisor in it."""

    def __init__(self, tmp_path: Path, spawner: Spawner | None = None) -> None:
        self.spawner = spawner   # None: the worker process forks the child (`Popen`)
        self.home = tmp_path / "home"
        self.home.mkdir(mode=0o700)
        self.settings = Settings.load({"home": str(self.home)}, environ={})
        why = sandbox_unavailable(self.settings)
        if why is not None:
            pytest.skip(f"no sandbox on this machine: {why}")
        self.sandbox = Sandbox.from_settings(self.settings)
        self.uid = self.sandbox.uid_for(TENANT)
        self.starts: list[float] = []

    def plan(self, **spec: object) -> AttemptPlan:
        root = self.settings.resolved_work_dir / "j-sandboxed" / "attempt-1"
        return AttemptPlan(job_id="j-sandboxed", attempt=1, spec=JobSpec.parse(spec), gpus="",
                           root=root, kill_grace_s=2.0, log_max_bytes=1 << 20,
                           tick_interval_s=0.1)

    def run(self, p: AttemptPlan, *, sandboxed: bool = True, cgroups: object = None,
            tick: Callable[[tuple[float, float] | None], Directive] | None = None) -> Outcome:
        claim = Claim(job_id=p.job_id, tenant_id=TENANT, token=1, attempt=1, spec=p.spec,
                      gpus=0)
        return Supervisor(p, tick=tick or (lambda progress: Directive.CONTINUE),
                          cgroups=cgroups,  # type: ignore[arg-type]
                          sandbox=self.sandbox.for_attempt(claim) if sandboxed else None,
                          spawner=self.spawner,
                          on_start=lambda ms, start: self.starts.append(ms)).run()


@pytest.fixture(params=["worker", "spawner"])
def jail(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Jail]:
    """A jail whose cold children the worker process forks, or its spawner: the same
    sandbox either way (`e31_worker.attempt.spawn`)."""
    spawner = Spawner() if request.param == "spawner" else None
    try:
        yield Jail(tmp_path, spawner)
    finally:
        if spawner is not None:
            spawner.close()


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_sandboxed_job_runs_as_its_tenants_uid_alone_in_its_own_pid_namespace(
        jail: Jail) -> None:
    # Given a job that reports who and where it is
    report = ("import json, os; print(json.dumps({'uid': os.getuid(), 'gid': os.getgid(), "
              "'pid': os.getpid(), 'procs': sorted(int(p) for p in os.listdir('/proc') "
              "if p.isdigit()), 'home': os.environ['HOME']})); open('made', 'w').write('x')")
    p = jail.plan(command=python(report))

    # When it runs in its sandbox
    result = jail.run(p)

    # Then it ran as its tenant's uid, not root, among its own few processes only, in its
    # scratch directory, and what it made is its uid's on the host
    assert result.reason is AttemptReason.SUCCEEDED, p.log_path.read_text()
    seen = json.loads(p.log_path.read_text().splitlines()[-1])
    assert seen["uid"] == seen["gid"] == jail.uid != 0
    assert jail.settings.sandbox_uid_base <= jail.uid < (jail.settings.sandbox_uid_base
                                                         + jail.settings.sandbox_uid_count)
    assert seen["procs"] == [1, seen["pid"]]
    assert seen["home"] == str(p.work_dir)
    assert (p.work_dir / "made").stat().st_uid == jail.uid
    assert jail.starts and jail.starts[0] > 0


def test_a_sandboxed_job_finds_no_e31_home_no_store_and_no_other_attempt(jail: Jail) -> None:
    # Given the worker's home with its store, and another attempt's output next to this one's
    (jail.home / "e31.db").write_text("the store")
    other = jail.settings.resolved_work_dir / "j-other" / "attempt-1" / "output"
    other.mkdir(parents=True)
    (other / "secret.txt").write_text("another tenant's output")
    probe = ("import json, sys\nout = {}\nfor path in sys.argv[1:]:\n"
             "    try:\n        open(path).read(); out[path] = 'read'\n"
             "    except OSError as exc:\n        out[path] = type(exc).__name__\n"
             "print(json.dumps(out))")
    targets = [str(jail.home / "e31.db"), str(other / "secret.txt"), "/etc/shadow"]
    p = jail.plan(command=[*python(probe), *targets])

    # When the job tries to read them
    result = jail.run(p)

    # Then none of them exists for it, or it may not read it
    assert result.reason is AttemptReason.SUCCEEDED, p.log_path.read_text()
    seen = json.loads(p.log_path.read_text().splitlines()[-1])
    assert seen[targets[0]] == seen[targets[1]] == "FileNotFoundError"
    assert seen["/etc/shadow"] == "PermissionError"


def test_the_job_may_write_only_its_own_directories(jail: Jail, tmp_path: Path) -> None:
    # Given places outside the job's directories that its worker could write: in its home,
    # in the system, beside the test
    outside = [str(jail.home / "planted"), "/usr/lib/planted", str(tmp_path / "planted")]
    attempt_files = ["claim.json", "attempt.log"]
    probe = ("import json, os, sys\nout = {}\n"
             "for path in sys.argv[1:]:\n"
             "    try:\n        open(path, 'w').write('x'); out[path] = 'wrote'\n"
             "    except OSError as exc:\n        out[path] = type(exc).__name__\n"
             "for name in " + repr(attempt_files) + ":\n"
             "    path = os.path.join(os.environ['E31_OUTPUT_DIR'], '..', name)\n"
             "    try:\n        os.remove(path); out[name] = 'removed'\n"
             "    except OSError as exc:\n        out[name] = type(exc).__name__\n"
             "for var in ('E31_OUTPUT_DIR', 'E31_CHECKPOINT_DIR'):\n"
             "    open(os.path.join(os.environ[var], 'f'), 'w').write('ok')\n"
             "print(json.dumps(out))")
    p = jail.plan(command=[*python(probe), *outside])

    # When it tries to write each of them, and to remove the worker's own files beside it
    result = jail.run(p)

    # Then only its output and checkpoint directories took a file: the system is read-only to
    # it, and what it wrote elsewhere went to its own private /tmp, never to the host
    assert result.reason is AttemptReason.SUCCEEDED, p.log_path.read_text()
    seen = json.loads(p.log_path.read_text().splitlines()[-1])
    assert seen["/usr/lib/planted"] in ("OSError", "PermissionError"), seen
    assert not any(Path(path).exists() for path in outside)
    assert seen["claim.json"] == seen["attempt.log"] == "PermissionError"
    assert (p.output_dir / "f").read_text() == (p.checkpoint_dir / "f").read_text() == "ok"
    assert stat.S_IMODE(p.root.stat().st_mode) == 0o1770


def test_a_timeout_gives_the_sandboxed_job_sigterm_and_its_grace_then_kills_all_of_it(
        jail: Jail) -> None:
    # Given a job that starts a helper process and checkpoints when it gets SIGTERM
    code = ("import os, signal, subprocess, sys, time\n"
            "subprocess.Popen(['sleep', '300'])\n"
            "def stop(*_):\n"
            "    open(os.path.join(os.environ['E31_CHECKPOINT_DIR'], 'ckpt'), 'w').write('saved')\n"
            "    time.sleep(300)\n"
            "signal.signal(signal.SIGTERM, stop)\n"
            "print('running', flush=True)\n"
            "time.sleep(300)")
    p = jail.plan(command=python(code), timeout_s=1.5)

    # When it runs past its timeout, and past its grace after SIGTERM
    result = jail.run(p)

    # Then it got SIGTERM (its checkpoint is there), then everything of it was killed
    assert result.reason is AttemptReason.TIMEOUT
    assert (p.checkpoint_dir / "ckpt").read_text() == "saved"
    wait_for(lambda: not job_processes(p.job_id), timeout_s=5,
             what="every process of the sandboxed job to be gone")


def test_a_cancel_stops_the_sandboxed_job_and_its_helpers(jail: Jail) -> None:
    # Given a running job with a helper process, whose owner cancels it
    p = jail.plan(command=["sh", "-c", "sleep 300 & sleep 300"])
    ticks = iter([Directive.CONTINUE] * 5)

    # When the tick says so
    result = jail.run(p, tick=lambda progress: next(ticks, Directive.CANCEL))

    # Then the attempt is cancelled and none of its processes is left
    assert result.reason is AttemptReason.CANCELLED
    wait_for(lambda: not job_processes(p.job_id), timeout_s=5,
             what="every process of the cancelled job to be gone")


def test_a_sandboxed_job_killed_by_a_signal_says_which(jail: Jail) -> None:
    p = jail.plan(command=python("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"))
    result = jail.run(p)
    assert (result.reason, result.exit_code, result.error) == (
        AttemptReason.ERROR, -9, "killed by signal SIGKILL")


def test_an_entrypoint_result_and_progress_come_back_from_the_sandbox(
        jail: Jail, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a job module on the worker's PYTHONPATH (under /tmp, the sandbox's own /tmp)
    modules = tmp_path / "jobs"
    modules.mkdir()
    (modules / "sandboxed_job.py").write_text(
        "import time\n"
        "def main(ctx, n):\n"
        "    ctx.progress(1, 2)\n"
        "    time.sleep(0.6)\n"
        "    (ctx.output_dir / 'out.txt').write_text('done')\n"
        "    return {'n': n, 'job': ctx.job_id}\n")
    os.chmod(tmp_path, 0o755)
    monkeypatch.setenv("PYTHONPATH", str(modules), prepend=os.pathsep)
    jail.sandbox = Sandbox.from_settings(jail.settings)   # it reads the worker's PYTHONPATH
    seen: list[tuple[float, float] | None] = []

    # When it runs
    result = jail.run(jail.plan(entrypoint="sandboxed_job:main", params={"n": 3}),
                      tick=lambda progress: seen.append(progress) or Directive.CONTINUE)

    # Then its result, its output and its progress reached the worker
    assert result.reason is AttemptReason.SUCCEEDED, result
    assert result.result == {"n": 3, "job": "j-sandboxed"}
    assert (1.0, 2.0) in seen


def test_a_link_the_job_plants_as_its_result_is_never_followed(
        jail: Jail, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a file only the worker may read, and a job that plants a link to it as its result
    # and exits before the runner writes one
    secret = jail.home / "secret.json"
    secret.write_text(json.dumps({"result": "the worker's secret"}))
    modules = tmp_path / "jobs"
    modules.mkdir()
    (modules / "planting_job.py").write_text(
        "import os\n"
        "def main(ctx, target):\n"
        "    os.symlink(target, os.path.join(os.environ['E31_OUTPUT_DIR'], '..', "
        "'result.json'))\n"
        "    os._exit(0)\n")
    os.chmod(tmp_path, 0o755)
    monkeypatch.setenv("PYTHONPATH", str(modules), prepend=os.pathsep)
    jail.sandbox = Sandbox.from_settings(jail.settings)

    # When it runs
    p = jail.plan(entrypoint="planting_job:main", params={"target": str(secret)})
    result = jail.run(p)

    # Then the worker did not read through the link: no result, and no secret
    assert (p.root / "result.json").is_symlink()
    assert result.reason is AttemptReason.ERROR
    assert result.result is None and "secret" not in (result.error or "")


@pytest.fixture
def listener() -> Iterator[int]:
    """A TCP port on this host's loopback that accepts connections (as the stack's Redis)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        yield server.getsockname()[1]


CONNECT = ("import socket, sys\n"
           "try:\n"
           "    socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=3).close()\n"
           "    print('connected')\n"
           "except OSError as exc:\n"
           "    print('refused', type(exc).__name__)")


def test_network_none_leaves_the_job_no_way_to_the_hosts_loopback(
        jail: Jail, listener: int) -> None:
    # Given a job with no network, and one on a pool whose jobs share the host's network
    # (job_network = host; the default, isolated, is tests/integration/test_job_network.py)
    closed = jail.plan(command=[*python(CONNECT), str(listener)], network="none")
    open_ = jail.plan(command=[*python(CONNECT), str(listener)])

    # When each connects to a port listening on this host's 127.0.0.1
    assert jail.run(closed).reason is AttemptReason.SUCCEEDED
    closed_said = closed.log_path.read_text()
    jail.sandbox = Sandbox.from_settings(jail.settings.model_copy(update={"job_network": "host"}))
    assert jail.run(open_).reason is AttemptReason.SUCCEEDED
    open_said = open_.log_path.read_text()

    # Then only the job with the network reaches it
    assert "refused" in closed_said, closed_said
    assert "connected" in open_said, open_said


def test_a_worker_without_a_sandbox_refuses_a_job_that_asks_for_no_network(jail: Jail) -> None:
    p = jail.plan(command=["true"], network="none")
    result = jail.run(p, sandboxed=False)
    assert result.reason is AttemptReason.ERROR
    assert "network: none needs a sandboxed worker" in (result.error or "")


def test_the_sandboxed_job_is_still_in_its_memory_cgroup(jail: Jail) -> None:
    # Given a worker that may create cgroups, and a job capped at 64 MiB that allocates 1 GiB
    from e31_worker.attempt.cgroups import JobCgroups
    cgroups = JobCgroups.for_node(f"test-{os.getpid()}@sandbox")
    if cgroups is None:
        pytest.skip("this machine lets the tests create no memory cgroup")
    p = jail.plan(command=python("b = bytearray(1 << 30); print(len(b))"),
                  resources={"gpus": 0, "mem_gb": 0.0625})

    # When it runs in its sandbox
    try:
        result = jail.run(p, cgroups=cgroups)
    finally:
        cgroups.reap()

    # Then its cgroup capped it and the attempt says why
    assert result.reason is AttemptReason.OOM, (result, p.log_path.read_text())
    assert result.exit_code == -9


def test_a_child_the_worker_cannot_start_is_the_pools_fault_and_a_missing_program_the_jobs(
        jail: Jail, tmp_path: Path) -> None:
    # Given a job whose program is there, on a worker whose bubblewrap is gone since it started
    ok = jail.plan(command=["true"])
    jail.sandbox.bwrap = str(tmp_path / "bwrap-gone")

    # When the worker starts its child
    outcome = jail.run(ok)

    # Then the attempt is the pool's `worker_crashed` (retried on the pool's account), saying so
    assert outcome.reason is AttemptReason.WORKER_CRASHED
    assert "could not be started" in (outcome.error or "")
    assert "could not be started" in ok.log_path.read_text()

    # And a job naming a program that is not there is the job's own error, sandboxed or not
    missing = jail.plan(command=[str(tmp_path / "no-such-program")])
    assert jail.run(missing, sandboxed=False).reason is AttemptReason.ERROR
    jail.sandbox = Sandbox.from_settings(jail.settings)
    assert jail.run(jail.plan(command=[str(tmp_path / "no-such-program")])).reason \
        is AttemptReason.ERROR
