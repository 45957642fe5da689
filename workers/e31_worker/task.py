"""The Celery task `e31.run`: claim, execute, record. It never touches CUDA itself."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from typing import Any

from celery import Celery
from e31.artifacts import log_name
from e31.celeryapp import TASK_NAME
from e31.clock import utcnow
from e31.errors import StoreError
from e31.scheduler import wake
from e31.states import AttemptReason
from e31.store.records import Claim, Outcome

from e31_worker.executor import AttemptPlan, Directive, Executor
from e31_worker.runtime import WorkerRuntime

log = logging.getLogger(__name__)

RECORD_TRIES = 5            # an outcome write is retried this often on a store error
RECORD_BACKOFF_S = 1.0      # doubled after each failed try
UPLOAD_TRIES = 3            # outputs and checkpoints: an upload is retried this often
UPLOAD_BACKOFF_S = 1.0      # doubled after each failed try


def register(app: Celery, runtime: WorkerRuntime) -> None:
    """Register `e31.run` on `app`, bound to this worker's runtime."""

    @app.task(name=TASK_NAME, acks_late=True, ignore_result=True)
    def run(job_id: Any) -> None:
        run_job(runtime, job_id)


def run_job(rt: WorkerRuntime, job_id: Any) -> None:
    """Run one delivered job id; a message that cannot be claimed does nothing."""
    ident = rt.identity
    if not isinstance(job_id, str) or not job_id:
        log.error("message_malformed node=%s payload=%r", ident.node, job_id)
        return
    if rt.draining.is_set():
        log.info("claim_skipped job=%s node=%s why=draining", job_id, ident.node)
        return
    try:
        claim = rt.repo.claim(job_id, worker=ident.node, gpus=ident.gpus,
                              gpu_count=ident.gpu_count, now=utcnow(),
                              lease_ttl_s=rt.settings.lease_ttl_s)
    except StoreError as exc:  # the job stays queued; the scheduler publishes it again
        log.warning("claim_failed job=%s node=%s: %s", job_id, ident.node, exc)
        return
    if claim is None:
        log.info("claim_skipped job=%s node=%s why=not-claimable", job_id, ident.node)
        return
    log.info("job_claimed job=%s attempt=%d node=%s gpus=%r", job_id, claim.attempt, ident.node,
             ident.gpus)
    rt.set_busy(job_id)
    try:
        _attempt(rt, claim)
    finally:
        rt.set_busy(None)
        try:
            wake(rt.redis)
        except Exception:  # noqa: BLE001 - the next tick publishes anyway
            pass


def _attempt(rt: WorkerRuntime, claim: Claim) -> None:
    root = rt.settings.resolved_work_dir / claim.job_id / f"attempt-{claim.attempt}"
    plan = AttemptPlan(job_id=claim.job_id, attempt=claim.attempt, spec=claim.spec,
                       gpus=rt.identity.gpus, root=root, kill_grace_s=rt.settings.kill_grace_s,
                       log_max_bytes=rt.settings.log_max_bytes,
                       tick_interval_s=rt.settings.heartbeat_interval_s)
    shipper = LogShipper(rt, claim, plan)
    executor = Executor(plan, tick=lambda progress: _tick(rt, claim, shipper, progress),
                        groups=rt.groups)
    try:
        executor.prepare()
        rt.artifacts.get_tree(claim.tenant_id, claim.job_id, "checkpoints", plan.checkpoint_dir)
        result = executor.run()
    except Exception as exc:  # the worker keeps serving; the job gets the reason
        log.exception("attempt_crashed job=%s attempt=%d", claim.job_id, claim.attempt)
        result = Outcome(AttemptReason.ERROR, error=f"worker error: {type(exc).__name__}: {exc}")
    try:
        if result.reason is AttemptReason.LOST:  # fenced off: its files must not overwrite
            shipper.ship()                        # those of the attempt that replaced it
            log.warning("lease_lost job=%s attempt=%d node=%s", claim.job_id, claim.attempt,
                        rt.identity.node)
            return
        outputs, upload_error = _store_files(rt, claim, plan)
        shipper.ship()
        if upload_error and result.reason is AttemptReason.SUCCEEDED:
            result = Outcome(AttemptReason.ERROR, exit_code=result.exit_code,
                             error=f"the job succeeded but {upload_error}")
        state = _record(rt, claim, dataclasses.replace(result, outputs=outputs))
        log.info("job_%s job=%s attempt=%d node=%s reason=%s", state or "fenced", claim.job_id,
                 claim.attempt, rt.identity.node, result.reason.value)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _store_files(rt: WorkerRuntime, claim: Claim, plan: AttemptPlan) -> tuple[list[dict[str, Any]], str | None]:
    """Upload checkpoints and outputs, each retried; returns (outputs, what failed or None)."""
    outputs: list[dict[str, Any]] = []
    failed: list[str] = []
    for prefix, local in (("checkpoints", plan.checkpoint_dir), ("outputs", plan.output_dir)):
        delay = UPLOAD_BACKOFF_S
        for attempt in range(1, UPLOAD_TRIES + 1):
            try:
                files = rt.artifacts.put_tree(local, claim.tenant_id, claim.job_id, prefix)
            except Exception as exc:  # any fsspec backend's error
                error = f"{type(exc).__name__}: {exc}"
                log.warning("upload_failed job=%s what=%s try=%d: %s", claim.job_id, prefix, attempt, error)
                if attempt == UPLOAD_TRIES:
                    failed.append(f"its {prefix} could not be stored: {error}")
                else:
                    time.sleep(delay)
                    delay *= 2
                continue
            if prefix == "outputs":
                outputs = files
            break
    return outputs, "; ".join(failed) or None


class LogShipper:
    """Copies the attempt's log to the artifact store when it has grown."""

    def __init__(self, rt: WorkerRuntime, claim: Claim, plan: AttemptPlan) -> None:
        self._rt, self._claim, self._plan = rt, claim, plan
        self._shipped_bytes = -1

    def ship(self) -> None:
        try:
            size = self._plan.log_path.stat().st_size
        except OSError:
            return
        if size == self._shipped_bytes:
            return
        try:
            self._rt.artifacts.put_file(self._plan.log_path, self._claim.tenant_id,
                                        self._claim.job_id, log_name(self._claim.attempt))
            self._shipped_bytes = size
        except Exception as exc:  # a log copy is never worth failing the job for
            log.warning("log_upload_failed job=%s: %s", self._claim.job_id, exc)


def _tick(rt: WorkerRuntime, claim: Claim, shipper: LogShipper,
          progress: tuple[float, float] | None) -> Directive:
    """Every heartbeat: renew the lease, relay progress and the log, watch for cancel/drain."""
    shipper.ship()
    try:
        ours, cancel = rt.repo.renew(claim.job_id, claim.token, now=utcnow(),
                                     lease_ttl_s=rt.settings.lease_ttl_s, progress=progress)
    except Exception as exc:  # keep the job running; the lease has time left
        log.warning("lease_renew_failed job=%s: %s: %s", claim.job_id, type(exc).__name__, exc)
        return Directive.DRAIN if rt.draining.is_set() else Directive.CONTINUE
    if not ours:
        return Directive.LOST
    if cancel:
        return Directive.CANCEL
    if rt.draining.is_set():
        return Directive.DRAIN
    return Directive.CONTINUE


def _record(rt: WorkerRuntime, claim: Claim, outcome: Outcome) -> str | None:
    delay = RECORD_BACKOFF_S
    for attempt in range(1, RECORD_TRIES + 1):
        try:
            state = rt.repo.record_outcome(claim.job_id, claim.token, outcome, now=utcnow())
        except StoreError as exc:
            log.warning("outcome_write_failed job=%s try=%d: %s", claim.job_id, attempt, exc)
            time.sleep(delay)
            delay *= 2
            continue
        if state is None:
            log.warning("outcome_fenced job=%s attempt=%d token=%d", claim.job_id, claim.attempt,
                        claim.token)
            return None
        return state.value
    log.error("outcome_lost job=%s attempt=%d: store unreachable", claim.job_id, claim.attempt)
    return None
