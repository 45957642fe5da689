"""A worker process's death, answered by its launcher at once (docs/reliability.md, "A dead
node noticed in seconds").

Without it, the job of a SIGKILLed worker process waited for the process's successor to start
(a new interpreter, its imports), beat without the job, and for the scheduler to see its lease
silent. The launcher sees the death within `SUPERVISE_POLL_S`; before it starts the successor
it takes the node's lock (free once the process died), kills what the dead process's jobs left
running (its process groups and cgroups: PDEATHSIG has usually done so already, but not for
a job whose worker died while bubblewrap was still building its sandbox, since the namespace's
init asks to die with its parent only once the sandbox is up), and ends `lost`
with the old fencing token each attempt of that node that had not finished, then wakes the
scheduler: the job is published again within about a second of the death. An attempt whose
child had finished (its result is in its directory) is left to the successor, which records
its outcome (`e31_worker.attempt.settle`), so that finished work is never run twice. Every
write is fenced: one the scheduler's recovery beat is refused and changes nothing.

A launcher does the same for each of its nodes when it starts (`at_start`): a node that died
whole (its launcher with it) and came back before the scheduler judged it silent would
otherwise keep its old jobs to their leases, its new launcher's beat saying it lives.
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
from e31_worker.attempt.claimfiles import left_claims
from e31_worker.attempt.groups import GroupRegistry, NodeLock
from e31_worker.attempt.outcomes import finished_outcome

log = logging.getLogger(__name__)


def release_dead_worker(settings: Settings, node: str, *, exit_code: int | None,
                        redis_client: redis.Redis | None, at_start: bool = False) -> list[str]:
    """Answer the death of `node`'s worker process (module docstring); returns the jobs whose
    attempts were ended `lost`. Never raises: what fails is logged, and the successor and the
    scheduler's recovery do the rest as before."""
    groups_dir = settings.resolved_work_dir / ".groups"
    lock = NodeLock(groups_dir / f"{node}.lock")
    try:
        if lock.acquire() is not None:     # a process serves the node already: nothing died
            return []
    except OSError as exc:                 # its successor's settle and the scheduler recover
        log.warning("worker_release_failed node=%s: %s", node, exc)
        return []
    try:
        GroupRegistry(groups_dir / node).reap()
        cgroups = JobCgroups.for_node(node, place=stack_place(settings.resolved_work_dir))
        if cgroups is not None:
            cgroups.reap()
        released = _end_unfinished(settings, node, _why(exit_code, at_start))
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


def _end_unfinished(settings: Settings, node: str, why: str) -> list[str]:
    """End `lost` the running jobs whose lease `node` holds, but for those whose child had
    finished (their result is in the attempt's directory: the successor records them); a job
    killed in its setup, before its claim was kept on disk, is among them. Each write carries
    the job's own token, read with it."""
    finished = {str(data.get("job_id")) for root, data in
                left_claims(settings.resolved_work_dir, node) if _finished(root)}
    repo = wiring.attempt_store(settings, node=node)
    released = []
    try:
        held = [(job_id, token) for job_id, token in repo.held_by(node)
                if job_id not in finished]
        for job_id, token in held:
            outcome = Outcome(AttemptReason.LOST, error=f"its worker process {node} {why}")
            try:
                state = repo.record_outcome(job_id, token, outcome, now=utcnow(),
                                            infra_retries=settings.infra_retries)
            except E31Error as exc:        # the store is down: the lease runs its course
                log.warning("worker_release_failed job=%s node=%s: %s", job_id, node, exc)
                continue
            log.warning("worker_released job=%s node=%s state=%s: its worker process %s",
                        job_id, node, state.value if state else "fenced", why)
            if state is not None:
                released.append(job_id)
    finally:
        repo.engine.dispose()
    return released


def _finished(root: Path) -> bool:
    """Whether the attempt in `root` had finished (its child wrote its outcome); one that
    cannot be read counts as finished, left to the successor, which never runs it twice."""
    try:
        return finished_outcome(root) is not None
    except Exception:  # noqa: BLE001 - a torn or odd file: the successor's settle decides
        return True


def _why(exit_code: int | None, at_start: bool) -> str:
    """What the attempt's error says happened to its worker process."""
    if at_start:
        return ("was gone when its node's launcher started again (the node died or was "
                "restarted); the launcher released the job at its start")
    said = (f"killed by signal {-exit_code}" if exit_code is not None and exit_code < 0
            else f"exit code {exit_code}")
    return f"died ({said}); its launcher released the job at once"
