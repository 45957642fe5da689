"""`after:` dependencies through the real scheduler, Redis and store."""

from __future__ import annotations

import pytest
import redis

from e31.core.clock import utcnow
from e31.core.errors import SpecError
from e31.core.records import Outcome
from e31.core.sizeclasses import route
from e31.core.spec import JobSpec
from e31.core.states import AttemptReason
from e31.edge.settings import Settings
from e31.store import Repo
from tests.integration.test_fair_scheduling import one
from tests.integration.test_scheduler import heartbeat, make, published
from tests.integration.test_store import publish

GPU24 = "e31.gpu24"


def array(repo: Repo, tenant_id: str, n: int, **fields: object) -> tuple[str, list[str]]:
    spec = JobSpec.parse({"entrypoint": "pkg.mod:main", **fields})
    record = repo.insert_array(tenant_id, "arr", [(spec, route(spec, Settings().size_classes))] * n,
                               now=utcnow())
    return record.id, [item.id for item in record.items or []]


def end(repo: Repo, job_id: str, reason: AttemptReason = AttemptReason.SUCCEEDED) -> None:
    """Claim the job and record how its one attempt ended."""
    claim = repo.claim(job_id, dispatch_token=publish(repo, job_id), worker="gpu9@x", gpus="9",
                       gpu_count=1, now=utcnow(), lease_ttl_s=60)
    assert claim is not None
    repo.record_outcome(job_id, claim.token, Outcome(reason, error="boom"), now=utcnow())


def state(repo: Repo, job_id: str) -> tuple[str, str | None, str | None]:
    job = repo.get_job(None, job_id)
    return job.state, job.reason, job.error


def test_a_job_after_a_job_runs_only_once_the_first_succeeded(
        repo: Repo, redis_url: str, redis_client: redis.Redis) -> None:
    # Given B after A, and two idle workers
    tenant, _ = repo.create_tenant("a", now=utcnow())
    first = one(repo, tenant.id)
    second = one(repo, tenant.id, after=[first])
    heartbeat(redis_client, "gpu0@n", [GPU24])
    heartbeat(redis_client, "gpu1@n", [GPU24])
    scheduler = make(repo, redis_url, dispatch_headroom=0)

    # When the scheduler ticks, then only A is published
    scheduler.tick()
    assert published(redis_client, GPU24) == [first]

    # When A succeeds, then B is published on the next tick
    end(repo, first)
    scheduler.tick()
    assert sorted(published(redis_client, GPU24)) == sorted([first, second])


def test_a_job_after_an_array_waits_for_every_item(
        repo: Repo, redis_url: str, redis_client: redis.Redis) -> None:
    # Given an array of two items and a job after the array
    tenant, _ = repo.create_tenant("a", now=utcnow())
    array_id, items = array(repo, tenant.id, 2)
    after = one(repo, tenant.id, after=[array_id])
    heartbeat(redis_client, "gpu0@n", [GPU24])
    scheduler = make(repo, redis_url, dispatch_headroom=0)

    # When one item succeeded, the job still waits
    end(repo, items[0])
    scheduler.tick()
    assert after not in published(redis_client, GPU24)

    # When the other succeeded too, it is published
    end(repo, items[1])
    redis_client.flushdb()
    heartbeat(redis_client, "gpu0@n", [GPU24])
    scheduler.tick()
    assert after in published(redis_client, GPU24)


def test_a_failed_dependency_ends_an_array_after_it_and_what_follows_with_a_reason_naming_it(
        repo: Repo) -> None:
    # Given an array after job D, and job F after the array
    tenant, _ = repo.create_tenant("a", now=utcnow())
    dep = one(repo, tenant.id, retries={"max": 0})
    array_id, items = array(repo, tenant.id, 3, after=[dep])
    last = one(repo, tenant.id, after=[array_id])

    # When D fails
    end(repo, dep, AttemptReason.ERROR)

    # Then every item is cancelled, naming D, and F too, naming the array
    for item in items:
        assert state(repo, item)[:2] == ("cancelled", "dependency")
        assert f"dependency {dep} failed" in (state(repo, item)[2] or "")
    final, reason, error = state(repo, last)
    assert (final, reason) == ("cancelled", "dependency") and array_id in (error or "")


def test_cancelling_a_dependency_cancels_what_waits_for_it(repo: Repo) -> None:
    tenant, _ = repo.create_tenant("a", now=utcnow())
    dep = one(repo, tenant.id)
    after = one(repo, tenant.id, after=[dep])

    repo.request_cancel(tenant.id, dep, now=utcnow())

    assert state(repo, after)[:2] == ("cancelled", "dependency")


def test_a_queued_job_waiting_for_a_dependency_says_which(repo: Repo, redis_client: redis.Redis,
                                                          tmp_path) -> None:
    from tests.integration.test_fair_scheduling import service
    tenant, _ = repo.create_tenant("a", now=utcnow())
    dep = one(repo, tenant.id)
    after = one(repo, tenant.id, after=[dep])

    pending = service(repo, redis_client, tmp_path).get(tenant, after).pending

    assert pending is not None and pending["reason"] == "dependency"
    assert pending["text"] == f"dependency {dep} not finished"


def test_a_dependency_of_another_tenant_or_that_failed_is_refused_naming_it(repo: Repo) -> None:
    # Given a job of tenant b, and a failed job of tenant a
    a, _ = repo.create_tenant("a", now=utcnow())
    b, _ = repo.create_tenant("b", now=utcnow())
    theirs = one(repo, b.id)
    failed = one(repo, a.id)
    end(repo, failed, AttemptReason.ERROR)

    # When a submits after either, then the submit is refused naming the entry
    with pytest.raises(SpecError) as refused:
        one(repo, a.id, after=[theirs])
    assert refused.value.errors == [{"field": "after[0]",
                                     "reason": f"no job {theirs} of this tenant"}]
    with pytest.raises(SpecError) as refused:
        array(repo, a.id, 2, after=[failed])
    assert refused.value.errors[0]["field"] == "items[0].after[0]"
    assert "failed" in refused.value.errors[0]["reason"]
