"""One child process per attempt: its own process group and directory, a capped log,
timeout and cancel through SIGTERM → grace → SIGKILL of the whole group; in a sandbox
(`e31_worker.attempt.sandbox`) where the worker has one.

The supervisor is the run of the attempt's stages (e31_worker.attempt.stages): it makes the
child's cgroup and watch of its disk (`attemptlimits`), starts it warm or cold (`start`), copies its
output into the log (`logpump`), and then waits for its end, for its timeout (the one clock it
keeps itself: it wakes at the deadline, not at the next beat), for its disk limit, or for what
its `tick` (the watchdog's: the lease and idleness) asks; whatever stops it is one kill path,
and the verdict is one function (`outcomes` for the child's own end).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import subprocess
import threading
import time
from typing import TypeAlias

from e31.core.records import Outcome
from e31.core.states import AttemptReason
from e31_worker.attempt.attemptlimits import AttemptLimits, DiskWatch, discard_writes
from e31_worker.attempt.cgroups import JobCgroup, JobCgroups
from e31_worker.attempt.groups import GroupRegistry
from e31_worker.attempt.logpump import LOG_DRAIN_S, pump_log
from e31_worker.attempt.outcomes import exited_outcome, start_failed_outcome, stopped_outcome
from e31_worker.attempt.plan import AttemptPlan, Directive, OnLimits, OnStart, Tick
from e31_worker.attempt.sandbox import AttemptSandbox, exit_code, read_job_file, signal_job
from e31_worker.attempt.spawn import PipedChild, Spawner
from e31_worker.attempt.start import Child, ChildStart, killpg
from e31_worker.attempt.warm import WarmPool, WarmStarter

log = logging.getLogger(__name__)

PROGRESS_MAX_BYTES = 64 * 1024  # a progress file is two numbers; a bigger one is ignored
NO_NETWORK_REFUSED = ("network: none needs a sandboxed worker; this one runs jobs with "
                      "--isolation process (docs/security.md)")

# What stopped a child: its timeout or its disk limit (a reason), or what its tick asked.
Stop: TypeAlias = AttemptReason | Directive


class Supervisor:
    """Runs one attempt's child to its end; `tick` is called every `tick_interval_s` with the
    progress, and what it returns may stop the child."""

    def __init__(self, plan: AttemptPlan, *, tick: Tick, groups: GroupRegistry | None = None,
                 cgroups: JobCgroups | None = None, sandbox: AttemptSandbox | None = None,
                 on_start: OnStart | None = None,
                 warm: WarmStarter | WarmPool | None = None,
                 spawner: Spawner | None = None,
                 on_limits: OnLimits | None = None) -> None:
        self._plan = plan
        self._tick = tick
        self._groups = groups
        self._cgroups = cgroups
        self._cgroup: JobCgroup | None = None
        self._sandbox = sandbox      # None: the job runs as the worker's user (process)
        self._start = ChildStart(plan, sandbox=sandbox, warm=warm, spawner=spawner,
                                 on_start=on_start)
        self._on_limits = on_limits  # told the limits the attempt runs under, once it started
        self._disk: DiskWatch | None = None
        self._final_progress: tuple[float, float] | None = None   # what the child last wrote

    def prepare(self) -> None:
        self._plan.make_dirs()

    def run(self) -> Outcome:
        plan = self._plan
        self.prepare()
        argv = self._start.argv()
        if self._sandbox is None and plan.spec.network == "none":
            plan.log_path.write_text(f"e31: {NO_NETWORK_REFUSED}\n")
            return Outcome(AttemptReason.ERROR, error=NO_NETWORK_REFUSED)
        limits = self._apply_limits()
        started = time.monotonic()
        try:
            proc = self._start.start(argv, self._cgroup, started)
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            outcome = start_failed_outcome(exc, argv[0], sandboxed=self._sandbox is not None)
            log.warning("child_not_started job=%s attempt=%d reason=%s: %s", plan.job_id,
                        plan.attempt, outcome.reason.value, outcome.error)
            plan.log_path.write_text(f"e31: {outcome.error}\n")
            self._remove_cgroup()
            return outcome
        stopped_for = self._watch(proc, limits)
        self._start.note_cold(proc, started)
        return self._ended(proc, stopped_for)

    def _watch(self, proc: Child, limits: AttemptLimits) -> Stop | None:
        """Say the limits it runs under, pump the child's log and supervise it to its end; whatever
        happens, the child is not left running, and the log and the group's record are
        closed."""
        plan = self._plan
        assert proc.stdout is not None
        done = threading.Event()
        pump = threading.Thread(target=pump_log, name=f"log-{plan.job_id}",
                                args=(proc.stdout.fileno(), plan.log_path, *plan.log_limit,
                                      done),
                                daemon=True)
        pump.start()
        log.info("attempt_started job=%s attempt=%d pid=%d gpus=%r", plan.job_id, plan.attempt,
                 proc.pid, plan.gpus)
        try:
            if self._on_limits is not None:
                self._on_limits(limits)
            if self._groups is not None:
                self._groups.add(proc.pid, plan.job_id)  # start_new_session: pgid == pid
            return self._supervise(proc)
        finally:
            if proc.poll() is None:  # the supervisor itself failed: never leave the job behind
                self._kill(proc, "supervisor_error")
            done.set()  # a process that left the group may hold the pipe: stop reading anyway
            pump.join(timeout=LOG_DRAIN_S + 1)
            proc.stdout.close()
            if isinstance(proc, PipedChild):
                proc.close()
            if self._groups is not None:
                self._groups.remove(proc.pid)

    def _ended(self, proc: Child, stopped_for: Stop | None) -> Outcome:
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
        outcome = self._result(code, stopped_for, oom_kills)
        if self._final_progress is None:
            return outcome
        return dataclasses.replace(outcome, progress=self._final_progress)

    def _apply_limits(self) -> AttemptLimits:
        """Make the attempt's cgroup (its processes and memory), start watching its disk, and
        say which limits hold (for `on_limits`): those its cgroup applied, its disk limit
        always."""
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
        capped = cgroup is not None and cgroup.memory_max_bytes is not None
        return AttemptLimits(
            pids_max=cgroup.pids_max if cgroup is not None else None,
            mem_gb=(plan.limits.mem_gb or plan.spec.resources.mem_gb) if capped else None,
            disk_gb=plan.limits.disk_gb, network=plan.limits.network)

    def _remove_cgroup(self) -> None:
        """Kill whatever of the job is left, even processes that left its group, and clean up."""
        if self._cgroup is not None:
            self._cgroup.remove()
            self._cgroup = None

    def _supervise(self, proc: Child) -> Stop | None:
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
        # The last progress it wrote goes with the outcome (`Outcome.progress`): a job that
        # ends between two ticks (a warm start's short job) would otherwise show none, and a
        # renewal of its own would cost a store transaction per job.
        self._final_progress = self._progress()
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
            killpg(proc.pid, sig)

    def _progress(self) -> tuple[float, float] | None:
        try:
            raw = read_job_file(self._plan.progress_path, max_bytes=PROGRESS_MAX_BYTES)
            if raw is None:
                return None
            data = json.loads(raw)
            return float(data["done"]), float(data["total"] or 0)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _result(self, code: int, stopped_for: Stop | None, oom_kills: int = 0) -> Outcome:
        """The attempt's outcome: its timeout and its disk limit, worded here where they were
        enforced; a directive's, or the child's own end (e31_worker.attempt.outcomes)."""
        plan = self._plan
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
        return exited_outcome(plan, code, oom_kills)
