"""Fair share, quotas, big jobs and pending reasons through the real scheduler, Redis and store."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

import redis
from sqlalchemy import text

from e31.api.services import Services
from e31.api.services.jobs import JobService
from e31.core.clock import utcnow
from e31.core.records import Outcome
from e31.core.sizeclasses import route
from e31.core.spec import JobSpec
from e31.core.states import AttemptReason
from e31.edge.artifacts import ArtifactStore
from e31.edge.settings import Settings
from e31.store import Repo
from tests.integration.test_scheduler import a_scheduler_leads, heartbeat, make, published
from tests.integration.test_store import publish

GPU24, X4 = "e31.gpu24", "e31.gpu24.x4"


def backlog(repo: Repo, tenant_id: str, n: int, **fields: object) -> list[str]:
    """`n` queued jobs of one tenant, stored in one transaction (as an array)."""
    spec = JobSpec.parse({"entrypoint": "pkg.mod:main", **fields})
    where = route(spec, Settings().size_classes)
    record = repo.insert_array(tenant_id, "backlog", [(spec, where)] * n, now=utcnow())
    return [item.id for item in record.items or []]


def one(repo: Repo, tenant_id: str, *, now: datetime | None = None, **fields: object) -> str:
    spec = JobSpec.parse({"entrypoint": "pkg.mod:main", **fields})
    return repo.insert_job(tenant_id, spec, route(spec, Settings().size_classes),
                           now=now or utcnow()).id


def idle_workers(r: redis.Redis, n: int, queue: str = GPU24) -> None:
    for i in range(n):
        heartbeat(r, f"gpu{i}@n", [queue])


def owners(repo: Repo, job_ids: list[str]) -> dict[str, int]:
    """How many of `job_ids` belong to each tenant (by name)."""
    counts: dict[str, int] = {}
    for job_id in job_ids:
        name = repo.get_job(None, job_id).tenant
        counts[name] = counts.get(name, 0) + 1
    return counts


def service(repo: Repo, redis_client: redis.Redis, tmp_path: Path) -> JobService:
    return Services(settings=Settings(), repo=repo, artifacts=ArtifactStore(f"file://{tmp_path}"),
                    redis_client=redis_client).jobs


def test_weights_two_to_one_split_the_idle_slots_two_to_one(
        repo: Repo, redis_url: str, redis_client: redis.Redis) -> None:
    # Given tenants of weight 2 and 1 with plenty queued, and six idle workers
    a, _ = repo.create_tenant("a", weight=2, now=utcnow())
    b, _ = repo.create_tenant("b", weight=1, now=utcnow())
    backlog(repo, b.id, 20)
    backlog(repo, a.id, 20)
    idle_workers(redis_client, 6)

    # When the scheduler ticks
    assert make(repo, redis_url, dispatch_headroom=0).tick() == 6

    # Then a gets four slots and b two
    assert owners(repo, published(redis_client, GPU24)) == {"a": 4, "b": 2}


def test_a_quota_holds_with_three_thousand_jobs_queued_and_the_rest_goes_to_others(
        repo: Repo, redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given a tenant with a gpu24 quota of 2 and 3,000 jobs queued, another with 3 jobs
    a, _ = repo.create_tenant("a", quotas={"gpu24": 2}, now=utcnow())
    b, _ = repo.create_tenant("b", now=utcnow())
    flood = backlog(repo, a.id, 3000)
    backlog(repo, b.id, 3)
    idle_workers(redis_client, 8)
    scheduler = make(repo, redis_url, dispatch_headroom=0)

    # When the scheduler ticks twice
    scheduler.tick()
    scheduler.tick()
    a_scheduler_leads(redis_client)

    # Then a has exactly 2 published, b all of its 3, and a's next job says why it waits
    assert owners(repo, published(redis_client, GPU24)) == {"a": 2, "b": 3}
    # (the flood shares one submission time, so which two went first is the id order)
    waiting = next(j for j in flood if j not in set(published(redis_client, GPU24)))
    pending = service(repo, redis_client, tmp_path).get(a, waiting).pending
    assert pending is not None and pending["reason"] == "quota"
    assert pending["text"] == "tenant quota for gpu24 reached"


def test_a_lone_tenant_gets_every_slot_whatever_its_usage(
        repo: Repo, redis_url: str, redis_client: redis.Redis) -> None:
    # Given one tenant that used a lot recently and has 100 jobs queued, and 12 idle workers
    a, _ = repo.create_tenant("a", now=utcnow())
    with repo.engine.begin() as conn:
        conn.execute(text("UPDATE tenants SET usage_gpu_s = 1e9"))
    backlog(repo, a.id, 100)
    idle_workers(redis_client, 12)

    # When the scheduler ticks, then every idle worker gets a job
    assert make(repo, redis_url, dispatch_headroom=0).tick() == 12


def test_a_tenant_under_its_share_goes_before_another_tenants_five_thousand_job_backlog(
        repo: Repo, redis_url: str, redis_client: redis.Redis) -> None:
    # Given tenant big with 5,000 older jobs queued and two of its jobs running
    big, _ = repo.create_tenant("big", now=utcnow())
    small, _ = repo.create_tenant("small", now=utcnow())
    flood = backlog(repo, big.id, 5000)
    for i, job_id in enumerate(flood[:2]):
        repo.claim(job_id, dispatch_token=publish(repo, job_id), worker=f"gpu{i}@n",
                   gpus=str(i), gpu_count=1, now=utcnow(), lease_ttl_s=600)
        heartbeat(redis_client, f"gpu{i}@n", [GPU24], busy_job=job_id)
    # And tenant small submits one job after them, when one worker is idle
    mine = one(repo, small.id)
    heartbeat(redis_client, "gpu2@n", [GPU24])

    # When the scheduler ticks, then small's job takes the idle worker
    assert make(repo, redis_url, dispatch_headroom=0).tick() == 1
    assert published(redis_client, GPU24) == [mine]


def test_a_big_job_reserves_its_gpus_after_reserve_after_s_and_only_short_work_backfills(
        repo: Repo, redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given a host whose four GPUs serve one-GPU workers and a --group 4 worker (shared layout)
    a, _ = repo.create_tenant("a", now=utcnow())
    t0 = utcnow()
    running = one(repo, a.id, timeout_s=700, now=t0 - timedelta(seconds=1))
    first = repo.claim(running, dispatch_token=publish(repo, running), worker="gpu0@h", gpus="0",
                       gpu_count=1, now=t0, lease_ttl_s=3600)
    big = one(repo, a.id, resources={"gpus": 4}, timeout_s=3600, now=t0)
    long_small = [one(repo, a.id, timeout_s=3600, now=t0 + timedelta(seconds=1)) for _ in range(5)]
    short = one(repo, a.id, timeout_s=30, now=t0 + timedelta(seconds=2))
    heartbeat(redis_client, "gpu0@h", [GPU24], busy_job=running)
    for i in (1, 2, 3):
        heartbeat(redis_client, f"gpu{i}@h", [GPU24])
    heartbeat(redis_client, "gpu0-1-2-3@h", [X4])
    scheduler = make(repo, redis_url, dispatch_headroom=0, reserve_after_s=600)

    # When the big job has waited past reserve_after_s and the scheduler ticks
    late = t0 + timedelta(seconds=601)
    scheduler.tick(late)
    a_scheduler_leads(redis_client)

    # Then the GPUs are held for it until the running job's timeout (t0+700 s): only the job
    # that ends before then is backfilled, the long ones wait with a reason naming the big job
    assert published(redis_client, GPU24) == [short]
    svc = service(repo, redis_client, tmp_path)
    pending = svc.get(a, long_small[0]).pending
    assert pending is not None and pending["reason"] == "reserved_for"
    assert pending["detail"] == big

    # When the short job runs and the first job ends, the long ones still cannot take the GPUs
    backfilled = repo.claim(short, dispatch_token=publish(repo, short), worker="gpu1@h",
                            gpus="1", gpu_count=1, now=late, lease_ttl_s=3600)
    heartbeat(redis_client, "gpu1@h", [GPU24], busy_job=short)
    assert first is not None and backfilled is not None
    _finish(repo, running, first.token, at=t0 + timedelta(seconds=640))
    heartbeat(redis_client, "gpu0@h", [GPU24])
    assert scheduler.tick(t0 + timedelta(seconds=641)) == 0

    # And once the backfilled job ends too, the big job goes to the group worker
    _finish(repo, short, backfilled.token, at=t0 + timedelta(seconds=650))
    heartbeat(redis_client, "gpu1@h", [GPU24])
    assert scheduler.tick(t0 + timedelta(seconds=651)) == 1
    assert published(redis_client, X4) == [big]


def test_a_queued_job_shows_its_reason_position_and_estimated_start(
        repo: Repo, redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given one worker and three jobs of one tenant, one of which started a minute ago
    a, _ = repo.create_tenant("a", now=utcnow())
    ids = [one(repo, a.id) for _ in range(4)]
    repo.claim(ids[0], dispatch_token=publish(repo, ids[0]), worker="gpu1@n", gpus="1",
               gpu_count=1, now=utcnow(), lease_ttl_s=600)
    heartbeat(redis_client, "gpu1@n", [GPU24], busy_job=ids[0])
    heartbeat(redis_client, "gpu0@n", [GPU24])
    make(repo, redis_url, dispatch_headroom=0).tick()
    a_scheduler_leads(redis_client)

    # When the owner looks at its last job
    svc = service(repo, redis_client, tmp_path)
    assert svc.get(a, ids[1]).pending["reason"] == "published"
    pending = svc.get(a, ids[3]).pending

    # Then it waits for a free gpu24 GPU, with one job before it, and a start estimate
    assert pending is not None
    assert pending["reason"] == "no_capacity" and pending["text"] == "waiting for a free gpu24 GPU"
    assert pending["position"] == 1 and pending["estimated_start"] is not None


def _finish(repo: Repo, job_id: str, token: int, *, at: datetime) -> None:
    """The worker records success with the job's fencing token."""
    assert repo.record_outcome(job_id, token, Outcome(AttemptReason.SUCCEEDED), now=at) is not None
