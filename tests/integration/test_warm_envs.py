"""A warm process per job environment (`e31_worker.attempt.warm.WarmPool`) with real processes:
two job environments built by the worker's own builder (uv, over the worker's environment,
offline: they ask for nothing the worker lacks), the worker's own warm process beside them;
an environment's first attempt starts cold while its warm process starts, the next warm in
that environment (its `sys.prefix`); over the memory budget the least recently used job
environment's warm process is stopped, never the worker's (docs/architecture.md, "The warm
start")."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e31.core.records import Outcome
from e31.core.spec import JobSpec
from e31.core.states import AttemptReason, Start
from e31_worker.attempt.environment import BaseEnv, EnvRequest, UvBuild, uv_binary
from e31_worker.attempt.plan import AttemptPlan, Directive
from e31_worker.attempt.supervisor import Supervisor
from e31_worker.attempt.warm import WarmPool, WarmStarter, warm_env
from tests.conftest import process_alive, wait_for

READY_S = 180.0
BIG_BUDGET = 1 << 40

JOBS = """\
import os, sys


def where(ctx):
    return {'prefix': sys.prefix, 'executable': sys.executable, 'pid': os.getpid()}
"""


@pytest.fixture(scope="module")
def jobs_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    jobs = tmp_path_factory.mktemp("envjobs")
    jobs.chmod(0o755)
    (jobs / "envjobs.py").write_text(JOBS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(jobs), prepend=os.pathsep)
        yield jobs


@pytest.fixture(scope="module")
def venvs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two job environments as a worker builds them (the build a `python:` job gets)."""
    built = []
    for name in ("env-a", "env-b"):
        scratch = tmp_path_factory.mktemp(name)
        UvBuild(EnvRequest(pip=()), BaseEnv.current(), uv=uv_binary(),
                log_path=scratch / "build.log", beat=lambda: None, beat_s=5.0,
                timeout_s=120.0)(scratch)
        built.append(scratch / "env")
    return built[0], built[1]


@pytest.fixture
def pool(jobs_dir: Path) -> Iterator[WarmPool]:
    """A worker process's warm processes (its job environments' are started by its jobs)."""
    env = warm_env(os.environ)
    base = WarmStarter(env=env)
    p = WarmPool(base, budget_bytes=BIG_BUDGET, env=env)
    p.start()
    assert base.wait_ready(READY_S), "the worker's warm process did not start"
    yield p
    p.close()


class Runner:
    def __init__(self, tmp_path: Path, pool: WarmPool) -> None:
        self.tmp_path, self.pool = tmp_path, pool
        self.starts: list[Start] = []
        self.n = 0

    def job(self, venv: Path | None) -> Outcome:
        self.n += 1
        job_id = f"j-env{self.n}"
        plan = AttemptPlan(job_id=job_id, attempt=1,
                           spec=JobSpec.parse({"timeout_s": 60, "entrypoint": "envjobs:where"}),
                           gpus="", root=self.tmp_path / job_id / "attempt-1", kill_grace_s=1.0,
                           log_max_bytes=1 << 20, tick_interval_s=0.1, venv=venv)
        outcome = Supervisor(plan, tick=lambda _: Directive.CONTINUE, warm=self.pool,
                             on_start=lambda _ms, how: self.starts.append(how)).run()
        assert outcome.reason is AttemptReason.SUCCEEDED, (outcome, plan.log_path.read_text())
        return outcome

    def warm_in(self, venv: Path) -> WarmStarter:
        """Wait until the environment's warm process is ready (without using it)."""
        warm = self.pool._envs[str(venv)]
        assert warm.wait_ready(READY_S), f"the warm process of {venv} did not start"
        return warm


def prefix(outcome: Outcome) -> str:
    result: dict[str, Any] = outcome.result
    return os.path.realpath(result["prefix"])


def test_a_job_environment_gets_its_own_warm_process_within_the_memory_budget(
        tmp_path: Path, pool: WarmPool, venvs: tuple[Path, Path]) -> None:
    run = Runner(tmp_path, pool)
    env_a, env_b = venvs
    base_pid = pool.base.pid

    # When a job of environment A runs twice
    first = run.job(env_a)
    warm_a = run.warm_in(env_a)
    second = run.job(env_a)

    # Then the first started cold (while A's warm process started), the second was forked
    # from A's warm process, and both ran in A's environment, not the worker's
    assert run.starts == [Start.COLD, Start.WARM]
    assert prefix(first) == prefix(second) == os.path.realpath(env_a)
    assert prefix(second) != os.path.realpath(sys.prefix)
    assert second.result["executable"] == str(env_a / "bin" / "python")
    assert warm_a.pid is not None and warm_a.memory_bytes() > 0

    # And a job of the worker's own environment is still forked from the worker's
    own = run.job(None)
    assert run.starts[-1] is Start.WARM
    assert prefix(own) == os.path.realpath(sys.prefix)

    # And within the budget a second environment's warm process joins A's, which stays
    run.job(env_b)
    warm_b = run.warm_in(env_b)
    assert run.job(env_b) and run.starts[-2:] == [Start.COLD, Start.WARM]
    pool.trim()     # within the budget: nothing to stop
    pid_a, pid_b = warm_a.pid, warm_b.pid
    assert pid_a is not None and process_alive(pid_a)
    assert pid_b is not None and pool.base.pid == base_pid

    # Over the budget: the least recently used job environment goes cold
    run.starts.clear()
    # Given a budget smaller than one warm process (so any two are over it); B used last
    pool.budget_bytes = 1 << 20

    # When a job of A runs
    run.job(env_a)

    # Then it ran warm, and B's warm process (the least recently used) was stopped
    assert run.starts == [Start.WARM]
    wait_for(lambda: not process_alive(pid_b), timeout_s=10, what="B's warm process gone")
    assert process_alive(pid_a)

    # And B's next job starts cold; once B is warm again A's warm process goes, and B's
    # next job is warm
    run.job(env_b)
    assert run.starts[-1] is Start.COLD
    run.warm_in(env_b)
    wait_for(lambda: not process_alive(pid_a), timeout_s=10, what="A's warm process gone")
    run.job(env_b)
    assert run.starts[-1] is Start.WARM

    # And the worker's own warm process was never stopped: the same one forks its job
    run.job(None)
    assert run.starts[-1] is Start.WARM and pool.base.pid == base_pid
    assert process_alive(base_pid)


def test_an_environment_that_cannot_import_the_warm_process_starts_cold_and_says_why(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    env = warm_env(os.environ)
    pool = WarmPool(WarmStarter(env=env), budget_bytes=BIG_BUDGET, env=env)
    # Given a job environment that does not reach the worker's packages (a bare venv: no
    # system site-packages, no .pth of the worker's site directories)
    bare = tmp_path / "bare"
    subprocess.run([uv_binary(), "venv", "--quiet", "--python", sys.executable, str(bare)],
                   check=True, env={**os.environ, "UV_PYTHON_DOWNLOADS": "never"})

    # When its first attempt asks for its warm process
    with caplog.at_level(logging.WARNING, logger="e31_worker.attempt.warm"):
        warm = pool.starter(bare)
        assert warm is not None
        wait_for(lambda: warm.disabled_because, timeout_s=30, what="the probe's verdict")

    # Then it has none (its attempts start cold), and the worker's log says what it lacks
    assert pool.starter(bare) is None and warm.pid is None
    assert "cannot import e31_worker.child.zygote" in str(warm.disabled_because)
    assert "warm_env_unavailable" in caplog.text and str(bare) in caplog.text
    # while the worker's own environment keeps its own
    assert pool.starter(None) is pool.base
    pool.close()
