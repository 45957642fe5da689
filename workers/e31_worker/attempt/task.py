"""The Celery task `e31.run` and the attempt it drives: claim → prepare → run → ship → record.

Each stage has its own module: the job's own environment (`environment`), the child process
(`supervisor`), the lease while it runs (`lease`), the copies to the artifact store
(`shipping`), the outcome (`record`). The task never touches CUDA itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any

from celery import Celery

from e31.core.clock import utcnow
from e31.core.errors import SetupError, StoreError
from e31.core.records import Claim, Outcome
from e31.core.states import AttemptReason
from e31.edge.celeryapp import TASK_NAME
from e31.ops.heartbeat import wake
from e31.store.attempts import AttemptFacts
from e31.store.repo import JOB_ID
from e31_worker.attempt.buildbox import BuildSandbox
from e31_worker.attempt.bundle import remove_tree, stage_code
from e31_worker.attempt.environment import SetupStopped, job_environment, lease_beat
from e31_worker.attempt.inputs import stage_inputs
from e31_worker.attempt.lease import LeaseKeeper
from e31_worker.attempt.limits import attempt_limits, note_limits
from e31_worker.attempt.record import finish_attempt, with_store_retries, write_claim
from e31_worker.attempt.sandbox import note_start
from e31_worker.attempt.secrets import secret_env
from e31_worker.attempt.services import AttemptServices
from e31_worker.attempt.shipping import Shipper, earlier_log_bytes
from e31_worker.attempt.supervisor import AttemptPlan, Supervisor, stopped_outcome
from e31_worker.attempt.verdict import Ended, JobNotSucceeded, task_result
from e31_worker.attempt.watchdog import attempt_watchdog, note_gpu_use

log = logging.getLogger(__name__)

PAYLOAD_SHOWN_CHARS = 200   # of a malformed message's payload, in its log line


def register(app: Celery, svc: AttemptServices) -> None:
    """Register `e31.run` on `app`, bound to this worker process's services. The message is
    `e31.run(job_id, dispatch_token)`; the old one-argument form is still parsed, and refused
    for want of a token, as is any other shape. An attempt that leaves its job not succeeded
    makes the task raise `JobNotSucceeded` once the outcome is recorded, so that Flower shows
    it failed; the message is acked all the same (e31_worker.attempt.verdict)."""

    # Not shared: Celery would otherwise hand this closure, bound to `svc`, to every app
    # created later in the process.
    @app.task(name=TASK_NAME, acks_late=True, ignore_result=True, shared=False,
              throws=(JobNotSucceeded,))
    def run(job_id: Any = None, dispatch_token: Any = None, *extra: Any, **named: Any) -> str:
        if extra or named:
            log.error("message_malformed node=%s payload=%s", svc.identity.node,
                      shown([job_id, dispatch_token, *extra], named))
            return task_result(None)
        return task_result(run_job(svc, job_id, dispatch_token))


def shown(*payload: Any) -> str:
    """A message's payload as a log shows it: one line (repr escapes line breaks), bounded."""
    text = ", ".join(repr(p) for p in payload)
    return text if len(text) <= PAYLOAD_SHOWN_CHARS else text[:PAYLOAD_SHOWN_CHARS] + "..."


def run_job(svc: AttemptServices, job_id: Any, dispatch_token: Any) -> Ended | None:
    """Run one delivered job, if the message carries the dispatch token the scheduler issued
    for it (docs/security.md, "The broker is not a trust boundary"); returns how its attempt
    ended. A message without one, with a forged or stale one, or one that cannot be claimed
    does nothing and returns None."""
    ident = svc.identity
    if not isinstance(job_id, str) or not JOB_ID.fullmatch(job_id):
        log.error("message_malformed node=%s payload=%s", ident.node, shown(job_id))
        return None
    if not isinstance(dispatch_token, str) or not dispatch_token:
        log.error("message_unauthorized job=%s node=%s: no dispatch token; only the "
                  "scheduler's messages run", job_id, ident.node)
        return None
    if svc.draining.is_set():  # hand it back at once rather than after the dispatch timeout
        released = with_store_retries(svc, "release", job_id,
                                      lambda: svc.repo.release_dispatch(job_id, dispatch_token))
        log.info("claim_skipped job=%s node=%s why=draining released=%s", job_id, ident.node,
                 released)
        return None
    gpus = ident.gpus
    with contextlib.ExitStack() as held:
        if ident.gang:       # a gang worker: the GPUs its dispatch names, if free on the host
            taken = _take_gang_gpus(svc, job_id, dispatch_token)
            if taken is None:
                return None
            gpus = ",".join(taken)
            held.callback(svc.gpu_ledger().give_back, taken, job_id)
        try:
            claim = with_store_retries(svc, "claim", job_id, lambda: svc.repo.claim(
                job_id, dispatch_token=dispatch_token, worker=ident.node, gpus=gpus,
                gpu_count=len([g for g in gpus.split(",") if g]), now=utcnow(),
                lease_ttl_s=svc.settings.lease_ttl_s))
        except StoreError as exc:  # the job stays queued; the scheduler publishes it again
            log.warning("claim_failed job=%s node=%s: %s", job_id, ident.node, exc)
            return None
        if claim is None:
            _skipped(svc, job_id, dispatch_token)
            return None
        log.info("job_claimed job=%s attempt=%d node=%s gpus=%r", job_id, claim.attempt,
                 ident.node, gpus)
        svc.busy(job_id)
        try:
            return _attempt(svc, claim, gpus)
        finally:
            svc.busy(None)
            try:
                wake(svc.redis)
            except Exception:  # noqa: BLE001 - the next tick publishes anyway
                pass


def _take_gang_gpus(svc: AttemptServices, job_id: str, dispatch_token: str) -> list[str] | None:
    """The GPU indexes the job's gang dispatch gives it, taken in the host's ledger; None
    (and the publication handed back, so the scheduler places the job again) when the
    message is not the job's current one or one of those GPUs is held by another attempt."""
    node = svc.identity.node
    try:
        place = svc.repo.dispatch_place(job_id, dispatch_token)
    except StoreError as exc:
        log.warning("claim_failed job=%s node=%s: %s", job_id, node, exc)
        return None
    if place is None or place[0] != svc.identity.host:
        _skipped(svc, job_id, dispatch_token)
        return None
    gpus = [g for g in place[1].split(",") if g]
    busy = svc.gpu_ledger().take(gpus, job_id)
    if busy:
        released = with_store_retries(svc, "release", job_id,
                                      lambda: svc.repo.release_dispatch(job_id, dispatch_token))
        log.warning("claim_refused job=%s node=%s why=gpu-busy gpus=%s released=%s", job_id,
                    node, ",".join(busy), released)
        return None
    return gpus


def _skipped(svc: AttemptServices, job_id: str, dispatch_token: str) -> None:
    """Say why a message claimed nothing: its token, or the job's state."""
    node = svc.identity.node
    try:
        refused = svc.repo.dispatch_refused(job_id, dispatch_token)
    except StoreError:  # only the log line's wording depends on it
        refused = False
    if refused:
        log.warning("message_unauthorized job=%s node=%s: its dispatch token is not the job's "
                    "current one (forged, replayed, or superseded by a new publication)",
                    job_id, node)
    else:
        log.info("claim_skipped job=%s node=%s why=not-claimable (unknown, final, running "
                 "elsewhere or not due yet)", job_id, node)


def attempt_plan(svc: AttemptServices, claim: Claim, gpus: str | None = None) -> AttemptPlan:
    """Where and how this worker runs the claimed attempt, on `gpus` (default: its own)."""
    root = svc.settings.resolved_work_dir / claim.job_id / f"attempt-{claim.attempt}"
    return AttemptPlan(job_id=claim.job_id, attempt=claim.attempt, spec=claim.spec,
                       gpus=svc.identity.gpus if gpus is None else gpus, root=root,
                       kill_grace_s=svc.settings.kill_grace_s,
                       log_max_bytes=svc.settings.log_max_bytes,
                       tick_interval_s=svc.settings.heartbeat_interval_s,
                       job_log_max_bytes=svc.settings.job_log_max_bytes,
                       log_earlier_bytes=earlier_log_bytes(svc, claim),
                       env_passthrough=svc.settings.job_env_passthrough,
                       limits=attempt_limits(svc.settings, claim.spec,
                                             default_mem=svc.default_mem_gb,
                                             network=(svc.sandbox.for_attempt(claim).network
                                                      if svc.sandbox else "host")))


def _prepare(svc: AttemptServices, claim: Claim, plan: AttemptPlan, shipper: Shipper,
             keeper: LeaseKeeper, held: contextlib.ExitStack) -> AttemptPlan:
    """The attempt's setup: its directories, the claim file, the job's own environment, the
    checkpoints of earlier attempts; returns the plan the job runs by. Its time is noted on
    the attempt as `setup_s`, which is never billed; the lease is kept while it lasts."""
    started = time.monotonic()
    try:
        plan.make_dirs()
        write_claim(plan.root, svc.identity.node, claim)
        plan = dataclasses.replace(plan, secret_env=secret_env(svc, claim))   # secrets.py
        stage_code(svc, claim, plan)     # its code, unpacked read-only (bundle.py)
        binds = stage_inputs(svc, claim, plan)   # its inputs, into $E31_INPUT_DIR (inputs.py)
        plan = dataclasses.replace(plan, input_binds=binds)   # local files bound read-only
        env = job_environment(svc.settings, plan, beat=lease_beat(keeper), sandbox=(
            BuildSandbox.for_tenant(svc.sandbox, claim.tenant_id) if svc.sandbox else None))
        if env is not None:
            held.callback(env.release)
            plan = dataclasses.replace(plan, venv=env.path)
        restored = svc.artifacts.get_tree(claim.tenant_id, claim.job_id, "checkpoints",
                                          plan.checkpoint_dir)
        if restored:
            log.info("checkpoint_restored job=%s attempt=%d files=%d", claim.job_id,
                     claim.attempt, restored)
        shipper.mark_checkpoints()  # what came down needs no upload
    finally:
        _note_setup(svc, claim, time.monotonic() - started)
    return plan


def _note_setup(svc: AttemptServices, claim: Claim, setup_s: float) -> None:
    """Note the setup's time on the attempt before the job starts, so that its bill leaves it
    out even if the worker dies later (docs/jobs.md)."""
    try:
        svc.repo.note_attempt(claim.job_id, claim.attempt, AttemptFacts(setup_s=setup_s))
    except StoreError as exc:  # the bill then counts the setup: better than holding the job
        log.warning("setup_note_failed job=%s attempt=%d setup_s=%.2f: %s", claim.job_id,
                    claim.attempt, setup_s, exc)


def _attempt(svc: AttemptServices, claim: Claim, gpus: str) -> Ended:
    plan = attempt_plan(svc, claim, gpus)
    shipper = Shipper(svc, claim, plan)
    keeper = LeaseKeeper(svc, claim, shipper)
    with contextlib.ExitStack() as held:   # what the setup holds for the attempt (its env)
        try:
            plan = _prepare(svc, claim, plan, shipper, keeper, held)
            watchdog = attempt_watchdog(svc, claim, plan)   # idle jobs and GPU use
            result = Supervisor(plan, tick=watchdog.watching(keeper), groups=svc.groups,
                                cgroups=svc.cgroups,
                                sandbox=svc.sandbox.for_attempt(claim) if svc.sandbox else None,
                                on_start=lambda ms, start: note_start(
                                    svc.repo, claim, svc.isolation, ms, start),
                                warm=svc.warm,
                                on_limits=lambda limits: note_limits(svc.repo, claim,
                                                                     limits)).run()
            note_gpu_use(svc, claim, watchdog)
        except SetupError as exc:  # the user's error (a requirement that does not install)
            log.warning("setup_failed job=%s attempt=%d: %s", claim.job_id, claim.attempt, exc)
            with open(plan.log_path, "a") as out:
                out.write(f"e31: setup failed: {exc}\n")
            result = Outcome(AttemptReason.SETUP, error=f"setup failed: {exc}")
        except SetupStopped as exc:  # cancelled, drained or lost while it was set up
            result = stopped_outcome(exc.directive)
        except Exception as exc:  # the worker keeps serving; the job gets the reason
            log.exception("attempt_crashed job=%s attempt=%d", claim.job_id, claim.attempt)
            result = Outcome(AttemptReason.ERROR,
                             error=f"worker error: {type(exc).__name__}: {exc}")
    try:
        state = finish_attempt(svc, claim, shipper, result)  # ship and record
    finally:
        remove_tree(plan.root)   # an unpacked bundle is read-only
    return Ended(claim.job_id, claim.attempt, result.reason, state, result.error)
