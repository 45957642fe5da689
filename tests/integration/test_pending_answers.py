"""What a waiting job's status says, when the honest answer is not "waiting for a free GPU":
no worker of its class at all, a quota of 0, a broker that cannot be read, and how long it has
waited so far (issue 17, "Misleading answers"). Real scheduler, Redis and store."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import redis

from e31.api.services import Services
from e31.core.clock import utcnow
from e31.edge.artifacts import ArtifactStore
from e31.edge.settings import Settings
from e31.local.redisserver import free_port
from e31.store import Repo
from tests.integration.test_fair_scheduling import one
from tests.integration.test_scheduler import a_scheduler_leads, heartbeat, make
from tests.integration.test_store import publish

GPU24 = "e31.gpu24"


def service(repo: Repo, redis_client: redis.Redis, tmp_path: Path) -> Services:
    return Services(settings=Settings(), repo=repo, artifacts=ArtifactStore(f"file://{tmp_path}"),
                    redis_client=redis_client)


def test_a_class_without_any_worker_says_so_and_gives_no_estimate(
        repo: Repo, redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given a pool of gpu24 workers only, one of them busy with a job that started just now
    a, _ = repo.create_tenant("a", now=utcnow())
    small = one(repo, a.id)
    repo.claim(small, dispatch_token=publish(repo, small), worker="gpu0@n", gpus="0",
               gpu_count=1, now=utcnow(), lease_ttl_s=600)
    heartbeat(redis_client, "gpu0@n", [GPU24], busy_job=small)
    heartbeat(redis_client, "gpu1@n", [GPU24])
    # and a job that needs a gpu80 GPU
    big = one(repo, a.id, resources={"gpu_mem_gb": 70})
    make(repo, redis_url, dispatch_headroom=0).tick()
    a_scheduler_leads(redis_client)

    # When its owner asks why it waits
    pending = service(repo, redis_client, tmp_path).jobs.get(a, big).pending

    # Then it hears that no worker serves gpu80 at all, not that it waits for a free GPU
    assert pending is not None
    assert pending["reason"] == "no_workers"
    assert pending["detail"] == "e31.gpu80"
    assert "no worker" in pending["text"] and "gpu80" in pending["text"]
    assert pending["estimated_start"] is None
    assert "no worker" in pending["no_estimate"]

    # And once a gpu80 worker beats, the same job waits for it like any other
    heartbeat(redis_client, "gpu2@n", ["e31.gpu80", GPU24], busy_job="j-" + "0" * 20)
    again = service(repo, redis_client, tmp_path).jobs.get(a, big).pending
    assert again is not None and again["reason"] == "no_capacity"


def test_a_quota_of_zero_gives_no_estimated_start_and_says_why(
        repo: Repo, redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given a busy queue (another tenant's job started just now) and an idle worker
    a, _ = repo.create_tenant("a", quotas={"gpu24": 0}, now=utcnow())
    b, _ = repo.create_tenant("b", now=utcnow())
    other = one(repo, b.id)
    repo.claim(other, dispatch_token=publish(repo, other), worker="gpu0@n", gpus="0",
               gpu_count=1, now=utcnow(), lease_ttl_s=600)
    heartbeat(redis_client, "gpu0@n", [GPU24], busy_job=other)
    heartbeat(redis_client, "gpu1@n", [GPU24])
    # and a job of a tenant whose gpu24 quota is 0
    held = one(repo, a.id)
    assert make(repo, redis_url, dispatch_headroom=0).tick() == 0
    a_scheduler_leads(redis_client)

    # When its owner asks when it starts
    pending = service(repo, redis_client, tmp_path).jobs.get(a, held).pending

    # Then it is held by the quota, with no estimate: only an admin raising the quota starts it
    assert pending is not None and pending["reason"] == "quota"
    assert pending["estimated_start"] is None
    assert "0 GPUs" in pending["text"] and "admin" in pending["text"]
    assert "quota" in pending["no_estimate"]

    # And a quota that only the running jobs fill keeps its estimate
    repo.update_tenant("a", quotas={"gpu24": 1})
    again = service(repo, redis_client, tmp_path).jobs.get(a, held).pending
    assert again is not None and again["estimated_start"] is not None


def test_a_job_waiting_while_no_scheduler_runs_says_so_not_that_it_waits_for_a_gpu(
        repo: Repo, redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given an idle gpu24 worker, a job it could run, and no scheduler (none holds the lock)
    a, _ = repo.create_tenant("a", now=utcnow())
    job = one(repo, a.id)
    heartbeat(redis_client, "gpu0@n", [GPU24])

    # When its owner asks why it waits (issue 32: it said no_capacity)
    pending = service(repo, redis_client, tmp_path).jobs.get(a, job).pending

    # Then it hears that no scheduler runs, with no estimate: one must be started
    assert pending is not None and pending["reason"] == "no_scheduler"
    assert pending["detail"] == GPU24
    assert "no scheduler is running" in pending["text"]
    assert pending["estimated_start"] is None and "scheduler" in pending["no_estimate"]

    # And once a scheduler takes the lead, the same job waits like any other
    assert make(repo, redis_url).try_lead()
    again = service(repo, redis_client, tmp_path).jobs.get(a, job).pending
    assert again is not None and again["reason"] == "no_capacity"


def test_while_redis_is_down_a_waiting_job_and_the_queue_say_the_broker_is_unreachable(
        repo: Repo, redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given an idle worker and a job that waits (its stored reason says no capacity)
    a, _ = repo.create_tenant("a", now=utcnow())
    job = one(repo, a.id)
    heartbeat(redis_client, "gpu0@n", [GPU24])
    up = service(repo, redis_client, tmp_path)
    assert up.queue.overview(a)["broker"] == "ok"
    assert up.queue.overview(a)["classes"][0]["gpus"] == 1

    # When the API's Redis cannot be reached (a port nobody listens on)
    down_client = redis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0",
                                       socket_connect_timeout=1)
    down = service(repo, down_client, tmp_path)
    pending = down.jobs.get(a, job).pending
    view = down.queue.overview(a)

    # Then the job's reason is the broker, not capacity, and the queue says it could not read
    # the pool rather than showing zero GPUs as if it had
    assert pending is not None and pending["reason"] == "broker_unreachable"
    assert "unreachable" in pending["text"] and pending["estimated_start"] is None
    assert view["broker"] == "unreachable"


def test_a_queued_jobs_queued_seconds_grows_while_it_waits_and_stays_once_claimed(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given a job queued a minute ago
    a, _ = repo.create_tenant("a", now=utcnow())
    job = one(repo, a.id, now=utcnow() - timedelta(seconds=60))

    # When its status is read while it waits
    waiting = repo.get_job(a.id, job).to_status()["queued_seconds"]

    # Then it counts the minute so far, not 0.0
    assert 59 <= waiting < 120

    # And the claim stores what it waited; reading it later adds nothing more
    repo.claim(job, dispatch_token=publish(repo, job), worker="gpu0@n", gpus="0",
               gpu_count=1, now=utcnow(), lease_ttl_s=600)
    claimed = repo.get_job(a.id, job).to_status()["queued_seconds"]
    assert 59 <= claimed < 120
    assert repo.get_job(a.id, job).to_status()["queued_seconds"] == claimed
