"""A worker process's death, answered by its launcher at once (docs/reliability.md, "A dead
node noticed in seconds").

Without it, the job of a SIGKILLed worker process waited for the process's successor to start
(a new interpreter, its imports), beat without the job, and for the scheduler to see its lease
silent. The launcher sees the death within `SUPERVISE_POLL_S`; before it starts the successor
it takes the node's lock (free once the process died), kills what the dead process's jobs left
running (its process groups and cgroups: PDEATHSIG has usually done so already), and ends `lost`
with the old fencing token each attempt of that node that had not finished, then wakes the
scheduler: the job is published again within about a second of the death. An attempt whose
child had finished (its result is in its directory) is left to the successor, which records
its outcome (`e31_worker.attempt.settle`), so that finished work is never run twice. Every
write is fenced: one the scheduler's recovery beat is refused and changes nothing.
"""

from __future__ import annotations

import logging
from pathlib import Path

import redis

from e31.core.clock import utcnow
from e31.core.errors import E31Error
from e31.core.records import Outcome
from e31.core.states import AttemptReason
from e31.edge import wiring
from e31.edge.settings import Settings
from e31.ops.heartbeat import wake
from e31_worker.attempt.cgroups import JobCgroups, stack_place
from e31_worker.attempt.groups import GroupRegistry, NodeLock
from e31_worker.attempt.outcomes import finished_outcome
from e31_worker.attempt.record import claim_from_file_data
from e31_worker.attempt.settle import left_claims

log = logging.getLogger(__name__)


def release_dead_worker(settings: Settings, node: str, *, exit_code: int | None,
                        redis_client: redis.Redis | None) -> list[str]:
    """Answer the death of `node`'s worker process (module docstring); returns the jobs whose
    attempts were ended `lost`. Never raises: what fails is logged, and the successor and the
    scheduler's recovery do the rest as before."""
    groups_dir = settings.resolved_work_dir / ".groups"
    lock = NodeLock(groups_dir / f"{node}.lock")
    if lock.acquire() is not None:     # a process serves the node already: nothing died
        return []
    try:
        GroupRegistry(groups_dir / node).reap()
        cgroups = JobCgroups.for_node(node, place=stack_place(settings.resolved_work_dir))
        if cgroups is not None:
            cgroups.reap()
        released = _end_unfinished(settings, node, exit_code)
    except Exception:
        log.exception("worker_release_failed node=%s", node)
        return []
    finally:
        lock.release()
    if released and redis_client is not None:
        try:
            wake(redis_client)
        except redis.RedisError as exc:   # its next tick publishes them
            log.warning("scheduler_not_woken: %s", exc)
    return released


def _end_unfinished(settings: Settings, node: str, exit_code: int | None) -> list[str]:
    """End `lost` the attempts of `node` that had not finished, each with its own token."""
    unfinished = [(root, claim_from_file_data(data))
                  for root, data in left_claims(settings.resolved_work_dir, node)
                  if finished_outcome(root) is None]
    if not unfinished:
        return []
    repo = wiring.attempt_store(settings, node=node)
    released = []
    try:
        for root, claim in unfinished:
            outcome = Outcome(AttemptReason.LOST, error=(
                f"its worker process {node} died ({_said(exit_code)}); its launcher "
                "released the job at once"))
            try:
                state = repo.record_outcome(claim.job_id, claim.token, outcome, now=utcnow(),
                                            infra_retries=settings.infra_retries)
            except E31Error as exc:        # the store is down: the lease runs its course
                log.warning("worker_release_failed job=%s node=%s: %s", claim.job_id, node, exc)
                continue
            _note(root, claim.job_id, claim.attempt, node, state.value if state else None)
            if state is not None:
                released.append(claim.job_id)
    finally:
        repo.engine.dispose()
    return released


def _said(exit_code: int | None) -> str:
    if exit_code is not None and exit_code < 0:
        return f"killed by signal {-exit_code}"
    return f"exit code {exit_code}"


def _note(root: Path, job_id: str, attempt: int, node: str, state: str | None) -> None:
    log.warning("worker_released job=%s attempt=%d node=%s state=%s dir=%s: its worker process "
                "died before the job finished", job_id, attempt, node, state or "fenced", root)
