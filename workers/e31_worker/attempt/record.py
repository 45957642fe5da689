"""The record stage: store an ended attempt's files and write its outcome with the fencing
token, retrying through a store outage; and the claim file that lets a restarted worker
do the same for an attempt its predecessor could not finish recording.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import redis

from e31.core import keys, metrics
from e31.core.clock import utcnow
from e31.core.errors import StoreError
from e31.core.records import Claim, Outcome
from e31.core.sizeclasses import OomRule
from e31.core.spec import JobSpec
from e31.core.states import AttemptReason
from e31.store.attempts import AttemptNote
from e31_worker.attempt.claimfiles import CLAIM_FILE
from e31_worker.attempt.notes import PendingNote
from e31_worker.attempt.services import AttemptServices
from e31_worker.attempt.shipping import Shipper

log = logging.getLogger(__name__)

STORE_RETRY_FIRST_S = 0.25  # first wait after a store error; doubled up to the heartbeat
UPLOAD_WAIT_MAX_S = 30.0    # the longest pause between two uploads of an attempt held for
#                             the artifact store (`wait_for_artifacts`); the lease is renewed
#                             every beat meanwhile


def finish_attempt(svc: AttemptServices, claim: Claim, shipper: Shipper,
                   result: Outcome, *, note: PendingNote | None = None) -> str | None:
    """Store an ended attempt's files and record its outcome, if it still holds the lease;
    returns the job's new state, or None when fenced off. What the attempt noted of itself
    and no renewal carried (`note`) goes with the outcome, in its transaction. Also used by
    a restarted worker for the attempt its predecessor could not finish recording
    (e31_worker.attempt.settle)."""
    facts = note.take() if note is not None else None
    shipper.finish()
    # An attempt with no file to store skips the lease check: the fenced outcome write below
    # refuses it all the same if the job was recovered elsewhere.
    if result.reason is not AttemptReason.LOST and shipper.has_files_to_store() \
            and not still_ours(svc, claim):
        # It ended on its own, but the job was recovered elsewhere meanwhile: its files
        # are not stored, and its outcome is offered to the fence, which refuses it.
        shipper.ship_log()
        state = record_outcome(svc, claim, result, facts)
        log.warning("lease_lost_at_end job=%s attempt=%d node=%s recorded=%s", claim.job_id,
                    claim.attempt, svc.identity.node, state)
        return state
    if result.reason is AttemptReason.LOST:  # fenced off: its files must not overwrite
        shipper.ship_log()                    # those of the attempt that replaced it
        log.warning("lease_lost job=%s attempt=%d node=%s", claim.job_id, claim.attempt,
                    svc.identity.node)
        if facts is not None:   # how it ran is still its own: noted, unfenced
            with contextlib.suppress(StoreError):
                svc.repo.note_attempt(claim.job_id, facts.n, facts.facts)
        return None
    outputs, upload_error = shipper.store_files()
    if upload_error and result.reason is AttemptReason.SUCCEEDED:
        outputs, upload_error = wait_for_artifacts(svc, claim, shipper, upload_error, outputs)
    shipper.ship_log()
    if upload_error and result.reason is AttemptReason.SUCCEEDED:
        # The artifact store's fault, not the job's: the pool's (`upload_failed`), retried
        # on its account; a job that failed anyway keeps its own reason.
        result = Outcome(AttemptReason.UPLOAD_FAILED, exit_code=result.exit_code,
                         error=f"the job succeeded but {upload_error}")
    state = record_outcome(svc, claim, dataclasses.replace(result, outputs=outputs), facts)
    log.info("job_%s job=%s attempt=%d node=%s reason=%s", state or "fenced", claim.job_id,
             claim.attempt, svc.identity.node, result.reason.value)
    return state


def wait_for_artifacts(svc: AttemptServices, claim: Claim, shipper: Shipper, error: str,
                       outputs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str | None]:
    """Hold a succeeded attempt whose files the artifact store could not take, for up to
    `artifacts_wait_s`: its outputs stay in its directory on this worker, its lease is renewed
    each beat, and the upload is tried again with back-off (from one beat, doubling, at most
    `UPLOAD_WAIT_MAX_S`). Returns (outputs, None) once the store took them: the job succeeds with
    no attempt spent. Still failing when the wait is over, or stopped by a cancel, a drain or a
    lost lease, it returns the last error: the attempt ends `upload_failed`, the pool's."""
    beat_s = svc.settings.heartbeat_interval_s
    deadline = time.monotonic() + svc.settings.artifacts_wait_s
    delay = beat_s
    next_try = time.monotonic() + delay
    log.warning("artifacts_wait job=%s attempt=%d wait_s=%.0f: %s", claim.job_id, claim.attempt,
                svc.settings.artifacts_wait_s, error)
    while time.monotonic() + min(beat_s, delay) <= deadline:
        if svc.draining.wait(min(beat_s, max(0.0, next_try - time.monotonic()))):
            break                      # the node stops: its successor runs the job again
        if not _holds_lease(svc, claim):
            break
        if time.monotonic() < next_try:
            continue
        outputs, retried = shipper.store_files(tries=1)
        if retried is None:
            log.info("artifacts_back job=%s attempt=%d", claim.job_id, claim.attempt)
            return outputs, None
        error = retried
        delay = min(delay * 2, UPLOAD_WAIT_MAX_S)
        next_try = time.monotonic() + delay
    log.warning("artifacts_wait_over job=%s attempt=%d: %s", claim.job_id, claim.attempt, error)
    return outputs, error


def _holds_lease(svc: AttemptServices, claim: Claim) -> bool:
    """Renew the lease of an attempt held for the artifact store: False when it is not ours any
    more or its job was cancelled (the wait ends; the fence or the cancel decides). A store
    that does not answer keeps the wait going: the lease lasts its TTL."""
    try:
        renewal = svc.repo.renew(claim.job_id, claim.token, now=utcnow(),
                                 lease_ttl_s=svc.settings.lease_ttl_s)
    except StoreError as exc:
        log.warning("lease_renew_failed job=%s while waiting for the artifact store: %s",
                    claim.job_id, exc)
        return True
    return renewal.ours and not renewal.cancel


def still_ours(svc: AttemptServices, claim: Claim) -> bool:
    """Whether this attempt still holds its lease, asked before its files are stored: the
    outputs and checkpoints of an attempt that was recovered elsewhere (its worker was cut
    off) must not overwrite those of the attempt that replaced it. Waits through a store
    outage; an answer that never comes counts as lost."""
    try:
        renewal = with_store_retries(svc, "lease_check", claim.job_id, lambda: svc.repo.renew(
            claim.job_id, claim.token, now=utcnow(), lease_ttl_s=svc.settings.lease_ttl_s))
    except StoreError:
        return False
    return renewal.ours


def record_outcome(svc: AttemptServices, claim: Claim, outcome: Outcome,
                   note: AttemptNote | None = None) -> str | None:
    """Write the outcome (with `note`, the attempt's facts not written yet), retrying through
    a store outage; None when fenced off or lost. An
    attempt that ran out of memory goes on to the next size class where the job's
    `resources.on_oom` (or the pool's `on_oom_default`) says so (docs/scheduling.md); one
    that ended for a fault of the pool's own is retried up to the pool's `infra_retries`."""
    oom = OomRule.of(svc.settings.size_classes, svc.settings.on_oom_default)
    patience = svc.settings.infra_retries
    try:
        state = with_store_retries(svc, "outcome_write", claim.job_id,
                                   lambda: svc.repo.record_outcome(claim.job_id, claim.token,
                                                                   outcome, now=utcnow(),
                                                                   oom=oom,
                                                                   infra_retries=patience,
                                                                   note=note))
    except StoreError:
        # The lease has long expired: the scheduler recovers the job as `lost`.
        log.error("outcome_lost job=%s attempt=%d: store unreachable for %.0f s", claim.job_id,
                  claim.attempt, svc.settings.store_retry_max_s)
        return None
    if state is None:
        metrics.note_fenced_write(svc.redis)
        log.warning("outcome_fenced job=%s attempt=%d token=%d: the job was recovered elsewhere",
                    claim.job_id, claim.attempt, claim.token)
        return None
    if state.is_final:
        announce_end(svc, claim.job_id)
    return state.value


def announce_end(svc: AttemptServices, job_id: str) -> None:
    """Wake the API's long polls of the job (e31.api.waits); without Redis they see the end
    at their next store read."""
    try:
        svc.redis.publish(keys.JOB_ENDED, job_id)
    except redis.RedisError as exc:
        log.warning("job_end_unannounced job=%s: %s", job_id, exc)


T = TypeVar("T")


def with_store_retries(svc: AttemptServices, what: str, job_id: str, call: Callable[[], T]) -> T:
    """`call()`, retried with back-off while the store is unreachable, for up to
    `store_retry_max_s`; the back-off stays below the heartbeat interval, so a write lands
    within a beat of the store's return (before the scheduler's grace period ends)."""
    deadline = time.monotonic() + svc.settings.store_retry_max_s
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
            delay = min(delay * 2, svc.settings.heartbeat_interval_s)


def write_claim(root: Path, node: str, claim: Claim) -> None:
    """Keep the claim beside the attempt, so that if this worker process dies after the job
    ended, its successor on the node can record the outcome (e31_worker.attempt.settle)."""
    payload: dict[str, Any] = {f.name: getattr(claim, f.name) for f in dataclasses.fields(claim)}
    payload["spec"] = claim.spec.model_dump(mode="json")
    tmp = root / f".{CLAIM_FILE}.tmp"
    tmp.write_text(json.dumps({"node": node, **payload}))
    os.replace(tmp, root / CLAIM_FILE)


def claim_from_file_data(data: dict[str, Any]) -> Claim:
    """The claim `write_claim` kept (its "node" already taken out), its spec validated again;
    raises TypeError or ValueError when the data is not such a claim."""
    return Claim(**{**data, "spec": JobSpec.parse(data.get("spec"), stored=True)})
