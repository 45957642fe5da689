"""Dependencies between jobs (`after:`), kept inside the transactions that change them.

A job waits for each id in its `after` (a job `j-…` or an array `a-…`, same tenant) to
succeed. Each dependency not yet succeeded at submit time is a `job_deps` row and counts in
`jobs.deps_pending`; the scheduler only reads jobs at `deps_pending = 0` (an index prefix).

Every transaction that ends a job calls `on_final` (the outcome write, lease expiry, cancel
of a job or an array): a success deletes the rows that wait for it and lowers the waiting
jobs' counts; a failure or cancel ends every job waiting for it, transitively, as
`cancelled` with reason `dependency` and an error naming the dependency. An array counts as
succeeded when every item did, and as failed as soon as one item failed or was cancelled.

Locks (PostgreSQL; SQLite's BEGIN IMMEDIATE serialises writers anyway): submit locks each
dependency's row (the job's, or the array's) before it reads its state, and the end of a
job holds the job's row and locks its array's row before it reads the waiting rows, so a
dependency never ends unseen between a submit's check and its insert. Jobs before arrays.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime

from sqlalchemy import delete, insert, select, update
from sqlalchemy.orm import Session

from e31.errors import SpecError
from e31.states import FINAL_STATES, JobState
from e31.store import transitions
from e31.store.db import unindexed
from e31.store.models import Array, Job, JobDep
from e31.store.rows import CHUNK

DEPENDENCY_REASON = "dependency"   # jobs.reason of a job ended because a dependency failed
_LIVE = sorted(s.value for s in JobState if not s.is_final)
_BAD = sorted(s.value for s in FINAL_STATES if s is not JobState.SUCCEEDED)   # never succeed

Ended = tuple[str, str | None, str]   # (job id, its array id or None, final state)


def check_after(s: Session, tenant_id: str, after: Sequence[Sequence[str]],
                fields: Sequence[str]) -> list[list[str]]:
    """For each new job's `after` list, the dependencies still to wait for.

    Refuses (`SpecError` naming `<field>after[i]`) an id that is not the tenant's, and a
    dependency that already failed or was cancelled (the job could never run).
    """
    wanted = sorted({d for deps in after for d in deps}, key=lambda d: (d[0] != "j", d))
    status: dict[str, str] = {}   # id -> "done" | "wait" | why it is refused
    for dep in wanted:
        status[dep] = _dep_status(s, tenant_id, dep)
    errors: list[dict[str, str]] = []
    waits: list[list[str]] = []
    for deps, prefix in zip(after, fields, strict=True):
        mine = []
        for i, dep in enumerate(deps):
            state = status[dep]
            if state == "wait":
                mine.append(dep)
            elif state != "done":
                errors.append({"field": f"{prefix}after[{i}]", "reason": state})
        waits.append(mine)
    if errors:
        raise SpecError(errors[:20])
    return waits


def _dep_status(s: Session, tenant_id: str, dep: str) -> str:
    if dep.startswith("j-"):
        state = s.scalar(select(Job.state).where(Job.id == dep, Job.tenant_id == tenant_id)
                         .with_for_update())
        if state is None:
            return f"no job {dep} of this tenant"
        if state in _BAD:
            return f"dependency {dep} {state}: this job could never run"
        return "done" if state == JobState.SUCCEEDED.value else "wait"
    found = s.scalar(select(Array.id).where(Array.id == dep, Array.tenant_id == tenant_id)
                     .with_for_update())
    if found is None:
        return f"no array {dep} of this tenant"
    bad = s.scalar(select(Job.id).where(Job.array_id == dep, Job.state.in_(_BAD)).limit(1))
    if bad is not None:
        return f"dependency {dep}: its item {bad} did not succeed: this job could never run"
    live = s.scalar(select(Job.id).where(Job.array_id == dep, Job.state.in_(_LIVE)).limit(1))
    return "wait" if live is not None else "done"


def link(s: Session, waits: Iterable[tuple[str, Sequence[str]]]) -> None:
    """Insert the `job_deps` rows of new jobs (inserted already, with their deps_pending)."""
    rows = [{"job_id": job_id, "dep_id": dep} for job_id, deps in waits for dep in deps]
    if rows:
        s.execute(insert(JobDep), rows)


def first_pending(s: Session, job_id: str) -> str | None:
    """One dependency the job still waits for (for its pending reason)."""
    return s.scalar(select(JobDep.dep_id).where(JobDep.job_id == job_id)
                    .order_by(JobDep.dep_id).limit(1))


def on_final(s: Session, ended: Sequence[Ended], *, now: datetime) -> int:
    """Resolve what waited for jobs that just reached a final state; returns how many
    waiting jobs were cancelled (transitively)."""
    cancelled = 0
    frontier = list(ended)
    while frontier:
        ok: list[str] = []
        bad: dict[str, str] = {}   # dependency id -> why its dependants end
        arrays: dict[str, list[Ended]] = {}
        for job_id, array_id, state in frontier:
            if state == JobState.SUCCEEDED.value:
                ok.append(job_id)
            else:
                bad[job_id] = f"dependency {job_id} {state}"
            if array_id is not None:
                arrays.setdefault(array_id, []).append((job_id, array_id, state))
        for array_id in sorted(arrays):
            if not _has_dependants(s, array_id):
                continue
            s.execute(select(Array.id).where(Array.id == array_id).with_for_update())
            failed = [e for e in arrays[array_id] if e[2] != JobState.SUCCEEDED.value]
            if failed:
                bad[array_id] = f"dependency {array_id}: its item {failed[0][0]} {failed[0][2]}"
            elif s.scalar(select(Job.id).where(Job.array_id == array_id,
                                               Job.state.in_(_LIVE + _BAD)).limit(1)) is None:
                ok.append(array_id)
        _satisfy(s, ok)
        frontier = _cancel_dependants(s, bad, now=now)
        cancelled += len(frontier)
    return cancelled


def _has_dependants(s: Session, dep_id: str) -> bool:
    return s.scalar(select(JobDep.job_id).where(JobDep.dep_id == dep_id).limit(1)) is not None


def _satisfy(s: Session, deps: Sequence[str]) -> None:
    """Dependencies that succeeded: their waiting jobs have one fewer to wait for each."""
    for start in range(0, len(deps), CHUNK):
        chunk = deps[start:start + CHUNK]
        counts: dict[str, int] = {}   # a job may wait for several of them at once
        for job_id in s.scalars(select(JobDep.job_id).where(JobDep.dep_id.in_(chunk))):
            counts[job_id] = counts.get(job_id, 0) + 1
        if not counts:
            continue
        s.execute(delete(JobDep).where(JobDep.dep_id.in_(chunk)),
                  execution_options={"synchronize_session": False})
        by_count: dict[int, list[str]] = {}
        for job_id, n in counts.items():
            by_count.setdefault(n, []).append(job_id)
        for n, ids in by_count.items():
            s.execute(update(Job).where(Job.id.in_(ids)).values(deps_pending=Job.deps_pending - n),
                      execution_options={"synchronize_session": False})


def _cancel_dependants(s: Session, bad: dict[str, str], *, now: datetime) -> list[Ended]:
    """End every queued job waiting for a failed dependency; returns them for the next round."""
    ended: list[Ended] = []
    for dep_id, why in sorted(bad.items()):
        waiting = list(s.scalars(select(JobDep.job_id).where(JobDep.dep_id == dep_id)))
        for start in range(0, len(waiting), CHUNK):
            rows = s.execute(select(Job.id, Job.array_id, Job.queued_since).where(
                Job.id.in_(waiting[start:start + CHUNK]),
                unindexed(Job.state) == JobState.QUEUED.value).with_for_update()).all()
            transitions.cancel_queued(s, [(job_id, since) for job_id, _, since in rows], now=now,
                                      reason=DEPENDENCY_REASON, error=f"{why}; this job never ran")
            ended += [(job_id, array_id, JobState.CANCELLED.value) for job_id, array_id, _ in rows]
    return ended
