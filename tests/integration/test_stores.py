"""Each store works alone, built from an engine (store/base.py): the scheduler's and the
worker's stores carry every call their process makes, and reach other nouns through those
nouns' stores on the same engine."""

from __future__ import annotations

from datetime import timedelta

from e31.core.clock import utcnow
from e31.core.records import Outcome
from e31.core.sizeclasses import route
from e31.core.spec import JobSpec
from e31.core.states import AttemptReason, JobState
from e31.edge.settings import Settings
from e31.store import (
    ArrayStore,
    AttemptStore,
    DrainStore,
    JobStore,
    Repo,
    SchedulingStore,
    TenantStore,
)

CLASSES = Settings().size_classes
HALF_LIFE_S = Settings().fair_share_half_life_s


def test_a_job_goes_from_submit_to_its_end_through_the_stores_of_each_process(repo: Repo) -> None:
    # Given the stores the API, the scheduler and the worker are given, on one engine
    tenants, jobs = TenantStore(repo.engine), JobStore(repo.engine)
    scheduler = SchedulingStore(repo.engine, half_life_s=HALF_LIFE_S)
    worker = AttemptStore(repo.engine, half_life_s=HALF_LIFE_S)
    tenant, _ = tenants.create_tenant("a", now=utcnow())
    tenants.put_secret(tenant.id, "KEY", "ciphertext", now=utcnow())
    spec = JobSpec.parse({"entrypoint": "pkg.mod:main", "secrets": ["KEY"]})
    job = jobs.insert_job(tenant.id, spec, route(spec, CLASSES), now=utcnow())

    # When the scheduler publishes it and the worker claims, reads its secret and records it
    [head] = scheduler.heads({job.queue: 4}, now=utcnow())
    token = scheduler.mark_dispatched([head.id], now=utcnow())[job.id]
    claim = worker.claim(job.id, dispatch_token=token, worker="gpu0@test", gpus="0",
                         gpu_count=1, now=utcnow(), lease_ttl_s=10)
    assert claim is not None
    assert worker.secret_ciphertexts(tenant.id, ["KEY"]) == {"KEY": "ciphertext"}
    ended = worker.record_outcome(job.id, claim.token, Outcome(AttemptReason.SUCCEEDED),
                                  now=utcnow())

    # Then the API's store reads the end
    assert ended is JobState.SUCCEEDED
    assert jobs.get_job(tenant.id, job.id).state == JobState.SUCCEEDED.value


def test_the_scheduler_store_recovers_an_expired_lease_alone(repo: Repo) -> None:
    # Given a job claimed by a worker that then died
    tenant, _ = repo.create_tenant("a", now=utcnow())
    spec = JobSpec.parse({"entrypoint": "pkg.mod:main"})
    job = repo.insert_job(tenant.id, spec, route(spec, CLASSES), now=utcnow())
    token = repo.mark_dispatched([job.id], now=utcnow())[job.id]
    assert repo.claim(job.id, dispatch_token=token, worker="gpu0@dead", gpus="0", gpu_count=1,
                      now=utcnow(), lease_ttl_s=10) is not None

    # When the scheduler's store alone expires the leases after the TTL
    scheduler = SchedulingStore(repo.engine, half_life_s=HALF_LIFE_S)
    done = scheduler.expire_leases(now=utcnow() + timedelta(seconds=60), lease_ttl_s=10)

    # Then the job is queued again, its attempt lost
    assert done == [(job.id, JobState.QUEUED)]
    assert repo.get_job(tenant.id, job.id).attempts[0].reason == AttemptReason.LOST.value


def test_the_worker_store_reaches_arrays_and_drains_through_their_stores(repo: Repo) -> None:
    # Given an array, and the worker's store alone
    tenant, _ = repo.create_tenant("a", now=utcnow())
    spec = JobSpec.parse({"entrypoint": "pkg.mod:main"})
    array = ArrayStore(repo.engine).insert_array(
        tenant.id, "sweep", [(spec, route(spec, CLASSES))] * 2, now=utcnow())
    worker = AttemptStore(repo.engine, half_life_s=HALF_LIFE_S)
    since = utcnow() - timedelta(seconds=5)

    # When it reads the manifest and asks its node to drain
    manifest = worker.array_manifest(tenant.id, array.id)
    worker.request_drain(["gpu0@test"], now=utcnow(), reason="xid 79")

    # Then it gets the array's items, and the drain is the drain store's, until cleared
    assert [item.index for item in manifest.items] == [0, 1]
    assert worker.drain_requested("gpu0@test", since=since)
    assert worker.drained_since(since=since) == {"gpu0@test"}
    assert [n.reason for n in DrainStore(repo.engine).drained_nodes()] == ["xid 79"]
    assert worker.clear_drain(["gpu0@test"]) == 1
    assert DrainStore(repo.engine).drained_nodes() == []
