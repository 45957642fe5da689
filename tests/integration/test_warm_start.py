"""The warm start (`e31_worker.attempt.warm`, `e31_worker.child.zygote`) with real processes:
an entrypoint job forked from a warm process that imported torch and never initialised CUDA;
nothing of one job reaches the next; a dead warm process costs a cold start, never a job;
timeout and cancel still kill everything; the sandbox still holds (docs/architecture.md,
"The warm start")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from e31.core.records import Claim, Outcome
from e31.core.spec import JobSpec
from e31.core.states import AttemptReason, Start
from e31.edge.settings import Settings
from e31_worker.attempt.groups import GroupRegistry
from e31_worker.attempt.plan import AttemptPlan, Directive
from e31_worker.attempt.sandbox import Sandbox, sandbox_unavailable
from e31_worker.attempt.supervisor import Supervisor
from e31_worker.attempt.warm import WarmStarter, warm_env
from tests.conftest import job_processes, process_alive, wait_for

TENANT = "t-0123456789ab"
READY_S = 120.0

LEAKMOD = "STATE = 'clean'\n"
JOBS = """\
import os, signal, sys, threading, time

import leakmod


def dirty(ctx):
    '''Change everything a job could leave behind in its process.'''
    import torch
    leakmod.STATE = 'dirty'
    threading.Thread(target=time.sleep, args=(60,), name='leaky', daemon=True).start()
    os.environ['LEAKED_VAR'] = '1'
    fd = os.open('/dev/null', os.O_RDONLY)
    signal.signal(signal.SIGUSR1, lambda *_: None)
    torch.set_num_threads(7)
    return {'fd': fd}


def check(ctx, fd):
    '''What the next job finds of it.'''
    import torch
    try:
        held = os.readlink(f'/proc/self/fd/{fd}') == '/dev/null'
    except OSError:
        held = False
    return {'module_global': leakmod.STATE, 'threads': [t.name for t in threading.enumerate()],
            'env': os.environ.get('LEAKED_VAR'), 'fd': held,
            'handler': signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL,
            'torch_threads': torch.get_num_threads()}


def both(ctx):
    '''The two jobs one after the other in one process: what the checks see of a leak.'''
    return check(ctx, dirty(ctx)['fd'])


def cuda(ctx):
    import torch
    return {'initialized': torch.cuda.is_initialized(), 'pid': os.getpid()}


def sleep(ctx, seconds):
    time.sleep(seconds)
    return {'slept': seconds}


def family(ctx, marker):
    '''Start grandchildren (a subprocess and a fork), say so, and hang.'''
    import subprocess
    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])
    if os.fork() == 0:
        time.sleep(300)
        os._exit(0)
    open(marker, 'w').write('started')
    time.sleep(300)


def probe(ctx, home, store, other, redis_port):
    '''The sandbox's attacks: what the job can reach of the host.'''
    import socket
    out = {'uid': os.getuid(), 'pids': sorted(int(p) for p in os.listdir('/proc')
                                                if p.isdigit())}
    out['home'] = sorted(os.listdir(home)) if os.path.isdir(home) else None
    for name, path in (('store', store), ('other', other), ('shadow', '/etc/shadow')):
        try:
            data = open(path).read()
            out[name] = 'read' if name == 'shadow' else data
        except OSError as exc:
            out[name] = type(exc).__name__
    try:
        socket.create_connection(('127.0.0.1', redis_port), timeout=2).close()
        out['redis'] = 'connected'
    except OSError as exc:
        out['redis'] = type(exc).__name__
    out['worker_visible'] = os.path.exists(f'/proc/{os.getppid()}/environ') and \\
        os.getppid() > 1
    return out
"""


@pytest.fixture(scope="module")
def jobs_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The test jobs, on the PYTHONPATH of the warm process and of every job."""
    jobs = tmp_path_factory.mktemp("warmjobs")
    jobs.chmod(0o755)
    (jobs / "leakmod.py").write_text(LEAKMOD)
    (jobs / "warmjobs.py").write_text(JOBS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(jobs), prepend=os.pathsep)
        yield jobs


def starter() -> WarmStarter:
    warm = WarmStarter(preload=["leakmod"], env=warm_env(os.environ))
    warm.start()
    assert warm.wait_ready(READY_S), "the warm process did not start"
    return warm


@pytest.fixture(scope="module")
def warm(jobs_dir: Path) -> Iterator[WarmStarter]:
    w = starter()
    yield w
    w.close()


class Runner:
    """Runs job specs through a Supervisor with the warm process (and a sandbox, if given)."""

    def __init__(self, tmp_path: Path, warm: WarmStarter | None,
                 sandbox: Sandbox | None = None, work: Path | None = None) -> None:
        self.work = work or tmp_path / "work"
        self.warm = warm
        self.sandbox = sandbox
        self.starts: list[tuple[float, Start]] = []
        self.n = 0

    def plan(self, timeout_s: float = 60, **spec: Any) -> AttemptPlan:
        self.n += 1
        job_id = f"j-warm{self.n}"
        return AttemptPlan(job_id=job_id, attempt=1,
                           spec=JobSpec.parse({"timeout_s": timeout_s, **spec}), gpus="",
                           root=self.work / job_id / "attempt-1", kill_grace_s=1.0,
                           log_max_bytes=1 << 20, tick_interval_s=0.1)

    def run(self, p: AttemptPlan, tick: Callable[[Any], Directive] | None = None) -> Outcome:
        sandbox = None
        if self.sandbox is not None:
            claim = Claim(job_id=p.job_id, tenant_id=TENANT, token=1, attempt=1, spec=p.spec,
                          gpus=0)
            sandbox = self.sandbox.for_attempt(claim)
        return Supervisor(p, tick=tick or (lambda _: Directive.CONTINUE), sandbox=sandbox,
                          on_start=lambda ms, how: self.starts.append((ms, how)),
                          warm=self.warm).run()

    def job(self, fn: str, **params: Any) -> Outcome:
        return self.run(self.plan(entrypoint=f"warmjobs:{fn}", params=params))


@pytest.fixture
def runner(tmp_path: Path, warm: WarmStarter) -> Runner:
    return Runner(tmp_path, warm)


def test_a_warm_torch_job_finds_cuda_uninitialised_and_the_warm_process_maps_no_cuda(
        runner: Runner, warm: WarmStarter) -> None:
    # When a job that imports torch is started warm
    result = runner.job("cuda")

    # Then it was forked (warm, timed), and torch had not initialised CUDA before its code
    assert result.reason is AttemptReason.SUCCEEDED, result
    assert runner.starts[0][1] is Start.WARM and runner.starts[0][0] >= 0
    assert result.result["initialized"] is False
    # And the warm process holds torch but no CUDA library (read from its memory map; torch's
    # own library being there shows the reading sees what is loaded)
    assert warm.pid is not None
    maps = Path(f"/proc/{warm.pid}/maps").read_text()
    assert "libtorch" in maps
    assert "libcuda" not in maps and "libcudart" not in maps and "libnvidia" not in maps


def test_nothing_one_job_changes_reaches_the_next_job(runner: Runner, jobs_dir: Path) -> None:
    # Given a job that changed a preloaded module's global, started a thread, set a variable,
    # opened a file, set a signal handler and torch's threads, forked from the warm process
    dirtied = runner.job("dirty")
    assert dirtied.reason is AttemptReason.SUCCEEDED, dirtied

    # When the next job is forked from the same warm process
    checked = runner.job("check", fd=dirtied.result["fd"])

    # Then it finds none of it
    assert [how for _, how in runner.starts] == [Start.WARM, Start.WARM]
    found = checked.result
    assert found["module_global"] == "clean"
    assert "leaky" not in found["threads"]
    assert found["env"] is None and found["fd"] is False and found["handler"] is False
    assert found["torch_threads"] != 7

    # And the same two jobs run in one process (no fork between them) do see all of it: the
    # checks can fail
    both = runner.job("both")
    assert both.reason is AttemptReason.SUCCEEDED, both
    leaked = both.result
    assert leaked["module_global"] == "dirty" and "leaky" in leaked["threads"]
    assert leaked["env"] == "1" and leaked["fd"] is True and leaked["handler"] is True
    assert leaked["torch_threads"] == 7


def test_a_command_job_starts_cold_and_says_so(runner: Runner) -> None:
    result = runner.run(runner.plan(command=[sys.executable, "-c", "print('hi')"]))
    assert result.reason is AttemptReason.SUCCEEDED
    assert [how for _, how in runner.starts] == [Start.COLD]


def test_without_a_warm_process_an_entrypoint_starts_cold(tmp_path: Path, jobs_dir: Path) -> None:
    # The cold path stays: a worker with the warm start off runs the same job in a new
    # interpreter, and still times it to the job's first line
    cold = Runner(tmp_path, None)
    result = cold.job("sleep", seconds=0)
    assert result.reason is AttemptReason.SUCCEEDED and result.result == {"slept": 0}
    assert [how for _, how in cold.starts] == [Start.COLD] and cold.starts[0][0] > 0


def test_killing_the_warm_process_loses_no_job(tmp_path: Path, jobs_dir: Path) -> None:
    # Given a worker's warm process, and a job forked from it that is still running
    warm = starter()
    try:
        runner = Runner(tmp_path, warm)
        running: list[Outcome] = []
        during = threading.Thread(target=lambda: running.append(runner.job("sleep", seconds=2)))
        during.start()
        wait_for(lambda: len(runner.starts) == 1, what="the first job to start")
        first_zygote = warm.pid
        assert first_zygote is not None

        # When the warm process is killed mid-stream
        os.kill(first_zygote, signal.SIGKILL)
        wait_for(lambda: not process_alive(first_zygote), what="the warm process to die")

        # Then the next attempt starts cold and succeeds, the running job ends as it would,
        next_one = runner.job("cuda")
        during.join(timeout=60)
        assert next_one.reason is AttemptReason.SUCCEEDED, next_one
        assert running and running[0].reason is AttemptReason.SUCCEEDED, running
        assert runner.starts[1][1] is Start.COLD
        # and once the warm process is replaced, jobs start warm again
        assert warm.wait_ready(READY_S) and warm.pid != first_zygote
        again = runner.job("cuda")
        assert again.reason is AttemptReason.SUCCEEDED
        assert runner.starts[2][1] is Start.WARM
    finally:
        warm.close()


@pytest.mark.parametrize("stop", ["timeout", "cancel"])
def test_a_warm_job_with_grandchildren_is_killed_whole_on_timeout_and_on_cancel(
        runner: Runner, tmp_path: Path, stop: str) -> None:
    marker = tmp_path / "started"
    p = runner.plan(timeout_s=3 if stop == "timeout" else 60, entrypoint="warmjobs:family",
                    params={"marker": str(marker)})
    seen: list[int] = []

    def tick(_: Any) -> Directive:
        if marker.exists() and not seen:
            seen.extend(job_processes(p.job_id))   # the job and its grandchildren
        return Directive.CANCEL if stop == "cancel" and seen else Directive.CONTINUE

    # When the job forks grandchildren and then hangs, or is cancelled
    result = runner.run(p, tick)

    # Then it ends with that reason, and none of its processes is left
    assert result.reason is (AttemptReason.TIMEOUT if stop == "timeout"
                             else AttemptReason.CANCELLED), result
    assert len(seen) >= 3, seen   # outer, the job, two grandchildren
    wait_for(lambda: not job_processes(p.job_id), what="every process of the job to end")


@pytest.fixture(scope="module")
def sandbox_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("warmhome")
    home.chmod(0o700)
    return home


@pytest.mark.parametrize("sandboxed", [True, False], ids=["sandbox", "no-sandbox"])
def test_the_sandbox_holds_for_a_warm_job(sandboxed: bool, sandbox_home: Path,
                                         warm: WarmStarter, redis_url: str) -> None:
    # Given a sandboxed worker's settings (E31_HOME 0700 holding the store and another attempt)
    settings = Settings.load({"home": str(sandbox_home)}, environ={})
    why = sandbox_unavailable(settings)
    if why is not None:
        pytest.skip(f"no sandbox on this machine: {why}")
    store = sandbox_home / "e31.db"
    store.write_text("the store")
    other = settings.resolved_work_dir / "j-other" / "attempt-1" / "output" / "secret.txt"
    other.parent.mkdir(parents=True, exist_ok=True)
    other.write_text("another tenant's output")
    runner = Runner(sandbox_home, warm, Sandbox.from_settings(settings) if sandboxed else None,
                    work=settings.resolved_work_dir)
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])

    # When a warm job with network: none tries to reach them
    result = runner.run(runner.plan(entrypoint="warmjobs:probe", network="none", params={
        "home": str(sandbox_home), "store": str(store), "other": str(other),
        "redis_port": port}) if sandboxed else runner.plan(
        entrypoint="warmjobs:probe", params={"home": str(sandbox_home), "store": str(store),
                                             "other": str(other), "redis_port": port}))

    assert result.reason is AttemptReason.SUCCEEDED, result
    assert runner.starts[0][1] is Start.WARM
    found = result.result
    if sandboxed:
        # Then it runs as its tenant's uid, alone in its PID namespace, and reaches nothing
        assert found["uid"] == runner.sandbox.uid_for(TENANT)   # type: ignore[union-attr]
        assert max(found["pids"]) <= 3 and found["worker_visible"] is False
        assert found["home"] in (None, [], ["work"])   # at most the way to its own attempt
        assert found["store"] == found["other"] == "FileNotFoundError"
        assert found["shadow"] == "PermissionError"
        assert found["redis"] != "connected"
    else:
        # While the same job without the sandbox reaches each one: the attacks are real
        assert found["uid"] == 0 and found["worker_visible"] is True
        assert "e31.db" in found["home"]
        assert found["store"] == "the store" and found["other"] == "another tenant's output"
        assert found["shadow"] == "read"
        assert found["redis"] == "connected"


WORKER = """\
import os, sys
from pathlib import Path
from e31.core.spec import JobSpec
from e31_worker.attempt.plan import AttemptPlan, Directive
from e31_worker.attempt.supervisor import Supervisor
from e31_worker.attempt.warm import WarmStarter, warm_env
warm = WarmStarter(env=warm_env(os.environ))
warm.start()
assert warm.wait_ready(300)
plan = AttemptPlan(job_id='j-orphaned', attempt=1, spec=JobSpec.parse({
    'entrypoint': 'warmjobs:family', 'params': {'marker': sys.argv[1]}}), gpus='',
    root=Path(sys.argv[2]), kill_grace_s=1, log_max_bytes=1 << 20, tick_interval_s=0.2)
Supervisor(plan, tick=lambda _: Directive.CONTINUE, warm=warm).run()
"""


def test_the_worker_processs_death_kills_its_warm_job(tmp_path: Path, jobs_dir: Path) -> None:
    # Given a worker process whose warm job (with grandchildren) runs
    marker = tmp_path / "started"
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(marker),
                               str(tmp_path / "attempt-1")])
    try:
        wait_for(marker.exists, timeout_s=READY_S, what="the warm job to start")
        assert len(job_processes("j-orphaned")) >= 3

        # When the worker process is killed
        worker.kill()
        worker.wait()

        # Then every process of its job ends with it (the warm process goes too)
        wait_for(lambda: not job_processes("j-orphaned"), what="the job to die with its worker")
    finally:
        worker.kill()
        worker.wait()


def test_a_restarted_worker_reaps_what_a_warm_job_left(runner: Runner, tmp_path: Path) -> None:
    # Given a warm job running, its group recorded as the worker records it
    groups = GroupRegistry(tmp_path / "groups")
    marker = tmp_path / "started"
    p = runner.plan(entrypoint="warmjobs:family", params={"marker": str(marker)})
    reaped: list[int] = []

    def tick(_: Any) -> Directive:
        if marker.exists() and not reaped:
            # When a successor of the worker reaps the groups left on its node
            reaped.append(GroupRegistry(tmp_path / "groups").reap())
        return Directive.CONTINUE

    result = Supervisor(p, tick=tick, groups=groups, warm=runner.warm,
                        on_start=lambda ms, how: runner.starts.append((ms, how))).run()

    # Then it found the warm job's processes by their E31_JOB_ID and killed them
    assert runner.starts[0][1] is Start.WARM
    assert reaped and reaped[0] >= 2, reaped
    assert result.reason is AttemptReason.ERROR and "SIGKILL" in (result.error or ""), result
    wait_for(lambda: not job_processes(p.job_id), what="every process of the job to end")
