"""Retrying an array's failed items, in the store (SQLite and PostgreSQL): the same jobs run
again as their next attempt, and a job that their failure cancelled waits for them again."""

from __future__ import annotations

import pytest

from e31.core.clock import utcnow
from e31.core.errors import IllegalTransition, NotFound
from e31.core.sizeclasses import route
from e31.core.spec import JobSpec
from e31.core.states import AttemptReason, JobState
from e31.edge.settings import Settings
from e31.store import Repo, transitions
from tests.integration.test_dependencies import array, end, state
from tests.integration.test_fair_scheduling import one


def test_failed_items_run_again_as_the_same_jobs_and_the_job_after_the_array_then_runs(
        repo: Repo) -> None:
    # Given an array of three items and a job after it; one item succeeds, one fails
    # (which cancels the job after the array), and one is still queued
    tenant, _ = repo.create_tenant("a", now=utcnow())
    array_id, items = array(repo, tenant.id, 3, retries={"max": 0})
    merge = one(repo, tenant.id, after=[array_id])
    end(repo, items[0])
    end(repo, items[1], AttemptReason.ERROR)
    assert state(repo, merge)[:2] == ("cancelled", "dependency")

    # When the array's failed items are retried
    done = repo.retry_array(tenant.id, array_id, now=utcnow())

    # Then only the failed item is queued again, the same job, and the merge waits again
    assert done.resubmitted == [items[1]] and done.rearmed == [merge]
    assert [state(repo, i)[0] for i in items] == ["succeeded", "queued", "queued"]
    assert state(repo, merge) == ("queued", None, None)
    # And when the items succeed, the failed one as its second attempt, the merge is free
    end(repo, items[1])
    end(repo, items[2])
    assert [a.n for a in repo.get_job(None, items[1]).attempts] == [1, 2]
    assert repo.get_job(None, items[1]).state == "succeeded"
    end(repo, merge)
    assert state(repo, merge)[0] == "succeeded"


def test_a_job_with_another_dependency_that_failed_stays_cancelled(repo: Repo) -> None:
    # Given a job after an array and after a job; the job fails, then an item fails
    tenant, _ = repo.create_tenant("a", now=utcnow())
    array_id, items = array(repo, tenant.id, 1, retries={"max": 0})
    other = one(repo, tenant.id, retries={"max": 0})
    merge = one(repo, tenant.id, after=[array_id, other])
    end(repo, other, AttemptReason.ERROR)
    end(repo, items[0], AttemptReason.ERROR)

    # When the array is retried, the item runs again but the job stays cancelled
    done = repo.retry_array(tenant.id, array_id, now=utcnow())
    assert done.resubmitted == items and done.rearmed == []
    assert state(repo, merge)[0] == "cancelled"


def test_another_tenants_array_cannot_be_retried_and_reads_as_absent(repo: Repo) -> None:
    a, _ = repo.create_tenant("a", now=utcnow())
    b, _ = repo.create_tenant("b", now=utcnow())
    array_id, items = array(repo, a.id, 1, retries={"max": 0})
    end(repo, items[0], AttemptReason.ERROR)
    with pytest.raises(NotFound):
        repo.retry_array(b.id, array_id, now=utcnow())
    assert state(repo, items[0])[0] == "failed"


def test_a_resubmit_refuses_a_state_it_does_not_name(repo: Repo) -> None:
    tenant, _ = repo.create_tenant("a", now=utcnow())
    spec = JobSpec.parse({"entrypoint": "pkg.mod:main"})
    job = repo.insert_job(tenant.id, spec, route(spec, Settings().size_classes), now=utcnow())
    with repo._session(write=True) as s, pytest.raises(IllegalTransition):
        transitions.resubmit(s, [(job.id, JobState.SUCCEEDED.value)], now=utcnow())
