"""The watchdog stage: what watches a running attempt and may stop it, other than its timeout
(its supervisor's own clock): its lease, and its idleness.

The lease (`LeaseKeeper`, the supervisor's tick): every beat while the setup runs or the child
runs, the lease is renewed (fenced), progress relayed and a background upload of the log and
changed checkpoints started (`Shipper.poke`); the tick says stop for a cancel, a drain, a
preemption or a lost lease. During the setup the same tick is the beat of a long build
(`lease_beat`), which stops the setup with `SetupStopped`.

The idle watch (`Watchdog`): every beat while the job's child runs (after the lease keeper's),
the watchdog looks for signs of work: the attempt's log grew, its progress changed, or one of
its GPUs is busy (utilisation above `IDLE_UTIL_PCT`; a CPU-only slot has only the first two).
A job that shows none for its `idle_timeout_s` (the spec's, else the pool's setting; off when
neither is set) is flagged idle: `idle_since` on its attempt, shown by `e31 status`, the API
and the metric `e31_jobs_idle`, and cleared if it moves again. With `on_idle: kill` it is
also stopped like a timeout and the attempt ends with reason `idle` (docs/jobs.md).

Neither is a thread: both run in the supervisor's tick, in the thread that runs the attempt.
A tick that raises ends the attempt's supervision loudly (the child is killed with
`supervisor_error`, the exception reaches the task, which ends the attempt on the pool's
account), never silently; so what may fail for a moment is caught here and survived: a
failed renewal (the lease lasts a TTL), a background upload that cannot start, a GPU
reading that fails (telemetry's NVML or a full disk under the gang ledger: logged
`gpu_sample_failed`, and the beat counts as work, as the watchdog cannot see).

The GPU readings it takes are also the attempt's GPU use: the most memory one of its GPUs
held and their mean utilisation, noted on the attempt by its outcome's write
(`gpu_mem_peak_gb`, `gpu_util_mean`).

The renewal also carries what the attempt noted of itself since the last store write (its
start, its limits, its setup's time: `e31_worker.attempt.notes`), in its own transaction.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

from e31.core.clock import utcnow
from e31.core.errors import StoreError
from e31.core.records import Claim, Outcome
from e31.ops.heartbeat import GpuSample, silence_s
from e31.store.attempts import AttemptFacts
from e31_worker.attempt.envcache import Beat
from e31_worker.attempt.notes import PendingNote
from e31_worker.attempt.plan import AttemptPlan, Directive, Tick
from e31_worker.attempt.services import AttemptServices, GpuSampler, HeldGpus
from e31_worker.attempt.shipping import Shipper
from e31_worker.attempt.stages import Attempt, Stage

log = logging.getLogger(__name__)

IDLE_UTIL_PCT = 0.0           # a GPU at or below this utilisation shows no work
BYTES_PER_GB = 1024 ** 3

Flag = Callable[[datetime | None], bool]   # store the idle flag (None clears it); False: failed


class WatchdogStage(Stage):
    """The watchdog of one attempt (module docstring): the idle watch put behind the lease's
    tick just before the child starts, and the GPU use it read noted once the child ended."""

    def __init__(self) -> None:
        self._watchdog: Watchdog | None = None

    def before_run(self, attempt: Attempt) -> None:
        self._watchdog = attempt_watchdog(attempt.svc, attempt.claim, attempt.plan)
        attempt.tick = self._watchdog.watching(attempt.lease)

    def after_run(self, attempt: Attempt, outcome: Outcome) -> None:
        if self._watchdog is not None:
            note_gpu_use(attempt, self._watchdog)


class LeaseKeeper:
    """The supervisor's tick: renews the lease each beat, relays progress, log and checkpoints,
    and watches for cancel, drain and preemption.

    A worker that cannot renew for a whole TTL (its store or its network is gone) stops
    its job as `lost` on its own: by then the scheduler may have started the job elsewhere,
    and two copies must not run on for longer than that. A worker that can neither renew nor
    beat (cut off from the store and Redis both) stops it sooner, on the silence after which
    the scheduler takes it for gone (`silence_s`: docs/reliability.md, "A dead node noticed in
    seconds").
    """

    def __init__(self, svc: AttemptServices, claim: Claim, shipper: Shipper,
                 note: PendingNote) -> None:
        self._svc, self._claim, self._shipper, self._note = svc, claim, shipper, note
        self._renewed = time.monotonic()

    def __call__(self, progress: tuple[float, float] | None) -> Directive:
        svc, claim = self._svc, self._claim
        note = self._note.take()   # what the attempt noted since: in the renewal's transaction
        try:
            renewal = svc.repo.renew(claim.job_id, claim.token, now=utcnow(),
                                     lease_ttl_s=svc.settings.lease_ttl_s, progress=progress,
                                     note=note)
        except Exception as exc:  # noqa: BLE001 - keep the job running while the lease lasts
            self._note.put_back(note)
            silent_s = time.monotonic() - self._renewed
            log.warning("lease_renew_failed job=%s silent_s=%.1f: %s: %s", claim.job_id, silent_s,
                        type(exc).__name__, exc)
            unheard_s = time.monotonic() - svc.last_beat()
            silence = silence_s(svc.settings.heartbeat_interval_s)
            if silent_s > svc.settings.lease_ttl_s or min(silent_s, unheard_s) > silence:
                log.error("lease_expired_locally job=%s attempt=%d: no renewal for %.1f s, no "
                          "heartbeat for %.1f s; stopping the job (it is recovered elsewhere)",
                          claim.job_id, claim.attempt, silent_s, unheard_s)
                return Directive.LOST
            return _drain(svc) if svc.draining.is_set() else Directive.CONTINUE
        if not renewal.ours:
            return Directive.LOST
        self._renewed = time.monotonic()
        try:
            self._shipper.poke()
        except Exception:  # a thread that cannot start (RuntimeError): the next beat tries again
            log.exception("ship_not_started job=%s", claim.job_id)
        if renewal.cancel:
            return Directive.CANCEL
        if svc.draining.is_set():
            return _drain(svc)
        if renewal.preempt:
            return Directive.PREEMPT
        return Directive.CONTINUE


def _drain(svc: AttemptServices) -> Directive:
    """The stop of a draining node: its GPU's fault (the pool's `gpu_fault`) or a drain."""
    return Directive.GPU_FAULT if svc.gpu_fault.is_set() else Directive.DRAIN


class SetupStopped(Exception):
    """The lease's tick stopped the attempt while it was being set up (cancel, drain, lost)."""

    def __init__(self, directive: Directive) -> None:
        super().__init__(directive.value)
        self.directive = directive


def lease_beat(tick: Tick) -> Beat:
    """A setup's beat from the attempt's lease tick: renews the lease (a build may take
    minutes), and stops the setup with `SetupStopped` when the tick says stop."""
    def beat() -> None:
        directive = tick(None)
        if directive is not Directive.CONTINUE:
            raise SetupStopped(directive)
    return beat


class GpuUse:
    """What an attempt used of its GPUs over the readings it took."""

    def __init__(self) -> None:
        self._peak_bytes: int | None = None
        self._util_sum = 0.0
        self._util_count = 0

    def add(self, samples: tuple[GpuSample, ...]) -> None:
        for s in samples:
            if s.mem_used_bytes is not None:
                self._peak_bytes = max(self._peak_bytes or 0, s.mem_used_bytes)
            if s.util_pct is not None:
                self._util_sum += s.util_pct
                self._util_count += 1

    def facts(self) -> AttemptFacts:
        """The peak memory of any one GPU (a class is chosen per GPU) and the mean
        utilisation of all of them; None where no reading was taken."""
        return AttemptFacts(
            gpu_mem_peak_gb=(round(self._peak_bytes / BYTES_PER_GB, 3)
                             if self._peak_bytes is not None else None),
            gpu_util_mean=(round(self._util_sum / self._util_count, 1)
                           if self._util_count else None))


class Watchdog:
    """One attempt's watchdog (module docstring); `watching(tick)` puts it behind the lease
    keeper's tick. Built just before the child starts: what the setup wrote to the log
    does not count as work, and its time does not count as idle."""

    def __init__(self, *, job_id: str, attempt: int, log_path: Path, log_room_bytes: int,
                 gpus: GpuSampler | None, idle_timeout_s: int | None, kill: bool, flag: Flag,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._job_id, self._attempt = job_id, attempt
        self._log_path = log_path
        self._gpus = gpus
        self._idle_timeout_s = idle_timeout_s
        self._kill = kill
        self._flag = flag
        self._clock = clock
        self._log_bytes = self._log_size()
        # Past this size the log is cut and further output unseen: it counts as work, so a
        # job is never stopped for output the watchdog cannot see.
        self._log_cut_bytes = self._log_bytes + log_room_bytes
        self._progress: tuple[float, float] | None = None
        self._worked_at = clock()
        self._idle_since: datetime | None = None
        self._stored = True       # whether the store holds `_idle_since` (a write may fail)
        self.use = GpuUse()

    def watching(self, tick: Tick) -> Tick:
        """`tick` (the lease keeper), then this watchdog while the tick says continue."""
        def watched(progress: tuple[float, float] | None) -> Directive:
            directive = tick(progress)
            return directive if directive is not Directive.CONTINUE else self.observe(progress)
        return watched

    def observe(self, progress: tuple[float, float] | None) -> Directive:
        """One look at the job: IDLE when it is to be stopped as idle, else CONTINUE."""
        now = self._clock()
        shown = self._log_grew() | self._progress_moved(progress)   # both: each keeps state
        samples = self._sample(shown)
        unseen = samples is None     # a failed reading: never judged idle on it
        samples = samples or ()
        self.use.add(samples)
        if shown or unseen or any((s.util_pct or 0.0) > IDLE_UTIL_PCT for s in samples):
            self._worked_at = now
            if self._idle_since is not None:
                log.info("job_active_again job=%s attempt=%d", self._job_id, self._attempt)
                self._set_flag(None)
        elif (self._idle_timeout_s is not None and self._idle_since is None
              and now - self._worked_at >= self._idle_timeout_s):
            idle_s = now - self._worked_at
            log.warning("job_idle job=%s attempt=%d idle_s=%.0f idle_timeout_s=%d on_idle=%s",
                        self._job_id, self._attempt, idle_s, self._idle_timeout_s,
                        "kill" if self._kill else "flag")
            self._set_flag(utcnow() - timedelta(seconds=idle_s))
        if not self._stored:
            self._stored = self._flag(self._idle_since)
        return Directive.IDLE if self._kill and self._idle_since is not None else Directive.CONTINUE

    def _sample(self, shown: bool) -> tuple[GpuSample, ...] | None:
        """The GPUs' readings; None when reading them failed (module docstring)."""
        if self._gpus is None:
            return ()
        try:
            return self._gpus.sample(shown)
        except Exception as exc:  # noqa: BLE001 - any NVML or file error: this beat reads none
            log.warning("gpu_sample_failed job=%s attempt=%d: %s: %s", self._job_id,
                        self._attempt, type(exc).__name__, exc)
            return None

    def _set_flag(self, since: datetime | None) -> None:
        self._idle_since, self._stored = since, False

    def _log_size(self) -> int:
        try:
            return os.stat(self._log_path, follow_symlinks=False).st_size
        except OSError:
            return 0

    def _log_grew(self) -> bool:
        size = self._log_size()
        grew = size != self._log_bytes or size >= self._log_cut_bytes
        self._log_bytes = size
        return grew

    def _progress_moved(self, progress: tuple[float, float] | None) -> bool:
        moved = progress is not None and progress != self._progress
        if progress is not None:
            self._progress = progress
        return moved


def attempt_watchdog(svc: AttemptServices, claim: Claim, plan: AttemptPlan) -> Watchdog:
    """The watchdog of the attempt `plan` runs: the spec's idle_timeout_s, else the pool's."""
    spec = plan.spec
    return Watchdog(job_id=claim.job_id, attempt=claim.attempt, log_path=plan.log_path,
                    log_room_bytes=plan.log_limit[0],
                    gpus=(HeldGpus(svc.gpus, plan.gpus) if svc.gpus is not None
                          and svc.identity.gang else svc.gpus),
                    idle_timeout_s=spec.idle_timeout_s or svc.settings.idle_timeout_s,
                    kill=spec.on_idle == "kill",
                    flag=lambda since: _store_flag(svc, claim, since))


def _store_flag(svc: AttemptServices, claim: Claim, since: datetime | None) -> bool:
    try:
        svc.repo.mark_idle(claim.job_id, claim.attempt, since)
    except StoreError as exc:   # the next beat tries again
        log.warning("idle_flag_failed job=%s attempt=%d: %s", claim.job_id, claim.attempt, exc)
        return False
    return True


def note_gpu_use(attempt: Attempt, watchdog: Watchdog) -> None:
    """Note the attempt's GPU use (`gpu_mem_peak_gb`, `gpu_util_mean`) once its child ended,
    for its outcome's write to carry; nothing where no GPU was read."""
    facts, claim = watchdog.use.facts(), attempt.claim
    if facts.gpu_mem_peak_gb is None and facts.gpu_util_mean is None:
        return
    attempt.note.add(facts)
    log.info("gpu_use job=%s attempt=%d gpu_mem_peak_gb=%s gpu_util_mean=%s", claim.job_id,
             claim.attempt, facts.gpu_mem_peak_gb, facts.gpu_util_mean)
