"""Dependencies between jobs (`after:`), kept inside the transactions that change them.

A job waits for each id in its `after` (a job `j-…` or an array `a-…`, same tenant) to
succeed. Each dependency not yet succeeded at submit time is a `job_deps` row and counts in
`jobs.deps_pending`; the scheduler only reads jobs at `deps_pending = 0` (an index prefix).

Every transaction that ends a job calls `on_final` (the outcome write, lease expiry, cancel
of a job or an array): a success deletes the rows that wait for it and lowers the waiting
jobs' counts; a failure or cancel ends every job waiting for it, transitively, as
`cancelled` with reason `dependency` and an error naming the dependency. An array counts as
succeeded when every item did, and as failed as soon as one item failed or was cancelled.

Submit checks a request's dependencies in two steps, so that no request holds the store's
write lock for longer than its inserts take (docs/reliability.md, "No request can lock the
store"): `check_after` reads every distinct id of the whole request in bulk on a read
session, before the write transaction opens, and refuses unknown, foreign and failed ones;
`confirm_after`, inside the write transaction, reads again only the dependencies that were
still pending, the only ones that can have changed in between.

Locks (PostgreSQL; SQLite's BEGIN IMMEDIATE serialises writers anyway): `confirm_after`
locks each pending dependency's row (the job's, or the array's) FOR KEY SHARE before it
reads its state, and the end of a job holds the job's row FOR UPDATE and locks its array's
row FOR UPDATE before it looks for waiting rows, so a dependency never ends unseen between
a submit's check and its insert. Jobs before arrays.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime

from sqlalchemy import (
    Connection,
    Dialect,
    Exists,
    ScalarSelect,
    bindparam,
    delete,
    exists,
    or_,
    select,
    update,
)
from sqlalchemy.orm import Session

from e31.core.errors import SpecError
from e31.core.states import FINAL_STATES, JobState
from e31.store import bulk, transitions
from e31.store.db import core_of, unindexed
from e31.store.models import Array, Job, JobDep
from e31.store.rows import CHUNK

DEPENDENCY_REASON = "dependency"   # jobs.reason of a job ended because a dependency failed
_LIVE = sorted(s.value for s in JobState if not s.is_final)
_BAD = sorted(s.value for s in FINAL_STATES if s is not JobState.SUCCEEDED)   # never succeed
_SUCCEEDED = JobState.SUCCEEDED.value
_DONE, _WAIT = "done", "wait"   # a dependency's status at submit, unless it refuses the job
_ERRORS_MAX = 20                # refused entries named in one answer

Ended = tuple[str, str | None, str]   # (job id, its array id or None, final state)


def check_after(s: Session, tenant_id: str, after: Sequence[Sequence[str]],
                fields: Sequence[str]) -> list[list[str]]:
    """Before the write: for each new job's `after` list, the dependencies still to wait for,
    read on a read session (no lock held), every distinct id of the request in one bulk query
    per `CHUNK` of ids.

    Refuses (`SpecError` naming `<field>after[i]`) an id that is not the tenant's, and a
    dependency that already failed or was cancelled (the job could never run). Only the
    dependencies still to wait for can change before the write, so only these are read again,
    locked, inside it (`confirm_after`).
    """
    return _judge(after, fields, _statuses(s, tenant_id, _distinct(after)))


def confirm_after(session: Session | Connection, tenant_id: str, after: Sequence[Sequence[str]],
                  fields: Sequence[str], checked: Sequence[Sequence[str]]) -> list[list[str]]:
    """Inside the write transaction: `checked` (what `check_after` returned) as it stands now.

    Between `check_after` and the write, only a dependency still pending can have changed:
    jobs and arrays are never deleted and never change tenant, a final state is final, and an
    array's items are fixed at its submission. So an id that was refused is still refused,
    one that was done (succeeded) is still done, and only the pending ones are locked (jobs
    before arrays) and looked up again, by key, for those that ended meanwhile (usually
    none): one that succeeded is dropped from the waits, one that failed refuses the
    request, as at submit. The lock orders this with the transaction that ends the
    dependency (see the module's docstring), which then sees the new `job_deps` rows.
    """
    pending = sorted({dep for deps in checked for dep in deps}, key=_jobs_first)
    if not pending:   # nothing to wait for (a job with no `after`): nothing to read again
        return [[] for _ in checked]
    s = core_of(session)
    _lock(s, pending)
    ended = _ended(s, pending)
    if not ended:
        return [list(deps) for deps in checked]
    status = dict.fromkeys(_distinct(after), _DONE) | dict.fromkeys(pending, _WAIT) | ended
    return _judge(after, fields, status)


def _distinct(after: Sequence[Sequence[str]]) -> list[str]:
    return sorted({dep for deps in after for dep in deps}, key=_jobs_first)


def _jobs_first(dep: str) -> tuple[bool, str]:
    return dep[0] != "j", dep


def _judge(after: Sequence[Sequence[str]], fields: Sequence[str],
           status: dict[str, str]) -> list[list[str]]:
    """Each job's waits, or `SpecError` naming every refused entry (the first 20)."""
    errors: list[dict[str, str]] = []
    waits: list[list[str]] = []
    for deps, prefix in zip(after, fields, strict=True):
        mine = []
        for i, dep in enumerate(deps):
            state = status[dep]
            if state == _WAIT:
                mine.append(dep)
            elif state != _DONE:
                errors.append({"field": f"{prefix}after[{i}]", "reason": state})
        waits.append(mine)
    if errors:
        raise SpecError(errors[:_ERRORS_MAX])
    return waits


def _statuses(s: Session, tenant_id: str, ids: Sequence[str]) -> dict[str, str]:
    """id -> `_DONE`, `_WAIT`, or why it is refused, for job and array ids, each `CHUNK` of
    ids in one statement. The tenant is compared unindexed, so the planner looks the ids up
    by key instead of scanning the tenant's jobs through its index."""
    status: dict[str, str] = {}
    for chunk in _chunks([dep for dep in ids if dep.startswith("j-")]):
        status.update((dep, f"no job {dep} of this tenant") for dep in chunk)
        status.update((dep, _job_status(dep, state)) for dep, state in s.execute(
            select(Job.id, Job.state).where(Job.id.in_(chunk),
                                            unindexed(Job.tenant_id) == tenant_id)).tuples())
    for chunk in _chunks([dep for dep in ids if not dep.startswith("j-")]):
        status.update((dep, f"no array {dep} of this tenant") for dep in chunk)
        failed, live = _array_items()
        status.update((dep, _array_status(dep, bad, waiting)) for dep, bad, waiting in s.execute(
            select(Array.id, failed, live).where(Array.id.in_(chunk),
                                                 unindexed(Array.tenant_id) == tenant_id)))
    return status


def _lock(s: Connection, pending: Sequence[str]) -> None:
    """Lock the rows of pending dependencies, jobs before arrays: this waits for a transaction
    that is ending one and holds the next one off until this commits. A job row FOR KEY SHARE
    (its ending holds it FOR UPDATE), which blocks no lease renewal or claim; an array row FOR
    SHARE, against `on_final`'s FOR NO KEY UPDATE (nothing but an operator's cancel or retry
    updates an array row). Not on SQLite, where the write transaction already excludes every
    other writer and rows have no locks."""
    if s.dialect.name == "sqlite":
        return
    for model in (Job, Array):
        prefix = "j-" if model is Job else "a-"
        for chunk in _chunks([dep for dep in pending if dep.startswith(prefix)]):
            s.execute(select(model.id).where(model.id.in_(chunk))
                      .with_for_update(read=True, key_share=model is Job))


def _ended(s: Connection, pending: Sequence[str]) -> dict[str, str]:
    """The pending dependencies that are pending no more, each with its status now; each
    `CHUNK` looked up by key in one statement that returns only those (usually none)."""
    status: dict[str, str] = {}
    for chunk in _chunks([dep for dep in pending if dep.startswith("j-")]):
        status.update((dep, _job_status(dep, state)) for dep, state in s.execute(
            select(Job.id, Job.state).where(Job.id.in_(chunk),
                                            unindexed(Job.state).not_in(_LIVE))).tuples())
    for chunk in _chunks([dep for dep in pending if not dep.startswith("j-")]):
        failed, live = _array_items()
        status.update((dep, _array_status(dep, bad, waiting)) for dep, bad, waiting in s.execute(
            select(Array.id, failed, live).where(Array.id.in_(chunk),
                                                 or_(failed.is_not(None), ~live))))
    return status


def _job_status(dep: str, state: str) -> str:
    if state in _BAD:
        return f"dependency {dep} {state}: this job could never run"
    return _DONE if state == _SUCCEEDED else _WAIT


def _array_items() -> tuple[ScalarSelect[str], Exists]:
    """For a statement over arrays: one item that failed or was cancelled (None if none),
    and whether any item is still queued or running."""
    item = Job.array_id == Array.id
    return (select(Job.id).where(item, Job.state.in_(_BAD)).limit(1).scalar_subquery(),
            exists().where(item, Job.state.in_(_LIVE)))


def _array_status(dep: str, failed: str | None, waiting: bool) -> str:
    if failed is not None:
        return f"dependency {dep}: its item {failed} did not succeed: this job could never run"
    return _WAIT if waiting else _DONE


def _chunks(ids: Sequence[str]) -> Iterator[Sequence[str]]:
    for start in range(0, len(ids), CHUNK):
        yield ids[start:start + CHUNK]


def links(dialect: Dialect, waits: Iterable[tuple[str, Sequence[str]]]) -> bulk.Prepared:
    """The `job_deps` rows of new jobs, prepared for the write that inserts the jobs (with
    their deps_pending) before them."""
    rows = [{"job_id": job_id, "dep_id": dep} for job_id, deps in waits for dep in deps]
    return bulk.prepare(dialect, JobDep, rows)


def first_pending(s: Session, job_id: str) -> str | None:
    """One dependency the job still waits for (for its pending reason)."""
    return s.scalar(select(JobDep.dep_id).where(JobDep.job_id == job_id)
                    .order_by(JobDep.dep_id).limit(1))


def on_final(session: Session | Connection, ended: Sequence[Ended], *, now: datetime) -> int:
    """Resolve what waited for jobs that just reached a final state; returns how many
    waiting jobs were cancelled (transitively). Core statements, in a session's transaction
    or on a connection's (every final outcome runs them, issue 31)."""
    s = core_of(session)
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
            # Locked before looking for dependants: a submit that read this array as pending
            # has then either committed its `job_deps` rows, or waits and reads the item's
            # final state after this commits (`confirm_after`). FOR NO KEY UPDATE, not FOR
            # UPDATE: the ending item's transaction updated its job row twice, so PostgreSQL's
            # foreign-key re-check holds this row FOR KEY SHARE, as another ending item's does,
            # and upgrading both to FOR UPDATE deadlocked (docs/scale.md).
            s.execute(_LOCK_ARRAY, {"array_id": array_id})
            if not _has_dependants(s, array_id):
                continue
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


def _has_dependants(s: Connection, dep_id: str) -> bool:
    return s.scalar(_A_DEPENDANT, {"dep_id": dep_id}) is not None


# What every final item's outcome runs (`on_final`), built once (issue 31)
_LOCK_ARRAY = (select(Array.id).where(Array.id == bindparam("array_id"))
               .with_for_update(key_share=True))
_A_DEPENDANT = select(JobDep.job_id).where(JobDep.dep_id == bindparam("dep_id")).limit(1)
_DEPENDANTS = select(JobDep.job_id).where(JobDep.dep_id.in_(bindparam("deps", expanding=True)))


def _satisfy(s: Connection, deps: Sequence[str]) -> None:
    """Dependencies that succeeded: their waiting jobs have one fewer to wait for each."""
    for start in range(0, len(deps), CHUNK):
        chunk = deps[start:start + CHUNK]
        counts: dict[str, int] = {}   # a job may wait for several of them at once
        for job_id in s.scalars(_DEPENDANTS, {"deps": chunk}):
            counts[job_id] = counts.get(job_id, 0) + 1
        if not counts:
            continue
        s.execute(delete(JobDep).where(JobDep.dep_id.in_(chunk)))
        by_count: dict[int, list[str]] = {}
        for job_id, n in counts.items():
            by_count.setdefault(n, []).append(job_id)
        for n, ids in by_count.items():
            s.execute(update(Job).where(Job.id.in_(ids)).values(deps_pending=Job.deps_pending - n))


def _cancel_dependants(s: Connection, bad: dict[str, str], *, now: datetime) -> list[Ended]:
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


def rearm(s: Session, tenant_id: str, resubmitted: Sequence[str], *, since: datetime,
          now: datetime) -> list[str]:
    """After `resubmitted` (job and array ids) were queued again: queue again, transitively,
    the tenant's jobs that a failure of one of them had cancelled (reason `dependency`, ended
    at or after `since`), each waiting again for its dependencies not yet succeeded. A job
    with another dependency that failed for good stays cancelled. Returns the ids queued."""
    candidates = [(job_id, (spec or {}).get("after") or [], array_id)
                  for job_id, spec, array_id in s.execute(
                      select(Job.id, Job.spec, Job.array_id).where(
                          Job.tenant_id == tenant_id, Job.ended_at >= since,
                          unindexed(Job.state) == JobState.CANCELLED.value,
                          Job.reason == DEPENDENCY_REASON).with_for_update())]
    frontier, rearmed = set(resubmitted), []
    while frontier:
        ready = [(job_id, after) for job_id, after, array_id in candidates
                 if job_id not in rearmed and frontier & {*after, array_id}]
        ready = [(job_id, after) for job_id, after in ready if job_id not in frontier]
        if not ready:
            break
        status = _statuses(s, tenant_id, _distinct([after for _, after in ready]))
        go = [(job_id, [d for d in after if status.get(d) == _WAIT]) for job_id, after in ready
              if all(status.get(d) in (_WAIT, _DONE) for d in after)]
        if not go:
            break
        transitions.resubmit(s, [(job_id, JobState.CANCELLED.value) for job_id, _ in go],
                             now=now)
        for job_id, wait in go:
            if wait:
                s.execute(update(Job).where(Job.id == job_id).values(deps_pending=len(wait)),
                          execution_options={"synchronize_session": False})
        links(s.get_bind().dialect, go).run(s)
        rearmed += [job_id for job_id, _ in go]
        frontier = {job_id for job_id, _ in go} | {array_id for job_id, _, array_id in candidates
                                                   if array_id and job_id in dict(go)}
    return rearmed
