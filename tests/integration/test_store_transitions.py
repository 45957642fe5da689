"""Job state changes on real SQLite and PostgreSQL: each one is a step the transitions table
allows, taken from the state the row is really in (`e31.store.transitions.move`)."""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.orm import Session

from e31.core.clock import utcnow
from e31.core.errors import IllegalTransition, StoreError
from e31.core.records import JobRecord, Outcome
from e31.core.sizeclasses import route
from e31.core.spec import JobSpec
from e31.core.states import AttemptReason, JobState
from e31.edge.settings import Settings
from e31.store import Repo
from e31.store.transitions import move
from tests.integration.test_store import publish

CLASSES = Settings().size_classes
SET_STATE = re.compile(r"^\s*UPDATE jobs SET (?P<set>.*?) WHERE (?P<where>.*)$", re.S)


def submit(repo: Repo, tenant_id: str, **fields: object) -> JobRecord:
    spec = JobSpec.parse({"entrypoint": "pkg.mod:main", **fields})
    return repo.insert_job(tenant_id, spec, route(spec, CLASSES), now=utcnow())


def run(repo: Repo, job_id: str, reason: AttemptReason, *, now: datetime | None = None,
        **outcome: Any) -> JobState | None:
    """Claim the job and end its attempt with `reason` (at `now`, else the wall clock)."""
    now = now or utcnow()
    c = repo.claim(job_id, dispatch_token=publish(repo, job_id, now), worker="gpu0@t", gpus="0",
                   gpu_count=1, now=now, lease_ttl_s=10)
    assert c is not None
    return repo.record_outcome(job_id, c.token, Outcome(reason, **outcome), now=now)


def test_an_illegal_transition_is_refused_and_the_job_stays_as_it_was(repo: Repo) -> None:
    # Given a job that succeeded
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job = submit(repo, tenant.id)
    assert run(repo, job.id, AttemptReason.SUCCEEDED) is JobState.SUCCEEDED

    # When the store is asked to move it from succeeded back to running
    with pytest.raises(IllegalTransition) as refused, Session(repo.engine) as s, s.begin():
        s.execute(move(job.id, JobState.SUCCEEDED, JobState.RUNNING))

    # Then it refuses, as a store error, and the job is still succeeded
    assert isinstance(refused.value, StoreError)
    assert refused.value.message == "a job may not go from succeeded to running"
    assert repo.get_job(tenant.id, job.id).state == JobState.SUCCEEDED


def test_a_move_from_a_state_the_job_has_left_changes_nothing(repo: Repo) -> None:
    # Given a queued job that was cancelled
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job = submit(repo, tenant.id)
    repo.request_cancel(tenant.id, job.id, now=utcnow())

    # When a claim's move (queued -> running, allowed by the table) reaches it
    with Session(repo.engine) as s, s.begin():
        moved = s.execute(move(job.id, JobState.QUEUED, JobState.RUNNING)).rowcount

    # Then no row moved: the condition is the row's real state
    assert moved == 0
    assert repo.claim(job.id, dispatch_token=publish(repo, job.id), worker="w", gpus="0",
                      gpu_count=1, now=utcnow(), lease_ttl_s=10) is None
    assert repo.get_job(tenant.id, job.id).state == JobState.CANCELLED


def test_a_final_job_takes_no_further_step_through_any_store_method(repo: Repo) -> None:
    # Given a job that failed for good
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job = submit(repo, tenant.id, retries={"max": 0})
    assert run(repo, job.id, AttemptReason.ERROR, error="boom") is JobState.FAILED

    # When it is claimed, cancelled and its lease is judged
    claimed = repo.claim(job.id, dispatch_token=publish(repo, job.id), worker="w", gpus="0",
                         gpu_count=1, now=utcnow(), lease_ttl_s=10)
    cancelled = repo.request_cancel(tenant.id, job.id, now=utcnow())
    expired = repo.expire_leases(now=utcnow() + timedelta(hours=1), lease_ttl_s=10)

    # Then it stays failed
    assert (claimed, cancelled.state, expired) == (None, JobState.FAILED, [])


def test_every_state_change_the_store_writes_is_conditional_on_the_state_it_leaves(
        repo: Repo) -> None:
    # Given every UPDATE of the jobs table recorded as the database receives it
    statements: list[str] = []

    @event.listens_for(repo.engine, "before_cursor_execute")
    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    # When jobs go every way a job can go: retried, lost, succeeded, cancelled queued and
    # running, failed with a dependant, and cancelled as an array
    tenant, _ = repo.create_tenant("a", now=utcnow())
    flaky = submit(repo, tenant.id, retries={"max": 1, "backoff_s": 0})
    assert run(repo, flaky.id, AttemptReason.ERROR, error="boom") is JobState.QUEUED
    t0 = utcnow()
    assert repo.claim(flaky.id, dispatch_token=publish(repo, flaky.id, t0), worker="gpu0@t",
                      gpus="0", gpu_count=1, now=t0, lease_ttl_s=10) is not None
    assert repo.expire_leases(now=t0 + timedelta(seconds=11), lease_ttl_s=10) == [
        (flaky.id, JobState.QUEUED)]
    assert run(repo, flaky.id, AttemptReason.SUCCEEDED,
               now=t0 + timedelta(seconds=12)) is JobState.SUCCEEDED
    repo.request_cancel(tenant.id, submit(repo, tenant.id).id, now=utcnow())
    running = submit(repo, tenant.id)
    c = repo.claim(running.id, dispatch_token=publish(repo, running.id), worker="w", gpus="0",
                   gpu_count=1, now=utcnow(), lease_ttl_s=10)
    assert c is not None
    repo.request_cancel(tenant.id, running.id, now=utcnow())
    assert repo.record_outcome(running.id, c.token, Outcome(AttemptReason.ERROR),
                               now=utcnow()) is JobState.CANCELLED
    first = submit(repo, tenant.id, retries={"max": 0})
    second = submit(repo, tenant.id, after=[first.id])
    assert run(repo, first.id, AttemptReason.ERROR) is JobState.FAILED
    spec = JobSpec.parse({"entrypoint": "pkg.mod:main"})
    array = repo.insert_array(tenant.id, "sweep", [(spec, route(spec, CLASSES))] * 3,
                              now=utcnow())
    repo.cancel_array(tenant.id, array.id, now=utcnow())
    event.remove(repo.engine, "before_cursor_execute", record)

    # Then each statement that set a job's state also required the state it moved from
    state_changes = [m for m in map(SET_STATE.match, statements)
                     if m and re.search(r"(^|[\s,])state\s*=", m["set"])]
    assert len(state_changes) >= 10
    assert all("jobs.state" in m["where"] for m in state_changes), state_changes
    assert repo.get_job(tenant.id, second.id).state == JobState.CANCELLED
    assert repo.get_array(tenant.id, array.id).counts == {JobState.CANCELLED.value: 3}
