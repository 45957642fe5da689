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
    claim = rt.repo.claim(job_id, worker=ident.node, gpus=ident.gpus, gpu_count=ident.gpu_count,
                          now=utcnow(), lease_ttl_s=rt.settings.lease_ttl_s)
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
    executor = Executor(plan, tick=lambda progress: _tick(rt, claim, plan, progress))
    outputs: list[dict[str, Any]] = []
    try:
        executor.prepare()
        rt.artifacts.get_tree(claim.tenant_id, claim.job_id, "checkpoints", plan.checkpoint_dir)
        result = executor.run()
        outputs = rt.artifacts.put_tree(plan.output_dir, claim.tenant_id, claim.job_id, "outputs")
        rt.artifacts.put_tree(plan.checkpoint_dir, claim.tenant_id, claim.job_id, "checkpoints")
    except Exception as exc:
        log.exception("attempt_crashed job=%s attempt=%d", claim.job_id, claim.attempt)
        result = Outcome(AttemptReason.ERROR, error=f"worker error: {type(exc).__name__}: {exc}")
    finally:
        _upload_log(rt, claim, plan)
    if result.reason is AttemptReason.LOST:
        log.warning("lease_lost job=%s attempt=%d node=%s", claim.job_id, claim.attempt, rt.identity.node)
        return
    outcome = dataclasses.replace(result, outputs=outputs)
    state = _record(rt, claim, outcome)
    log.info("job_%s job=%s attempt=%d node=%s reason=%s", state or "fenced", claim.job_id,
             claim.attempt, rt.identity.node, result.reason.value)
    shutil.rmtree(root, ignore_errors=True)


def _tick(rt: WorkerRuntime, claim: Claim, plan: AttemptPlan,
          progress: tuple[float, float] | None) -> Directive:
    """Every heartbeat: renew the lease, relay progress and the log, watch for cancel/drain."""
    _upload_log(rt, claim, plan)
    try:
        ours, cancel = rt.repo.renew(claim.job_id, claim.token, now=utcnow(),
                                     lease_ttl_s=rt.settings.lease_ttl_s, progress=progress)
    except StoreError as exc:  # keep the job running; the lease has time left
        log.warning("lease_renew_failed job=%s: %s", claim.job_id, exc)
        return Directive.DRAIN if rt.draining.is_set() else Directive.CONTINUE
    if not ours:
        return Directive.LOST
    if cancel:
        return Directive.CANCEL
    if rt.draining.is_set():
        return Directive.DRAIN
    return Directive.CONTINUE


def _upload_log(rt: WorkerRuntime, claim: Claim, plan: AttemptPlan) -> None:
    if plan.log_path.is_file():
        try:
            rt.artifacts.put_file(plan.log_path, claim.tenant_id, claim.job_id, log_name(claim.attempt))
        except OSError as exc:
            log.warning("log_upload_failed job=%s: %s", claim.job_id, exc)


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
