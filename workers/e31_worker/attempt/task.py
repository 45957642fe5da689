"""The Celery task `e31.run`: claim, execute, record. It never touches CUDA itself."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from celery import Celery
from e31.artifacts import log_name
from e31.celeryapp import TASK_NAME
from e31.clock import utcnow
from e31.errors import StoreError
from e31.heartbeat import wake
from e31.states import AttemptReason
from e31.store.records import Claim, Outcome

from e31_worker.attempt.supervisor import AttemptPlan, Directive, Executor
from e31_worker.node.runtime import WorkerRuntime

log = logging.getLogger(__name__)

STORE_RETRY_FIRST_S = 0.25  # first wait after a store error; doubled up to the heartbeat
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
    if rt.draining.is_set():  # hand it back at once rather than after the dispatch timeout
        released = _with_store_retries(rt, "release", job_id, lambda: rt.repo.release_dispatch(job_id))
        log.info("claim_skipped job=%s node=%s why=draining released=%s", job_id, ident.node, released)
        return
    try:
        claim = _with_store_retries(rt, "claim", job_id, lambda: rt.repo.claim(
            job_id, worker=ident.node, gpus=ident.gpus, gpu_count=ident.gpu_count, now=utcnow(),
            lease_ttl_s=rt.settings.lease_ttl_s))
    except StoreError as exc:  # the job stays queued; the scheduler publishes it again
        log.warning("claim_failed job=%s node=%s: %s", job_id, ident.node, exc)
        return
    if claim is None:
        log.info("claim_skipped job=%s node=%s why=not-claimable (unknown, final, running "
                 "elsewhere or not due yet)", job_id, ident.node)
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


def attempt_plan(rt: WorkerRuntime, claim: Claim) -> AttemptPlan:
    root = rt.settings.resolved_work_dir / claim.job_id / f"attempt-{claim.attempt}"
    return AttemptPlan(job_id=claim.job_id, attempt=claim.attempt, spec=claim.spec,
                       gpus=rt.identity.gpus, root=root, kill_grace_s=rt.settings.kill_grace_s,
                       log_max_bytes=rt.settings.log_max_bytes,
                       tick_interval_s=rt.settings.heartbeat_interval_s)


def _attempt(rt: WorkerRuntime, claim: Claim) -> None:
    plan = attempt_plan(rt, claim)
    shipper = Shipper(rt, claim, plan)
    executor = Executor(plan, tick=LeaseKeeper(rt, claim, shipper), groups=rt.groups,
                        cgroups=rt.cgroups)
    try:
        executor.prepare()
        write_claim(plan.root, rt.identity.node, claim)
        restored = rt.artifacts.get_tree(claim.tenant_id, claim.job_id, "checkpoints",
                                         plan.checkpoint_dir)
        if restored:
            log.info("checkpoint_restored job=%s attempt=%d files=%d", claim.job_id,
                     claim.attempt, restored)
        shipper.mark_checkpoints()  # what came down needs no upload
        result = executor.run()
    except Exception as exc:  # the worker keeps serving; the job gets the reason
        log.exception("attempt_crashed job=%s attempt=%d", claim.job_id, claim.attempt)
        result = Outcome(AttemptReason.ERROR, error=f"worker error: {type(exc).__name__}: {exc}")
    try:
        finish_attempt(rt, claim, plan, shipper, result)
    finally:
        shutil.rmtree(plan.root, ignore_errors=True)


def finish_attempt(rt: WorkerRuntime, claim: Claim, plan: AttemptPlan, shipper: Shipper,
                   result: Outcome) -> str | None:
    """Store an ended attempt's files and record its outcome, if it still holds the lease;
    returns the job's new state, or None when fenced off. Also used by a restarted worker
    for the attempt its predecessor could not finish recording (e31_worker.attempt.settle)."""
    shipper.finish()
    if result.reason is not AttemptReason.LOST and not still_ours(rt, claim):
        # It ended on its own, but the job was recovered elsewhere meanwhile: its files
        # are not stored, and its outcome is offered to the fence, which refuses it.
        shipper.ship_log()
        state = record_outcome(rt, claim, result)
        log.warning("lease_lost_at_end job=%s attempt=%d node=%s recorded=%s", claim.job_id,
                    claim.attempt, rt.identity.node, state)
        return state
    if result.reason is AttemptReason.LOST:  # fenced off: its files must not overwrite
        shipper.ship_log()                    # those of the attempt that replaced it
        log.warning("lease_lost job=%s attempt=%d node=%s", claim.job_id, claim.attempt,
                    rt.identity.node)
        return None
    outputs, upload_error = store_files(rt, claim, plan, shipper)
    shipper.ship_log()
    if upload_error and result.reason is AttemptReason.SUCCEEDED:
        result = Outcome(AttemptReason.ERROR, exit_code=result.exit_code,
                         error=f"the job succeeded but {upload_error}")
    state = record_outcome(rt, claim, dataclasses.replace(result, outputs=outputs))
    log.info("job_%s job=%s attempt=%d node=%s reason=%s", state or "fenced", claim.job_id,
             claim.attempt, rt.identity.node, result.reason.value)
    return state


CLAIM_FILE = "claim.json"    # in the attempt's directory: what a restarted worker needs


def write_claim(root: Path, node: str, claim: Claim) -> None:
    """Keep the claim beside the attempt, so that if this worker process dies after the job
    ended, its successor on the node can record the outcome (e31_worker.attempt.settle)."""
    tmp = root / f".{CLAIM_FILE}.tmp"
    tmp.write_text(json.dumps({"node": node, **dataclasses.asdict(claim)}))
    os.replace(tmp, root / CLAIM_FILE)


def still_ours(rt: WorkerRuntime, claim: Claim) -> bool:
    """Whether this attempt still holds its lease, asked before its files are stored: the
    outputs and checkpoints of an attempt that was recovered elsewhere (its worker was cut
    off) must not overwrite those of the attempt that replaced it. Waits through a store
    outage; an answer that never comes counts as lost."""
    try:
        ours, _ = _with_store_retries(rt, "lease_check", claim.job_id, lambda: rt.repo.renew(
            claim.job_id, claim.token, now=utcnow(), lease_ttl_s=rt.settings.lease_ttl_s))
    except StoreError:
        return False
    return ours


def store_files(rt: WorkerRuntime, claim: Claim, plan: AttemptPlan,
                 shipper: Shipper) -> tuple[list[dict[str, Any]], str | None]:
    """Upload checkpoints (what changed) and outputs, each retried; returns (outputs, what
    failed or None)."""
    outputs: list[dict[str, Any]] = []
    failed: list[str] = []
    steps: list[tuple[str, Callable[[], list[dict[str, Any]] | None]]] = [
        ("checkpoints", shipper.ship_checkpoints),
        ("outputs", lambda: rt.artifacts.put_tree(plan.output_dir, claim.tenant_id, claim.job_id,
                                                  "outputs"))]
    for what, upload in steps:
        delay = UPLOAD_BACKOFF_S
        for attempt in range(1, UPLOAD_TRIES + 1):
            try:
                files = upload()
            except Exception as exc:  # noqa: BLE001 - any fsspec backend's error
                error = f"{type(exc).__name__}: {exc}"
                log.warning("upload_failed job=%s what=%s try=%d: %s", claim.job_id, what, attempt, error)
                if attempt == UPLOAD_TRIES:
                    failed.append(f"its {what} could not be stored: {error}")
                else:
                    time.sleep(delay)
                    delay *= 2
                continue
            if files is not None:
                outputs = files
            break
    return outputs, "; ".join(failed) or None


class Shipper:
    """Copies the attempt's log, and its checkpoints when they changed, to the artifact store.

    Heartbeats start a copy in the background, one at a time, so a slow store never delays
    the lease renewal; a checkpoint saved mid-run is therefore safe before the attempt ends
    (a SIGKILLed worker's job resumes from it). Only a tick that still holds the lease
    starts a copy: a fenced-off attempt must not overwrite its successor's files.
    """

    def __init__(self, rt: WorkerRuntime, claim: Claim, plan: AttemptPlan) -> None:
        self._rt, self._claim, self._plan = rt, claim, plan
        self._log_bytes = -1
        self._checkpoints: dict[str, tuple[int, int]] = {}
        self._thread: threading.Thread | None = None

    def poke(self) -> None:
        """Start a background copy of what changed, unless one is still running."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._thread = threading.Thread(target=self._ship_all, name=f"ship-{self._claim.job_id}",
                                        daemon=True)
        self._thread.start()

    def finish(self) -> None:
        """Wait for a copy in flight (the final copies follow it)."""
        if self._thread is not None:
            self._thread.join()

    def mark_checkpoints(self) -> None:
        """What is in the checkpoint directory now needs no upload (it came down from the store)."""
        self._checkpoints = self._fingerprints()

    def _ship_all(self) -> None:
        self.ship_log()
        try:
            self.ship_checkpoints()
        except Exception as exc:  # noqa: BLE001 - the next beat tries again; the end retries too
            log.warning("checkpoint_upload_failed job=%s: %s", self._claim.job_id, exc)

    def ship_checkpoints(self) -> None:
        """Upload the checkpoint files that changed since the last upload, in name order (a job
        may rely on that order), each atomically; raises when one cannot be stored."""
        current = self._fingerprints()
        changed = sorted(rel for rel, mark in current.items() if self._checkpoints.get(rel) != mark)
        for rel in changed:
            self._rt.artifacts.put_file(self._plan.checkpoint_dir / rel, self._claim.tenant_id,
                                        self._claim.job_id, f"checkpoints/{rel}")
            self._checkpoints[rel] = current[rel]
        if changed:
            log.info("checkpoint_stored job=%s attempt=%d files=%d", self._claim.job_id,
                     self._claim.attempt, len(changed))

    def _fingerprints(self) -> dict[str, tuple[int, int]]:
        """Each checkpoint file's (mtime, size); hidden names (a save in progress) are skipped."""
        root = self._plan.checkpoint_dir
        marks: dict[str, tuple[int, int]] = {}
        for path in root.rglob("*"):
            rel = path.relative_to(root)
            if any(part.startswith(".") for part in rel.parts):
                continue
            try:
                if path.is_file():
                    st = path.stat()
                    marks[rel.as_posix()] = (st.st_mtime_ns, st.st_size)
            except OSError:  # replaced while we looked: the next beat looks again
                continue
        return marks

    def ship_log(self) -> None:
        try:
            size = self._plan.log_path.stat().st_size
        except OSError:
            return
        if size == self._log_bytes:
            return
        try:
            self._rt.artifacts.put_file(self._plan.log_path, self._claim.tenant_id,
                                        self._claim.job_id, log_name(self._claim.attempt))
            self._log_bytes = size
        except Exception as exc:  # noqa: BLE001 - a log copy is never worth failing the job for
            log.warning("log_upload_failed job=%s: %s", self._claim.job_id, exc)


class LeaseKeeper:
    """The executor's tick: renews the lease each beat, relays progress, log and checkpoints,
    and watches for cancel and drain.

    A worker that cannot renew for a whole TTL (its store or its network is gone) stops
    its job as `lost` on its own: by then the scheduler may have started the job elsewhere,
    and two copies must not run on for longer than that.
    """

    def __init__(self, rt: WorkerRuntime, claim: Claim, shipper: Shipper) -> None:
        self._rt, self._claim, self._shipper = rt, claim, shipper
        self._renewed = time.monotonic()

    def __call__(self, progress: tuple[float, float] | None) -> Directive:
        rt, claim = self._rt, self._claim
        try:
            ours, cancel = rt.repo.renew(claim.job_id, claim.token, now=utcnow(),
                                         lease_ttl_s=rt.settings.lease_ttl_s, progress=progress)
        except Exception as exc:  # noqa: BLE001 - keep the job running while the lease lasts
            silent_s = time.monotonic() - self._renewed
            log.warning("lease_renew_failed job=%s silent_s=%.1f: %s: %s", claim.job_id, silent_s,
                        type(exc).__name__, exc)
            if silent_s > rt.settings.lease_ttl_s:
                log.error("lease_expired_locally job=%s attempt=%d: no renewal for %.1f s; "
                          "stopping the job (it is recovered elsewhere)", claim.job_id,
                          claim.attempt, silent_s)
                return Directive.LOST
            return Directive.DRAIN if rt.draining.is_set() else Directive.CONTINUE
        if not ours:
            return Directive.LOST
        self._renewed = time.monotonic()
        self._shipper.poke()
        if cancel:
            return Directive.CANCEL
        if rt.draining.is_set():
            return Directive.DRAIN
        return Directive.CONTINUE


def record_outcome(rt: WorkerRuntime, claim: Claim, outcome: Outcome) -> str | None:
    """Write the outcome, retrying through a store outage; None when fenced off or lost."""
    try:
        state = _with_store_retries(rt, "outcome_write", claim.job_id, lambda: rt.repo.record_outcome(
            claim.job_id, claim.token, outcome, now=utcnow()))
    except StoreError:
        # The lease has long expired: the scheduler recovers the job as `lost`.
        log.error("outcome_lost job=%s attempt=%d: store unreachable for %.0f s", claim.job_id,
                  claim.attempt, rt.settings.store_retry_max_s)
        return None
    if state is None:
        log.warning("outcome_fenced job=%s attempt=%d token=%d: the job was recovered elsewhere",
                    claim.job_id, claim.attempt, claim.token)
        return None
    return state.value


T = TypeVar("T")


def _with_store_retries(rt: WorkerRuntime, what: str, job_id: str, call: Callable[[], T]) -> T:
    """`call()`, retried with back-off while the store is unreachable, for up to
    `store_retry_max_s`; the back-off stays below the heartbeat interval, so a write lands
    within a beat of the store's return (before the scheduler's grace period ends)."""
    deadline = time.monotonic() + rt.settings.store_retry_max_s
    delay = STORE_RETRY_FIRST_S
    tries = 0
    while True:
        tries += 1
        try:
            return call()
        except StoreError as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("%s_failed job=%s try=%d: %s; retrying in %.1f s", what, job_id, tries,
                        exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, rt.settings.heartbeat_interval_s)
