"""Recovery on a real store and real Redis: expired leases, the poison cap, lost messages."""

from __future__ import annotations

from datetime import timedelta

import pytest
import redis

from e31.core import keys
from e31.core.clock import utcnow
from e31.core.records import Outcome
from e31.core.states import AttemptReason, JobState
from e31.ops.heartbeat import beat_launcher
from e31.store import Repo
from tests.integration.test_scheduler import heartbeat, make, published
from tests.integration.test_store import claim, publish, submit

TTL_S = 10


def test_a_job_whose_lease_expired_is_queued_again_as_lost_and_billed_to_its_last_renewal(
        repo: Repo) -> None:
    # Given a running job whose worker renewed its lease at t0+4 s and then went silent
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job = submit(repo, tenant.id, retries={"max": 0})
    t0 = utcnow()
    c1 = claim(repo, job.id, now=t0)
    assert repo.renew(job.id, c1.token, now=t0 + timedelta(seconds=4), lease_ttl_s=TTL_S)[0]

    # When the reconciler looks before and after the lease ran out
    assert repo.expire_leases(now=t0 + timedelta(seconds=13), lease_ttl_s=TTL_S) == []
    recovered = repo.expire_leases(now=t0 + timedelta(seconds=15), lease_ttl_s=TTL_S)

    # Then it is queued again at once, the attempt is `lost`, billed until the last renewal
    assert recovered == [(job.id, JobState.QUEUED)]
    record = repo.get_job(tenant.id, job.id)
    assert record.state == "queued" and record.reason == "lost"
    [attempt] = record.attempts
    assert attempt.reason == "lost" and "gpu0@test" in (attempt.error or "")
    assert record.gpu_seconds == pytest.approx(4)
    # And the old worker's late write is refused by the fence, while a new claim works
    assert repo.record_outcome(job.id, c1.token, Outcome(AttemptReason.SUCCEEDED, result=1),
                               now=t0 + timedelta(seconds=16)) is None
    c2 = claim(repo, job.id, worker="gpu1@test", now=t0 + timedelta(seconds=16))
    assert c2 is not None and c2.attempt == 2


def test_lost_attempts_do_not_use_retries_but_a_poison_job_fails_at_max_lost(repo: Repo) -> None:
    # Given a job without retries that kills every worker it lands on
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job = submit(repo, tenant.id, retries={"max": 0, "max_lost": 3})
    t = utcnow()
    states = []
    # When three of its attempts are lost in a row
    for n in range(3):
        claim(repo, job.id, worker=f"gpu{n}@test", now=t)
        t += timedelta(seconds=TTL_S + 1)
        states += [state for _, state in repo.expire_leases(now=t, lease_ttl_s=TTL_S)]

    # Then the first two are requeued (retries.max=0 is untouched) and the third fails it
    assert states == [JobState.QUEUED, JobState.QUEUED, JobState.FAILED]
    record = repo.get_job(tenant.id, job.id)
    assert record.state == "failed" and record.reason == "lost"
    assert "poison job" in (record.error or "") and "retries.max_lost=3" in (record.error or "")
    assert [a.reason for a in record.attempts] == ["lost", "lost", "lost"]


def test_an_expired_lease_of_a_job_being_cancelled_ends_it_cancelled(repo: Repo) -> None:
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job = submit(repo, tenant.id)
    t0 = utcnow()
    claim(repo, job.id, now=t0)
    repo.request_cancel(tenant.id, job.id, now=t0)

    assert repo.expire_leases(now=t0 + timedelta(seconds=TTL_S + 1), lease_ttl_s=TTL_S) == \
        [(job.id, JobState.CANCELLED)]


def test_an_oom_attempt_counts_against_retries(repo: Repo) -> None:
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job = submit(repo, tenant.id, retries={"max": 1, "backoff_s": 0})
    c1 = claim(repo, job.id)
    assert repo.record_outcome(job.id, c1.token, Outcome(AttemptReason.OOM, error="CUDA OOM"),
                               now=utcnow()) is JobState.QUEUED
    c2 = claim(repo, job.id)
    assert repo.record_outcome(job.id, c2.token, Outcome(AttemptReason.OOM, error="CUDA OOM"),
                               now=utcnow()) is JobState.FAILED
    assert repo.get_job(tenant.id, job.id).reason == "oom"


def test_a_released_dispatch_is_published_again_on_the_next_tick(
        repo: Repo, redis_url: str, redis_client: redis.Redis) -> None:
    # Given a published job whose message a draining worker received and handed back
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job = submit(repo, tenant.id)
    heartbeat(redis_client, "gpu0@n", ["e31.gpu24"])
    scheduler = make(repo, redis_url, dispatch_headroom=0)
    assert scheduler.tick() == 1
    redis_client.delete(*redis_client.keys("e31.gpu24*"))  # the worker took the message

    # When it releases the dispatch
    assert repo.release_dispatch(job.id, publish(repo, job.id)) is True

    # Then the next tick publishes the job again, without waiting for the dispatch timeout
    assert scheduler.tick() == 1
    assert published(redis_client, "e31.gpu24") == [job.id]


def test_the_scheduler_recovers_an_expired_lease_on_its_tick(
        repo: Repo, redis_url: str, redis_client: redis.Redis) -> None:
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job = submit(repo, tenant.id)
    t0 = utcnow() - timedelta(seconds=60)
    claim(repo, job.id, worker="gpu9@dead", now=t0)
    heartbeat(redis_client, "gpu0@n", ["e31.gpu24"])

    sent = make(repo, redis_url, dispatch_headroom=0, lease_ttl_s=TTL_S).tick()

    assert sent == 1
    assert published(redis_client, "e31.gpu24") == [job.id]
    assert [a.reason for a in repo.get_job(tenant.id, job.id).attempts] == ["lost"]


def test_after_a_store_outage_the_scheduler_waits_one_ttl_before_judging_leases(
        repo: Repo, redis_url: str, redis_client: redis.Redis) -> None:
    # Given a lease that expired while the store was unreachable for everyone
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job = submit(repo, tenant.id)
    claim(repo, job.id, now=utcnow() - timedelta(seconds=TTL_S + 1))
    scheduler = make(repo, redis_url, lease_ttl_s=TTL_S)

    # When the scheduler comes back from the outage
    scheduler.hold_lease_expiry()
    scheduler.tick()

    # Then the job keeps running: its worker gets a TTL to renew first
    assert repo.get_job(tenant.id, job.id).state == "running"


def test_a_flushed_redis_makes_the_scheduler_publish_every_outstanding_job_again(
        repo: Repo, redis_url: str, redis_client: redis.Redis) -> None:
    # Given two published, unclaimed jobs (the queue has an idle worker)
    tenant, _ = repo.create_tenant("a", now=utcnow())
    ids = sorted(submit(repo, tenant.id).id for _ in range(2))
    heartbeat(redis_client, "gpu0@n", ["e31.gpu24"])
    scheduler = make(repo, redis_url, dispatch_headroom=1, dispatch_timeout_s=3600)
    assert scheduler.tick() == 2
    assert scheduler.tick() == 0

    # When Redis loses everything (FLUSHALL, or a restart without persistence)
    redis_client.flushdb()
    heartbeat(redis_client, "gpu0@n", ["e31.gpu24"])

    # Then the next tick notices and publishes both again, long before the dispatch timeout
    assert scheduler.tick() == 2
    assert sorted(published(redis_client, "e31.gpu24")) == ids
    assert redis_client.exists(keys.BROKER_EPOCH)


# -- a dead node noticed in seconds (docs/reliability.md) -------------------------------------

SILENT_S = 3   # SILENT_BEATS (1.5) heartbeat intervals of the default 2 s (over SILENT_MIN_S)


def _running_on(repo: Repo, worker: str, renewed_s_ago: float) -> tuple[str, str, str]:
    """(tenant id, job id, lease token) of a job running on `worker`, last renewed then."""
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job = submit(repo, tenant.id, retries={"max": 0})
    c = claim(repo, job.id, worker=worker, now=utcnow() - timedelta(seconds=renewed_s_ago))
    assert c is not None
    return tenant.id, job.id, c.token


def test_a_job_whose_worker_went_silent_is_lost_at_once_not_at_its_lease_expiry(
        repo: Repo, redis_url: str, redis_client: redis.Redis) -> None:
    # Given a job whose node died 4 s ago: no heartbeat, no renewal, its lease good for 6 s
    tenant_id, job_id, token = _running_on(repo, "gpu9@dead", renewed_s_ago=SILENT_S + 1)
    heartbeat(redis_client, "gpu0@n", ["e31.gpu24"])
    redis_client.set(keys.BROKER_EPOCH, "then")   # Redis has kept its data since then
    scheduler = make(repo, redis_url, dispatch_headroom=0, lease_ttl_s=TTL_S)

    # When the scheduler ticks
    sent = scheduler.tick()

    # Then the attempt is lost now, the job published again, and the old worker fenced off
    assert sent == 1 and published(redis_client, "e31.gpu24") == [job_id]
    record = repo.get_job(tenant_id, job_id)
    [attempt] = record.attempts
    assert attempt.reason == "lost" and "went silent" in (attempt.error or "")
    assert repo.record_outcome(job_id, token, Outcome(AttemptReason.SUCCEEDED, result=1),
                               now=utcnow()) is None
    assert not repo.renew(job_id, token, now=utcnow(), lease_ttl_s=TTL_S)[0]


def test_a_worker_that_still_beats_keeps_its_job_though_its_renewals_are_late(
        repo: Repo, redis_url: str, redis_client: redis.Redis) -> None:
    # Given a job whose worker's store calls are slow (no renewal for 4 s) but beats
    tenant_id, job_id, _ = _running_on(repo, "gpu0@slow", renewed_s_ago=SILENT_S + 1)
    heartbeat(redis_client, "gpu0@slow", ["e31.gpu24"], busy_job=job_id)

    # When the scheduler looks for silent workers
    ended = make(repo, redis_url, lease_ttl_s=TTL_S).expire_silent(utcnow())

    # Then the job runs on
    assert ended == 0 and repo.get_job(tenant_id, job_id).state == "running"


def test_a_job_whose_worker_process_was_restarted_under_its_name_is_lost_at_once(
        repo: Repo, redis_url: str, redis_client: redis.Redis) -> None:
    # Given a job whose worker process was SIGKILLed 4 s ago and restarted by its launcher:
    # the new process beats under the same name, holding no job
    tenant_id, job_id, _ = _running_on(repo, "gpu0@restarted", renewed_s_ago=SILENT_S + 1)
    heartbeat(redis_client, "gpu0@restarted", ["e31.gpu24"])
    redis_client.set(keys.BROKER_EPOCH, "then")

    # When the scheduler looks for silent workers
    ended = make(repo, redis_url, lease_ttl_s=TTL_S).expire_silent(utcnow())

    # Then the attempt its predecessor left is lost now
    assert ended == 1 and repo.get_job(tenant_id, job_id).state == "queued"
    assert [a.reason for a in repo.get_job(tenant_id, job_id).attempts] == ["lost"]


def test_a_silent_worker_whose_launcher_beats_keeps_its_job_to_its_lease(
        repo: Repo, redis_url: str, redis_client: redis.Redis) -> None:
    # Given a job whose worker process went silent 4 s ago (frozen, or being restarted) on a
    # node whose launcher still beats
    tenant_id, job_id, _ = _running_on(repo, "gpu0@restarting", renewed_s_ago=SILENT_S + 1)
    beat_launcher(redis_client, ["gpu0@restarting"], interval_s=10)
    redis_client.set(keys.BROKER_EPOCH, "then")

    # When the scheduler looks for silent workers
    ended = make(repo, redis_url, lease_ttl_s=TTL_S).expire_silent(utcnow())

    # Then the job is left to its lease: the new process says whether it still holds it
    assert ended == 0 and repo.get_job(tenant_id, job_id).state == "running"


def test_a_job_whose_worker_renews_keeps_running_when_redis_lost_every_heartbeat(
        repo: Repo, redis_url: str, redis_client: redis.Redis) -> None:
    # Given a job renewed 1 s ago whose worker's heartbeat is gone (Redis flushed)
    tenant_id, job_id, _ = _running_on(repo, "gpu0@live", renewed_s_ago=1)
    redis_client.flushdb()

    # When the scheduler ticks
    make(repo, redis_url, lease_ttl_s=TTL_S).tick()

    # Then the job runs on: the lease, renewed, says its worker lives
    assert repo.get_job(tenant_id, job_id).state == "running"


def test_after_redis_lost_its_data_silence_is_not_judged_for_a_ttl(
        repo: Repo, redis_url: str, redis_client: redis.Redis) -> None:
    # Given a scheduler that has led a while, and a job renewed 4 s ago
    scheduler = make(repo, redis_url, lease_ttl_s=TTL_S)
    scheduler.tick()
    tenant_id, job_id, _ = _running_on(repo, "gpu0@live", renewed_s_ago=SILENT_S + 1)

    # When Redis restarts empty (every heartbeat gone at once) and the scheduler ticks
    redis_client.flushdb()
    scheduler.tick()

    # Then the job is left to its lease: its worker may only be waiting to beat again
    assert repo.get_job(tenant_id, job_id).state == "running"
    assert scheduler.expire_silent(utcnow()) == 0


def test_a_renewal_that_comes_in_before_the_lock_keeps_its_job(repo: Repo) -> None:
    # Given a job judged silent on a stale read, whose worker renews just after
    tenant_id, job_id, token = _running_on(repo, "gpu0@late", renewed_s_ago=SILENT_S + 1)
    now = utcnow()
    assert repo.overdue_leases(now=now, lease_ttl_s=TTL_S, silent_s=SILENT_S) == \
        [(job_id, "gpu0@late")]
    assert repo.renew(job_id, token, now=now, lease_ttl_s=TTL_S)[0]

    # When the store is asked to end it
    ended = repo.expire_silent([job_id], now=now, lease_ttl_s=TTL_S, silent_s=SILENT_S)

    # Then the row, checked again under its lock, keeps running
    assert ended == [] and repo.get_job(tenant_id, job_id).state == "running"
