"""Attempts a dead worker process left behind on its node, settled by its successor.

A worker process SIGKILLed (or OOM-killed) after its job's code returned but before the
outcome was stored would otherwise have the job run again: its lease expires and the
scheduler requeues it. The job's child writes its result atomically before it exits, and
the worker keeps its claim beside the attempt (`claim.json`), so the process that the
launcher starts in its place, under the same node name, stores the files and records the
outcome with the old fencing token before it takes new work. If the lease expired first
and the job was recovered elsewhere, the fence refuses that write and nothing is stored.

An attempt that had not finished (no result in its directory) is only cleaned up: the
scheduler recovers its job as `lost`, within seconds rather than at its lease's expiry, as
the new process's heartbeat holds no job while the lease is no longer renewed
(`e31.scheduling.leader`, `Scheduler.expire_silent`). A command job leaves no result file, so only
entrypoint jobs are settled this way.
"""

from __future__ import annotations

import logging
from pathlib import Path

from e31.core.records import Claim
from e31_worker.attempt.claimfiles import left_claims
from e31_worker.attempt.code import remove_tree
from e31_worker.attempt.outcomes import finished_outcome
from e31_worker.attempt.record import claim_from_file_data, finish_attempt
from e31_worker.attempt.services import AttemptServices
from e31_worker.attempt.shipping import Shipper
from e31_worker.attempt.task import attempt_plan

log = logging.getLogger(__name__)


def settle_left_attempts(svc: AttemptServices) -> int:
    """Record the finished attempts of this node's dead predecessor, clean up the rest;
    returns how many outcomes were offered to the store. Run before taking work."""
    settled = 0
    for root, data in left_claims(svc.settings.resolved_work_dir, svc.identity.node):
        try:
            settled += _settle(svc, claim_from_file_data(data), root)
        except Exception:  # never keep a worker from starting
            log.exception("attempt_settle_failed dir=%s", root)
        finally:
            remove_tree(root)   # an unpacked bundle is read-only
            _remove_if_empty(root.parent)
    return settled


def _settle(svc: AttemptServices, claim: Claim, root: Path) -> int:
    outcome = finished_outcome(root)
    if outcome is None:
        log.warning("attempt_abandoned job=%s attempt=%d node=%s: its worker died before it "
                    "finished; the scheduler recovers it", claim.job_id, claim.attempt,
                    svc.identity.node)
        return 0
    plan = attempt_plan(svc, claim)
    state = finish_attempt(svc, claim, Shipper(svc, claim, plan), outcome)
    log.warning("attempt_settled job=%s attempt=%d node=%s reason=%s state=%s: its worker died "
                "after the job ended", claim.job_id, claim.attempt, svc.identity.node,
                outcome.reason.value, state or "fenced")
    return 1


def _remove_if_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass
