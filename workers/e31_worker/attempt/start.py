"""How an attempt's child starts, warm or cold (`Start`), and how long it took.

Warm: an entrypoint job is forked from the warm process of its environment
(`e31_worker.attempt.warm`: the worker's own, or its job environment's), which enters the
same sandbox after the fork; the supervisor then holds a `WarmChild`. Cold: a new interpreter
(through bubblewrap when sandboxed): command jobs, a job environment's attempts while its warm
process starts, and any attempt a warm process could not fork; forked by the worker process's
spawner (`e31_worker.attempt.spawn`: a `PipedChild`), else by `subprocess.Popen`. All are a
`Child` to the supervisor, so supervising, stopping and the verdict are one code path.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from typing import IO, Protocol

from e31.core.states import Start
from e31_worker.attempt.cgroups import JobCgroup
from e31_worker.attempt.jobenv import inherited_env
from e31_worker.attempt.logpump import read_available
from e31_worker.attempt.plan import AttemptPlan, OnStart
from e31_worker.attempt.sandbox import AttemptSandbox, read_job_file
from e31_worker.attempt.spawn import Spawner
from e31_worker.attempt.warm import STARTED_TIMEOUT_S, WarmChild, WarmPool, WarmStarter
from e31_worker.child.spawner import child_setup

log = logging.getLogger(__name__)

STARTED_NOTE_MAX_BYTES = 4096  # the runner's `started` note: one number
WARM_FAILURE_SHOWN_BYTES = 2000  # of a failed warm child's output, in the worker's log


class Child(Protocol):
    """What the supervisor drives of an attempt's child: a `Popen`, or a `PipedChild`."""

    pid: int
    returncode: int | None

    @property
    def stdout(self) -> IO[bytes] | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class ChildStart:
    """Starts one attempt's child (module docstring) and tells `on_start` how long it took
    and how: a warm or command job's once it runs, a cold entrypoint job's once it ended
    (`note_cold`), from the time its runner noted before the job's code."""

    def __init__(self, plan: AttemptPlan, *, sandbox: AttemptSandbox | None,
                 warm: WarmStarter | WarmPool | None, on_start: OnStart | None,
                 spawner: Spawner | None = None) -> None:
        self._plan = plan
        self._sandbox = sandbox      # None: the job runs as the worker's user (process)
        self._warm = warm            # None: every attempt starts cold; a starter: only
        #                              the worker's environment's attempts start warm
        self._on_start = on_start    # told how many ms the child took to start, and how
        self._spawner = spawner      # forks the cold child; None: `Popen` does

    def start(self, argv: list[str], cgroup: JobCgroup | None, started: float) -> Child:
        """The child, warm if it can be, else cold (in its cgroup and sandbox from its first
        byte); raises OSError, ValueError or SubprocessError when it cannot be started."""
        plan = self._plan
        warm = self._warm_starter() if plan.spec.entrypoint else None
        if warm is not None:
            child = self._fork_warm(started, warm, cgroup)
            if child is not None:
                return child
        command, env, launch = argv, self.env(), None
        if self._sandbox is not None:
            launch = self._sandbox.launch(
                argv, env, root=plan.root, cwd=plan.cwd,
                writable=(plan.work_dir, plan.output_dir, plan.checkpoint_dir, plan.input_dir),
                read_only=[*(p for p in (plan.code_dir, plan.venv) if p is not None),
                           *plan.input_binds])
            command, env = launch.argv, launch.env
        procs = [str(p) for p in cgroup.procs_files] if cgroup is not None else []
        proc: Child | None = None
        if self._spawner is not None:
            proc = self._spawner.spawn(command, env, cwd=str(plan.cwd), cgroup_procs=procs,
                                       enter=launch.spec if launch is not None else None)
        if proc is None:   # no spawner, or it is broken: this process forks the child
            setup = child_setup(procs, launch.spec if launch is not None else None)
            proc = subprocess.Popen(command, cwd=plan.cwd, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=setup)
        if not plan.spec.entrypoint and self._on_start is not None:
            self._on_start((time.monotonic() - started) * 1000, Start.COLD)
        return proc

    def _warm_starter(self) -> WarmStarter | None:
        """The warm process of the attempt's environment (the job's own, else the worker's);
        None: it starts cold."""
        if isinstance(self._warm, WarmPool):
            return self._warm.starter(self._plan.venv)
        return self._warm if self._plan.venv is None else None

    def _fork_warm(self, started: float, warm: WarmStarter,
                   cgroup: JobCgroup | None) -> WarmChild | None:
        """Fork the attempt from the warm process and wait until its job is about to run its
        first line; None (start it cold) when there is no warm process or the fork failed."""
        plan = self._plan
        argv = self.argv()   # writes job.json
        env = self.env()
        request: dict[str, object] = {
            "job_file": argv[-1], "cwd": str(plan.cwd), "env": env, "sandbox": None,
            "cgroup_procs": [str(p) for p in cgroup.procs_files] if cgroup is not None else []}
        if self._sandbox is not None:
            view, env = self._sandbox.warm_view(
                env, root=plan.root,
                writable=(plan.work_dir, plan.output_dir, plan.checkpoint_dir, plan.input_dir),
                read_only=[*(p for p in (plan.code_dir, plan.venv) if p is not None),
                           *plan.input_binds])
            request.update(env=env, sandbox={"uid": self._sandbox.uid,
                                             "network": self._sandbox.network,
                                             "net": self._sandbox.net_plan(), "view": view})
        child = warm.fork(request)
        if child is None:
            return None
        at = child.started(STARTED_TIMEOUT_S)
        if at is None:   # it ended, or hung, before the job's code: our failure, not the job's
            child.kill()
            killpg(child.pid, signal.SIGKILL)
            child.wait()
            said = read_available(child.stdout.fileno(), WARM_FAILURE_SHOWN_BYTES)
            child.close()
            log.warning("warm_child_failed job=%s attempt=%d: %s; starting it cold",
                        plan.job_id, plan.attempt, said.strip() or "no output")
            warm.child_failed(said.strip().splitlines()[-1] if said.strip() else "no output")
            plan.log_path.write_bytes(b"")
            return None
        warm.child_started()
        if self._on_start is not None:
            self._on_start(max(0.0, at - started) * 1000, Start.WARM)
        return child

    def note_cold(self, proc: Child, started: float) -> None:
        """A cold entrypoint job's start, once it ended: to the time its runner noted before
        the job's code (`started`), else (it never got there) to the end of its start."""
        if isinstance(proc, WarmChild) or not self._plan.spec.entrypoint:
            return
        if self._on_start is None:
            return
        try:
            raw = read_job_file(self._plan.root / "started", max_bytes=STARTED_NOTE_MAX_BYTES)
            at = float(json.loads(raw)["monotonic"]) if raw is not None else None
        except (ValueError, KeyError, TypeError):
            at = None
        if at is None or not started <= at <= time.monotonic():
            at = started
        self._on_start((at - started) * 1000, Start.COLD)

    def argv(self) -> list[str]:
        """The child's command line: the job runner over `job.json` (written now) for an
        entrypoint job, the job's own argv for a command job."""
        spec = self._plan.spec
        if spec.entrypoint:
            job_file = self._plan.root / "job.json"
            job_file.write_text(json.dumps({"entrypoint": spec.entrypoint, "params": spec.params}))
            return [self._plan.python, "-m", "e31_worker.child.runner", str(job_file)]
        assert spec.command is not None  # a valid spec holds exactly one of the two
        return list(spec.command)

    def env(self) -> dict[str, str]:
        """The child's environment: the allowlisted part of the worker's, the spec's `env`,
        its secrets, its own environment's paths and the job's E31_* paths."""
        plan = self._plan
        # Only the allowlisted part of the worker's environment: its credentials (AWS_*, ...)
        # and its own E31_* settings (store and broker URLs) are not the job's business.
        env = inherited_env(os.environ, plan.env_passthrough)
        env.update(plan.spec.env)
        env.update(plan.secret_env)
        if plan.venv is not None:  # `python` and its scripts are the job environment's
            env["VIRTUAL_ENV"] = str(plan.venv)
            env["PATH"] = f"{plan.venv / 'bin'}{os.pathsep}{env.get('PATH', os.defpath)}"
            env.pop("PYTHONHOME", None)
        env.update({
            "CUDA_VISIBLE_DEVICES": plan.gpus, "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "E31_JOB_ID": plan.job_id, "E31_ATTEMPT": str(plan.attempt),
            "E31_OUTPUT_DIR": str(plan.output_dir), "E31_CHECKPOINT_DIR": str(plan.checkpoint_dir),
            "E31_PROGRESS_PATH": str(plan.progress_path), "PYTHONUNBUFFERED": "1",
            "E31_INPUT_DIR": str(plan.input_dir), "E31_SCRATCH_DIR": str(plan.work_dir),
        })
        if plan.outputs_max_bytes is not None:
            env["E31_OUTPUTS_MAX_BYTES"] = str(plan.outputs_max_bytes)
        if plan.spec.code is not None:   # the job's own modules come first
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(plan.code_dir), env.get("PYTHONPATH")) if p)
        return env


def killpg(pgid: int, sig: int) -> None:
    """Signal a process group that may be gone already."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
