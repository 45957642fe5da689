"""The Celery task `e31.run` and the attempt it drives: claim → the stages → record.

The claim is here (`run_job`: the message's dispatch token, a gang's GPUs, `AttemptStore.claim`);
then the attempt is a loop over its stages (`e31_worker.attempt.stages`: setup, before_run,
the child, after_run, the record, on_end), each stage in its own module: the workspace, the
job's secrets, code, inputs and environment, the shipping of its files, the watchdog and the
isolation of its child. The record is `e31_worker.attempt.record`. The task never touches
CUDA itself.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from celery import Celery

from e31.core.clock import utcnow
from e31.core.errors import SetupError, SetupTransient, StoreError
from e31.core.records import Claim, Outcome
from e31.core.states import AttemptReason
from e31.edge.celeryapp import TASK_NAME
from e31.ops.heartbeat import wake
from e31.store.attempts import AttemptFacts
from e31.store.repo import JOB_ID
from e31_worker.attempt.attemptlimits import attempt_limits
from e31_worker.attempt.code import CodeStage
from e31_worker.attempt.environment import EnvironmentStage
from e31_worker.attempt.inputs import InputsStage
from e31_worker.attempt.isolation import IsolationStage
from e31_worker.attempt.notes import PendingNote
from e31_worker.attempt.outcomes import stopped_outcome
from e31_worker.attempt.plan import AttemptPlan
from e31_worker.attempt.record import finish_attempt, with_store_retries
from e31_worker.attempt.secrets import SecretsStage
from e31_worker.attempt.services import AttemptServices
from e31_worker.attempt.shipping import Shipper, ShippingStage, earlier_log_bytes
from e31_worker.attempt.stages import Attempt, Stage
from e31_worker.attempt.verdict import Ended, JobNotSucceeded, task_result
from e31_worker.attempt.watchdog import LeaseKeeper, SetupStopped, WatchdogStage
from e31_worker.attempt.workspace import WorkspaceStage

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
            ended = _attempt(svc, claim, gpus)
            if claim.array_id is not None:   # no store call after a job of no array
                _chain(svc, claim.job_id, gpus)
            return ended
        finally:
            svc.busy(None)
            try:
                wake(svc.redis)
            except Exception:  # noqa: BLE001 - the next tick publishes anyway
                pass


def _chain(svc: AttemptServices, job_id: str, gpus: str) -> None:
    """Array items in a row (docs/scheduling.md): after an item of an array, run up to
    `array_chain_items` of its next items on the same slot, each claimed by the store without
    a publication (`AttemptStore.claim_next_item`: only from the worker's own class's queue,
    while no other job waits there, within the tenant's quota; a gang worker's next items
    are of the ended one's class and run on the GPUs its dispatch gave, which it holds in the
    host's ledger until the row ends) and each still its own attempt, fenced and sandboxed as
    any other. Not while the worker drains; a claim the store cannot make ends the row, and
    the scheduler publishes what is left as before. The scheduler is woken at the row's end,
    not at each item's."""
    node = svc.identity.node
    for _ in range(svc.settings.array_chain_items):
        if svc.draining.is_set():
            return
        try:
            claim = svc.repo.claim_next_item(
                job_id, queue=None if svc.identity.gang else svc.identity.queues[0],
                worker=node, gpus=gpus,
                gpu_count=len([g for g in gpus.split(",") if g]), now=utcnow(),
                lease_ttl_s=svc.settings.lease_ttl_s)
        except StoreError as exc:  # nothing taken: the scheduler publishes the items
            log.warning("chain_claim_failed after=%s node=%s: %s", job_id, node, exc)
            return
        if claim is None:
            return
        log.info("job_claimed job=%s attempt=%d node=%s gpus=%r chained_after=%s", claim.job_id,
                 claim.attempt, node, gpus, job_id)
        svc.busy(claim.job_id)
        _attempt(svc, claim, gpus)
        job_id = claim.job_id


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
                       outputs_max_bytes=svc.settings.job_outputs_max_bytes,
                       limits=attempt_limits(svc.settings, claim.spec,
                                             default_mem=svc.default_mem_gb,
                                             network=(svc.sandbox.for_attempt(claim).network
                                                      if svc.sandbox else "host")))


def attempt_stages() -> list[Stage]:
    """The stages of one attempt, in the order they run (e31_worker.attempt.stages)."""
    return [WorkspaceStage(), SecretsStage(), CodeStage(), InputsStage(), EnvironmentStage(),
            ShippingStage(), WatchdogStage(), IsolationStage()]


def _attempt(svc: AttemptServices, claim: Claim, gpus: str) -> Ended:
    """The claimed attempt, stage by stage: set up, run, record, end."""
    plan = attempt_plan(svc, claim, gpus)
    shipper = Shipper(svc, claim, plan)
    note = PendingNote(claim.job_id, claim.attempt)
    lease = LeaseKeeper(svc, claim, shipper, note)
    attempt = Attempt(svc=svc, claim=claim, plan=plan, shipper=shipper, lease=lease, tick=lease,
                      note=note)
    stages = attempt_stages()
    with attempt.held:   # what the setup holds for the attempt (its environment)
        result = _run(attempt, stages)
    try:
        state = finish_attempt(svc, claim, shipper, result, note=note)  # ship and record
    finally:
        for stage in stages:
            stage.on_end(attempt, result)
    return Ended(claim.job_id, claim.attempt, result.reason, state, result.error)


def _run(attempt: Attempt, stages: list[Stage]) -> Outcome:
    """Set up, run the child, and tell the stages how it ended; returns the attempt's
    outcome, which is also what a failed setup or the worker's own error makes of it."""
    claim = attempt.claim
    try:
        _setup(attempt, stages)
        for stage in stages:
            stage.before_run(attempt)
        assert attempt.child is not None, "no stage made the child's supervisor"
        result = attempt.child.run()
        for stage in stages:
            stage.after_run(attempt, result)
    except SetupError as exc:  # the user's error (a requirement that does not install), or
        # a fault of ours that may pass (an input server's 503): the pool's, retried
        reason = AttemptReason.SETUP_TRANSIENT if isinstance(exc, SetupTransient) \
            else AttemptReason.SETUP
        log.warning("setup_failed job=%s attempt=%d reason=%s: %s", claim.job_id, claim.attempt,
                    reason.value, exc)
        with open(attempt.plan.log_path, "a") as out:
            out.write(f"e31: setup failed: {exc}\n")
        return Outcome(reason, error=f"setup failed: {exc}")
    except SetupStopped as exc:  # cancelled, drained or lost while it was set up
        return stopped_outcome(exc.directive)
    except Exception as exc:  # the worker keeps serving; the fault is the pool's, not the job's
        log.exception("attempt_crashed job=%s attempt=%d", claim.job_id, claim.attempt)
        return Outcome(AttemptReason.WORKER_CRASHED,
                       error=f"worker error: {type(exc).__name__}: {exc}")
    return result


def _setup(attempt: Attempt, stages: list[Stage]) -> None:
    """Every stage's setup, in order; their time is the attempt's `setup_s` (never billed),
    noted with its next store write, and the lease is kept while it lasts."""
    started = time.monotonic()
    try:
        for stage in stages:
            stage.setup(attempt)
    finally:
        attempt.note.add(AttemptFacts(setup_s=time.monotonic() - started))
