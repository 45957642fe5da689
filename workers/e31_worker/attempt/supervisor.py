"""One child process per attempt: its own process group and directory, a capped log,
timeout and cancel through SIGTERM → grace → SIGKILL of the whole group; in a sandbox
(`e31_worker.attempt.sandbox`) where the worker has one.

The child starts one of two ways. Warm: an entrypoint job is forked from the warm process of
its environment (`e31_worker.attempt.warm`: the worker's own, or its job environment's),
which enters the same sandbox after the fork; the supervisor then holds a `WarmChild`. Cold:
a new interpreter (`subprocess.Popen`, through bubblewrap when sandboxed): command jobs, a
job environment's attempts while its warm process starts, and any attempt a warm process
could not fork. Both are a `Child` to the
rest of this module, so supervising, stopping and the verdict are one code path.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import IO, Protocol

from e31.core.records import Outcome
from e31.core.spec import JobSpec
from e31.core.states import AttemptReason, Start
from e31_worker.attempt.cgroups import JobCgroup, JobCgroups
from e31_worker.attempt.groups import GroupRegistry
from e31_worker.attempt.jobenv import inherited_env
from e31_worker.attempt.limits import AttemptLimits, DiskWatch, discard_writes
from e31_worker.attempt.sandbox import AttemptSandbox, exit_code, read_job_file, signal_job
from e31_worker.attempt.warm import STARTED_TIMEOUT_S, WarmChild, WarmPool, WarmStarter

log = logging.getLogger(__name__)

POLL_S = 0.1                  # the log pump's longest wait for output
PR_SET_PDEATHSIG = 1          # prctl option: signal the child when its parent thread dies
LOG_CHUNK_BYTES = 64 * 1024
LOG_DRAIN_S = 2.0             # output still read after the attempt ends
PROGRESS_MAX_BYTES = 64 * 1024  # a progress file is two numbers; a bigger one is ignored
STARTED_NOTE_MAX_BYTES = 4096  # the runner's `started` note: one number
WARM_FAILURE_SHOWN_BYTES = 2000  # of a failed warm child's output, in the worker's log
NO_NETWORK_REFUSED = ("network: none needs a sandboxed worker; this one runs jobs with "
                      "--isolation process (docs/security.md)")


class Directive(str, Enum):
    """What the supervisor's tick callback asks for."""

    CONTINUE = "continue"
    CANCEL = "cancel"         # the owner cancelled the job
    DRAIN = "drain"           # the worker is shutting down: stop and requeue
    PREEMPT = "preempt"       # the scheduler gives its GPUs to another job: stop and requeue
    LOST = "lost"             # the lease is gone: stop, record nothing
    IDLE = "idle"             # its watchdog: no sign of work for idle_timeout_s (on_idle: kill)


@dataclass(frozen=True)
class AttemptPlan:
    """One attempt as the supervisor runs it: the job's spec, its GPUs, its directory, limits."""

    job_id: str
    attempt: int
    spec: JobSpec
    gpus: str                 # CUDA_VISIBLE_DEVICES for the child ("" for the cpu class)
    root: Path                # fresh directory of this attempt
    kill_grace_s: float
    log_max_bytes: int        # this attempt's log
    tick_interval_s: float
    job_log_max_bytes: int | None = None  # all the job's attempts together; None: no such cap
    log_earlier_bytes: int = 0            # what the job's other attempts' logs hold already
    venv: Path | None = None              # the job's own environment (`python:`); None: the
    #                                       worker's (e31_worker.attempt.environment)
    # The job's secrets by name, decrypted at setup (e31_worker.attempt.secrets): the child's
    # environment only; never in a repr, a log line or a file.
    secret_env: dict[str, str] = dataclasses.field(default_factory=dict, repr=False)
    # What the job inherits of the worker's environment beyond e31_worker.attempt.jobenv's
    # allowlist: names or globs (settings `job_env_passthrough`).
    env_passthrough: tuple[str, ...] = ()
    # Local input files staged as links, bound read-only into the sandbox (attempt/inputs.py).
    input_binds: tuple[Path, ...] = ()
    # What it may use of processes, memory and disk (e31_worker.attempt.limits); a field left
    # None is not applied, but for memory, which then falls back to `resources.mem_gb`.
    limits: AttemptLimits = AttemptLimits()

    @property
    def python(self) -> str:
        """The interpreter of the job: its own environment's, else the worker's."""
        return str(self.venv / "bin" / "python") if self.venv else sys.executable

    def make_dirs(self) -> None:
        """The attempt's directories: its root, and the job's work, output and checkpoints."""
        for d in (self.work_dir, self.output_dir, self.checkpoint_dir):
            d.mkdir(parents=True, exist_ok=True)

    @property
    def log_limit(self) -> tuple[int, str]:
        """The most bytes this attempt's log may take, and the line that says where and why
        it was cut: the attempt's own cap, or what is left of the job's across attempts."""
        if self.job_log_max_bytes is not None:
            room = max(0, self.job_log_max_bytes - self.log_earlier_bytes)
            if room < self.log_max_bytes:
                return room, (f"\n[e31: log cut at {room} bytes: this job's logs reached "
                              f"job_log_max_bytes={self.job_log_max_bytes} across its attempts "
                              f"({self.log_earlier_bytes} bytes before this attempt); the rest "
                              f"was discarded]\n")
        return self.log_max_bytes, (f"\n[e31: log cut at {self.log_max_bytes} bytes; the rest "
                                    f"was discarded]\n")

    @property
    def memory_max_bytes(self) -> int | None:
        """The job's host-memory cap, enforced by its cgroup: its limits' (`resources.mem_gb`,
        else the pool's default), else `resources.mem_gb`."""
        mem_gb = self.limits.mem_gb or self.spec.resources.mem_gb
        return int(mem_gb * 1024 ** 3) if mem_gb else None

    @property
    def job_writes(self) -> tuple[Path, ...]:
        """The trees the job writes whose room its disk limit counts (docs/jobs.md)."""
        return (self.work_dir, self.output_dir, self.checkpoint_dir)

    @property
    def work_dir(self) -> Path:
        return self.root / "work"

    @property
    def output_dir(self) -> Path:
        return self.root / "output"

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / "checkpoints"

    @property
    def log_path(self) -> Path:
        return self.root / "attempt.log"

    @property
    def progress_path(self) -> Path:
        return self.root / "progress.json"

    @property
    def code_dir(self) -> Path:
        """The job's code bundle, unpacked read-only (only when its spec names one: `code`)."""
        return self.root / "code"

    @property
    def input_dir(self) -> Path:
        """Where the job's inputs are staged, one entry per name ($E31_INPUT_DIR)."""
        return self.root / "inputs"

    @property
    def cwd(self) -> Path:
        """Where the job starts: in its code when it brought some, else in its work dir."""
        return self.code_dir if self.spec.code is not None else self.work_dir


Tick = Callable[[tuple[float, float] | None], Directive]
OnStart = Callable[[float, Start], None]
OnLimits = Callable[[AttemptLimits], None]


class Child(Protocol):
    """What the supervisor drives of an attempt's child: a `Popen`, or a `WarmChild`."""

    pid: int
    returncode: int | None

    @property
    def stdout(self) -> IO[bytes] | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class Supervisor:
    """Runs one attempt's child to its end; `tick` is called every `tick_interval_s` with the
    progress, and what it returns may stop the child."""

    def __init__(self, plan: AttemptPlan, *, tick: Tick, groups: GroupRegistry | None = None,
                 cgroups: JobCgroups | None = None, sandbox: AttemptSandbox | None = None,
                 on_start: OnStart | None = None,
                 warm: WarmStarter | WarmPool | None = None,
                 on_limits: OnLimits | None = None) -> None:
        self._plan = plan
        self._tick = tick
        self._groups = groups
        self._cgroups = cgroups
        self._cgroup: JobCgroup | None = None
        self._sandbox = sandbox      # None: the job runs as the worker's user (process)
        self._on_start = on_start    # told how many ms the child took to start, and how
        self._warm = warm            # None: every attempt starts cold; a starter: only
        #                              the worker's environment's attempts start warm
        self._on_limits = on_limits  # told the limits the attempt runs under, before it starts
        self._disk: DiskWatch | None = None

    def prepare(self) -> None:
        self._plan.make_dirs()

    def run(self) -> Outcome:
        plan = self._plan
        self.prepare()
        argv = self._argv()
        if self._sandbox is None and plan.spec.network == "none":
            plan.log_path.write_text(f"e31: {NO_NETWORK_REFUSED}\n")
            return Outcome(AttemptReason.ERROR, error=NO_NETWORK_REFUSED)
        self._apply_limits()
        started = time.monotonic()
        proc: Child | None = None
        try:
            warm = self._warm_starter() if plan.spec.entrypoint else None
            if warm is not None:
                proc = self._fork_warm(started, warm)
            command, env, enter = argv, self._env(), None
            if proc is not None:
                pass
            elif self._sandbox is not None:
                launch = self._sandbox.launch(
                    argv, env, root=plan.root, cwd=plan.cwd,
                    writable=(plan.work_dir, plan.output_dir, plan.checkpoint_dir,
                              plan.input_dir),
                    read_only=[*(p for p in (plan.code_dir, plan.venv) if p is not None),
                               *plan.input_binds])
                command, env, enter = launch.argv, launch.env, launch.enter
            if proc is None:
                proc = subprocess.Popen(command, cwd=plan.cwd, env=env,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=_child_setup(self._cgroup, enter))
                if not plan.spec.entrypoint and self._on_start is not None:
                    self._on_start((time.monotonic() - started) * 1000, Start.COLD)
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else str(exc)
            plan.log_path.write_text(f"e31: cannot start {argv[0]}: {reason}\n")
            self._remove_cgroup()
            return Outcome(AttemptReason.ERROR, error=f"cannot start {argv[0]}: {reason}")
        assert proc.stdout is not None
        done = threading.Event()
        pump = threading.Thread(target=_pump_log, name=f"log-{plan.job_id}",
                                args=(proc.stdout.fileno(), plan.log_path, *plan.log_limit,
                                      done),
                                daemon=True)
        pump.start()
        log.info("attempt_started job=%s attempt=%d pid=%d gpus=%r", plan.job_id, plan.attempt,
                 proc.pid, plan.gpus)
        try:
            if self._groups is not None:
                self._groups.add(proc.pid, plan.job_id)  # start_new_session: pgid == pid
            stopped_for = self._supervise(proc)
        finally:
            if proc.poll() is None:  # the supervisor itself failed: never leave the job behind
                self._kill(proc, "supervisor_error")
            done.set()  # a process that left the group may hold the pipe: stop reading anyway
            pump.join(timeout=LOG_DRAIN_S + 1)
            proc.stdout.close()
            if isinstance(proc, WarmChild):
                proc.close()
            if self._groups is not None:
                self._groups.remove(proc.pid)
        if not isinstance(proc, WarmChild) and plan.spec.entrypoint:
            self._note_cold_start(started)
        return self._ended(proc, stopped_for)

    def _ended(self, proc: Child, stopped_for: AttemptReason | Directive | None) -> Outcome:
        """The outcome of the attempt whose child `proc` ended; its cgroup removed, and what
        it wrote discarded when it passed its disk limit."""
        plan = self._plan
        oom_kills = self._cgroup.oom_kills() if self._cgroup is not None else 0
        refused = self._cgroup.forks_refused() if self._cgroup is not None else 0
        self._remove_cgroup()
        if stopped_for is AttemptReason.DISK_QUOTA:   # nothing of it is shipped
            discard_writes(plan.job_writes)
        if refused:
            log.info("forks_refused job=%s attempt=%d count=%d pids_max=%s", plan.job_id,
                     plan.attempt, refused, plan.limits.pids_max)
        assert proc.returncode is not None
        code = proc.returncode if self._sandbox is None else exit_code(proc.returncode)
        return self._result(code, stopped_for, oom_kills)

    def _warm_starter(self) -> WarmStarter | None:
        """The warm process of the attempt's environment (the job's own, else the worker's);
        None: it starts cold."""
        if isinstance(self._warm, WarmPool):
            return self._warm.starter(self._plan.venv)
        return self._warm if self._plan.venv is None else None

    def _fork_warm(self, started: float, warm: WarmStarter) -> WarmChild | None:
        """Fork the attempt from the warm process and wait until its job is about to run its
        first line; None (start it cold) when there is no warm process or the fork failed."""
        plan = self._plan
        argv = self._argv()   # writes job.json
        env = self._env()
        request: dict[str, object] = {
            "job_file": argv[-1], "cwd": str(plan.cwd), "env": env, "sandbox": None,
            "cgroup_procs": ([str(p) for p in self._cgroup.procs_files]
                             if self._cgroup is not None else [])}
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
            _killpg(child.pid, signal.SIGKILL)
            child.wait()
            said = _read_available(child.stdout.fileno(), WARM_FAILURE_SHOWN_BYTES)
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

    def _note_cold_start(self, started: float) -> None:
        """A cold entrypoint job's start: to the time its runner noted before the job's code
        (`started`), else (it never got there) to the end of its start."""
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

    def _apply_limits(self) -> None:
        """Make the attempt's cgroup (its processes and memory), start watching its disk, and
        say which limits hold (`on_limits`): those its cgroup applied, its disk limit always."""
        plan = self._plan
        if self._cgroups is not None:
            self._cgroup = self._cgroups.create(plan.job_id, plan.attempt,
                                                memory_max_bytes=plan.memory_max_bytes,
                                                pids_max=plan.limits.pids_max)
        cgroup = self._cgroup
        disk_max = plan.limits.disk_max_bytes
        if disk_max is not None:
            self._disk = DiskWatch(trees=plan.job_writes, staged=(plan.input_dir,),
                                   max_bytes=disk_max)
        if self._on_limits is not None:
            capped = cgroup is not None and cgroup.memory_max_bytes is not None
            self._on_limits(AttemptLimits(
                pids_max=cgroup.pids_max if cgroup is not None else None,
                mem_gb=(plan.limits.mem_gb or plan.spec.resources.mem_gb) if capped else None,
                disk_gb=plan.limits.disk_gb, network=plan.limits.network))

    def _remove_cgroup(self) -> None:
        """Kill whatever of the job is left, even processes that left its group, and clean up."""
        if self._cgroup is not None:
            self._cgroup.remove()
            self._cgroup = None

    def _supervise(self, proc: Child) -> AttemptReason | Directive | None:
        plan = self._plan
        deadline = time.monotonic() + float(plan.spec.timeout_s)
        next_tick = time.monotonic() + plan.tick_interval_s
        while proc.poll() is None:
            now = time.monotonic()
            if now >= deadline:
                self._kill(proc, "timeout")
                return AttemptReason.TIMEOUT
            if now >= next_tick:
                next_tick = now + plan.tick_interval_s
                if self._disk is not None and self._disk.over():
                    log.warning("disk_quota job=%s attempt=%d used_bytes=%d disk_gb=%g",
                                plan.job_id, plan.attempt, self._disk.used_bytes,
                                plan.limits.disk_gb or 0)
                    self._kill(proc, "disk_quota")
                    return AttemptReason.DISK_QUOTA
                directive = self._tick(self._progress())
                if directive is not Directive.CONTINUE:
                    if proc.poll() is not None:
                        # It ended on its own while the tick ran (a slow store call): report
                        # its real outcome; a write without the lease is refused by the fence.
                        break
                    self._kill(proc, directive.value)
                    return directive
            try:  # wakes the moment the child exits, not at the next poll
                proc.wait(timeout=max(0.0, min(next_tick, deadline) - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._signal(proc, signal.SIGKILL)  # the job is over: nothing it started may linger
        final = self._progress()
        if final is not None:   # relay the last progress it wrote: a job that ends between
            try:                # two ticks (a warm start's short job) would otherwise show none
                self._tick(final)
            except Exception:  # only the progress shown depends on it
                log.exception("final_progress_not_relayed job=%s", self._plan.job_id)
        return None

    def _kill(self, proc: Child, why: str) -> None:
        """SIGTERM the group, wait the grace period, then SIGKILL the group."""
        log.info("attempt_stopping job=%s attempt=%d why=%s", self._plan.job_id,
                 self._plan.attempt, why)
        self._signal(proc, signal.SIGTERM)
        self._wait_out_grace(proc, why)
        self._signal(proc, signal.SIGKILL)
        proc.wait()

    def _wait_out_grace(self, proc: Child, why: str) -> None:
        """Wait up to the grace period for the job to exit, ticking all the while: the lease
        is renewed through the grace, so a job that ignores SIGTERM ends once with the reason
        it was stopped for (a timeout stays a timeout), not `lost` when a grace longer than
        the lease TTL outlived the lease. A tick that says the lease is gone ends the wait
        (the outcome is fenced anyway); a failing tick (the supervisor's own error) is not
        retried."""
        deadline = time.monotonic() + self._plan.kill_grace_s
        ticking = why != "supervisor_error" and why != Directive.LOST.value
        while (left := deadline - time.monotonic()) > 0:
            try:
                proc.wait(timeout=min(left, self._plan.tick_interval_s))
                return
            except subprocess.TimeoutExpired:
                pass
            if ticking and time.monotonic() < deadline:
                try:
                    ticking = self._tick(None) is not Directive.LOST
                except Exception:  # a failed store call: the grace runs its course
                    log.exception("tick_failed_in_grace job=%s", self._plan.job_id)
                    ticking = False
                if not ticking:
                    return

    def _signal(self, proc: Child, sig: int) -> None:
        """Signal the job's process group; in a sandbox, the processes of its PID namespace
        (bubblewrap, its group, would die of a SIGTERM and take the job without its grace)."""
        if self._sandbox is not None and proc.returncode is None:  # its pid is still ours
            signal_job(proc.pid, sig)
        if self._sandbox is None or sig == signal.SIGKILL:
            _killpg(proc.pid, sig)

    def _progress(self) -> tuple[float, float] | None:
        try:
            raw = read_job_file(self._plan.progress_path, max_bytes=PROGRESS_MAX_BYTES)
            if raw is None:
                return None
            data = json.loads(raw)
            return float(data["done"]), float(data["total"] or 0)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _result(self, code: int, stopped_for: AttemptReason | Directive | None,
                oom_kills: int = 0) -> Outcome:
        plan = self._plan
        if stopped_for is None and oom_kills and code != 0:  # a helper process OOM-killed
            # under a job that still exited 0 is the job's business, not a failed attempt
            return Outcome(AttemptReason.OOM, exit_code=code,
                           error="killed by the kernel's OOM killer: out of host memory"
                                 f"{_memory_limit_text(plan)}")
        if stopped_for is AttemptReason.TIMEOUT:
            return Outcome(AttemptReason.TIMEOUT, exit_code=code,
                                 error=f"timed out after {plan.spec.timeout_s:g} s")
        if stopped_for is AttemptReason.DISK_QUOTA:
            return Outcome(AttemptReason.DISK_QUOTA, exit_code=code, error=(
                f"wrote more than its disk limit of {plan.limits.disk_gb:g} GB to its scratch, "
                "outputs and checkpoints (resources.disk_gb, else the pool's attempt_disk_gb); "
                "what it wrote was removed"))
        if isinstance(stopped_for, Directive):
            return stopped_outcome(stopped_for, exit_code=code)
        if plan.spec.entrypoint:
            return self._entrypoint_result(code)
        if code == 0:
            return Outcome(AttemptReason.SUCCEEDED, exit_code=0)
        return Outcome(AttemptReason.ERROR, exit_code=code, error=_exit_text(code))

    def _entrypoint_result(self, code: int) -> Outcome:
        left = finished_outcome(self._plan.root)
        if left is not None and (code == 0 or left.reason is not AttemptReason.SUCCEEDED):
            return dataclasses.replace(left, exit_code=code)
        if code == 0:
            return Outcome(AttemptReason.ERROR, exit_code=0,
                                 error="the job exited before returning a result")
        return Outcome(AttemptReason.ERROR, exit_code=code, error=_exit_text(code))

    def _argv(self) -> list[str]:
        spec = self._plan.spec
        if spec.entrypoint:
            job_file = self._plan.root / "job.json"
            job_file.write_text(json.dumps({"entrypoint": spec.entrypoint, "params": spec.params}))
            return [self._plan.python, "-m", "e31_worker.child.runner", str(job_file)]
        assert spec.command is not None  # a valid spec holds exactly one of the two
        return list(spec.command)

    def _env(self) -> dict[str, str]:
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
        if plan.spec.code is not None:   # the job's own modules come first
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(plan.code_dir), env.get("PYTHONPATH")) if p)
        return env


def stopped_outcome(directive: Directive, *, exit_code: int | None = None) -> Outcome:
    """The outcome of an attempt that a tick's `directive` stopped (cancel, drain, a lost
    lease), while its child ran or while it was being set up."""
    if directive is Directive.CANCEL:
        return Outcome(AttemptReason.CANCELLED, exit_code=exit_code, error="cancelled by its owner")
    if directive is Directive.DRAIN:
        return Outcome(AttemptReason.DRAINED, exit_code=exit_code, error="worker shut down")
    if directive is Directive.PREEMPT:
        return Outcome(AttemptReason.PREEMPTED, exit_code=exit_code,
                       error="preempted for a job of a higher priority band or of a tenant "
                             "below its fair share; it resumes from its last checkpoint")
    if directive is Directive.IDLE:
        return Outcome(AttemptReason.IDLE, exit_code=exit_code,
                       error="stopped as idle: no log output, progress or GPU use for its "
                             "idle_timeout_s (on_idle: kill)")
    return Outcome(AttemptReason.LOST, exit_code=exit_code, error="lease lost")


def finished_outcome(root: Path) -> Outcome | None:
    """The outcome an entrypoint job wrote into its attempt directory (`root`) as it ended,
    or None if it did not finish. The runner writes it atomically before the child exits,
    so a worker restarted after its predecessor died can still record it."""
    result, error = read_job_file(root / "result.json"), read_job_file(root / "error.json")
    if result is not None:   # a regular file only: a job's link is never followed
        return Outcome(AttemptReason.SUCCEEDED, exit_code=0, result=json.loads(result)["result"])
    if error is not None:
        failure = json.loads(error)
        reason = AttemptReason.OOM if failure.get("reason") == "oom" else AttemptReason.ERROR
        return Outcome(reason, error=failure["error"])
    return None


def _memory_limit_text(plan: AttemptPlan) -> str:
    """Which memory limit an OOM-killed attempt had, for its error."""
    asked = plan.spec.resources.mem_gb
    if asked:
        return f" (its limit: resources.mem_gb={asked:g})"
    if plan.limits.mem_gb:
        return (f" (its limit: the pool's default of {plan.limits.mem_gb:g} GB for a job that "
                "asks no resources.mem_gb)")
    return ""


def _child_setup(cgroup: JobCgroup | None,
                 enter: Callable[[], None] | None = None) -> Callable[[], None]:
    """What the child does between fork and exec: enter its cgroups (so the memory and
    process caps and OOM accounting cover it from its first byte), its sandbox's `enter`
    (which drops the worker's rights), and then die with its supervisor (a change of user
    clears that).

    It runs in a child forked from a threaded worker, so it only calls what was resolved
    before the fork and raw system calls (no locks, no Python I/O objects).
    """
    prctl = prctl_function()
    procs_files = [str(p).encode() for p in cgroup.procs_files] if cgroup is not None else []
    supervisor = os.getpid()

    def setup() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)   # at once: `enter` takes milliseconds
        for procs in procs_files:
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)
        if enter is not None:
            enter()
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)   # again: the change of user cleared it
        if os.getppid() != supervisor:   # it died meanwhile: start nothing nobody watches
            os._exit(1)

    return setup


@functools.cache
def prctl_function() -> Callable[..., int]:
    """libc's prctl, loaded once in the worker (never after fork in a child)."""
    return ctypes.CDLL("libc.so.6", use_errno=True).prctl


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _pump_log(fd: int, path: Path, max_bytes: int, cut_note: str,
              done: threading.Event) -> None:
    """Copy the child's output to the log up to `max_bytes`, then write `cut_note` and
    discard the rest.

    Reads until EOF, or until LOG_DRAIN_S after `done` (the attempt is over): a process that
    escaped the group and kept the pipe open must not keep this thread and its files alive.
    """
    written = 0
    cut = False
    drain_until: float | None = None
    poller = select.poll()  # not select.select: that fails for descriptors >= 1024
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    with open(path, "ab") as out:
        while True:
            if done.is_set() and drain_until is None:
                drain_until = time.monotonic() + LOG_DRAIN_S
            if drain_until is not None and time.monotonic() >= drain_until:
                return
            if not poller.poll(POLL_S * 1000):
                continue
            chunk = os.read(fd, LOG_CHUNK_BYTES)
            if not chunk:
                return
            if cut:
                continue
            room = max_bytes - written
            out.write(chunk[:room])
            written += min(len(chunk), room)
            if len(chunk) > room:
                out.write(cut_note.encode())
                cut = True
            out.flush()


def _read_available(fd: int, max_bytes: int) -> str:
    """What a pipe holds now, up to `max_bytes` (the last ones), without waiting."""
    os.set_blocking(fd, False)
    data = b""
    try:
        while chunk := os.read(fd, 65536):
            data = (data + chunk)[-max_bytes:]
    except BlockingIOError:
        pass
    return data.decode(errors="replace")


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"
