"""The scheduler against real Redis and a real store: capacity, order, leadership, wake-up."""

from __future__ import annotations

import json
import threading
from datetime import timedelta

import pytest
import redis
from kombu import Connection
from kombu.exceptions import OperationalError as BrokerError
from sqlalchemy import event

from e31.core import keys
from e31.core.clock import utcnow
from e31.core.errors import SchedulingError
from e31.core.sizeclasses import route
from e31.core.spec import JobSpec
from e31.edge.celeryapp import make_celery
from e31.edge.settings import Settings
from e31.ops.heartbeat import WorkerInfo, withdraw, write
from e31.scheduling.leader import Scheduler
from e31.store import Repo


def heartbeat(r: redis.Redis, node: str, queues: list[str], busy_job: str | None = None,
              gpus: str | None = None) -> None:
    """A worker's heartbeat. Its GPUs default to the indexes in its node name (gpu1@n: 1;
    gpu0-1-2-3@n: 0,1,2,3), as the launcher names them: workers of one host that name the
    same GPU share it."""
    if gpus is None:
        gpus = node.split("@")[0].removeprefix("gpu").replace("-", ",")
    write(r, WorkerInfo(node=node, queues=tuple(queues), gpus=gpus,
                        gpu_count=len(gpus.split(",")) if gpus else 0, busy_job=busy_job),
          interval_s=10)  # alive for three beats: 30 s, longer than any test


def published(r: redis.Redis, queue: str) -> list[str]:
    """Job ids waiting in a Celery queue (every priority bucket): each message's arguments as
    Kombu decodes them for a worker, not Celery's display-only `argsrepr` header."""
    ids = []
    with Connection("memory://") as decoder:  # Kombu's message codec, the Redis one's: no I/O
        channel = decoder.default_channel
        for key in r.scan_iter(match=f"{queue}*"):
            if r.type(key) != b"list":
                continue
            for raw in r.lrange(key, 0, -1):
                args, _kwargs, _embed = channel.message_to_python(json.loads(raw)).decode()
                ids.append(args[0])
    return ids


def a_scheduler_leads(r: redis.Redis) -> None:
    """Hold the leader's lock, as a running scheduler does (for a minute): the API's pending
    reasons say `no_scheduler` while nothing holds it."""
    r.set(keys.LEADER, "a-test-scheduler", px=60_000)


def make(repo: Repo, redis_url: str, **settings: object) -> Scheduler:
    s = Settings(redis_url=redis_url, **settings)
    return Scheduler(settings=s, repo=repo, redis_client=redis.Redis.from_url(redis_url),
                     celery=make_celery(s))


def submit(repo: Repo, tenant_id: str, **fields: object) -> str:
    spec = JobSpec.parse({"entrypoint": "pkg.mod:main", **fields})
    return repo.insert_job(tenant_id, spec, route(spec, Settings().size_classes), now=utcnow()).id


def test_the_scheduler_publishes_no_more_than_idle_slots_plus_headroom(
        repo: Repo, redis_url: str, redis_client: redis.Redis) -> None:
    tenant, _ = repo.create_tenant("a", now=utcnow())
    ids = [submit(repo, tenant.id) for _ in range(6)]
    heartbeat(redis_client, "gpu0@n", ["e31.gpu24"])
    heartbeat(redis_client, "gpu1@n", ["e31.gpu24"])
    heartbeat(redis_client, "gpu2@n", ["e31.gpu24"], busy_job="j-other")
    scheduler = make(repo, redis_url, dispatch_headroom=1)

    assert scheduler.tick() == 3          # two idle workers + one headroom
    assert scheduler.tick() == 0          # they are outstanding until claimed
    assert sorted(published(redis_client, "e31.gpu24")) == sorted(ids[:3])


def test_higher_priority_jobs_are_published_first(repo: Repo, redis_url: str,
                                                  redis_client: redis.Redis) -> None:
    tenant, _ = repo.create_tenant("a", now=utcnow())
    submit(repo, tenant.id, priority=2)
    urgent = submit(repo, tenant.id, priority=9)
    heartbeat(redis_client, "gpu0@n", ["e31.gpu24"])

    make(repo, redis_url, dispatch_headroom=0).tick()

    assert published(redis_client, "e31.gpu24") == [urgent]


def test_a_class_without_any_worker_gets_no_messages(repo: Repo, redis_url: str,
                                                     redis_client: redis.Redis) -> None:
    tenant, _ = repo.create_tenant("a", now=utcnow())
    submit(repo, tenant.id, resources={"gpu_mem_gb": 80})
    heartbeat(redis_client, "gpu0@n", ["e31.gpu24"])

    assert make(repo, redis_url).tick() == 0
    assert [c.id for c in repo.heads({"e31.gpu80": 5}, now=utcnow())]


def test_a_big_worker_that_spills_takes_its_own_class_first(repo: Repo, redis_url: str,
                                                            redis_client: redis.Redis) -> None:
    tenant, _ = repo.create_tenant("a", now=utcnow())
    small = submit(repo, tenant.id)
    big = submit(repo, tenant.id, resources={"gpu_mem_gb": 80})
    heartbeat(redis_client, "gpu0@n", ["e31.gpu80", "e31.gpu48", "e31.gpu24"])

    make(repo, redis_url, dispatch_headroom=0).tick()

    assert published(redis_client, "e31.gpu80") == [big]
    assert small not in published(redis_client, "e31.gpu24")


def test_a_message_waiting_behind_busy_workers_is_not_published_again(
        repo: Repo, redis_url: str, redis_client: redis.Redis) -> None:
    tenant, _ = repo.create_tenant("a", now=utcnow())
    waiting = submit(repo, tenant.id)
    heartbeat(redis_client, "gpu0@n", ["e31.gpu24"], busy_job="j-other")
    scheduler = make(repo, redis_url, dispatch_headroom=1, dispatch_timeout_s=1)
    assert scheduler.tick() == 1                       # the headroom message
    later = utcnow() + timedelta(hours=1)

    assert scheduler.tick(later) == 0                  # the worker is still busy: not lost
    heartbeat(redis_client, "gpu0@n", ["e31.gpu24"])   # idle, yet the job was never claimed
    assert scheduler.tick(later) == 1                  # so its message was lost: publish again
    assert published(redis_client, "e31.gpu24") == [waiting, waiting]


def restarted(r: redis.Redis, node: str) -> None:
    """`node`'s heartbeat as its launcher's new process writes it: another pid, same name."""
    beat = json.loads(r.get(keys.worker(node)) or b"{}")
    r.set(keys.worker(node), json.dumps({**beat, "pid": beat["pid"] + 1}), px=30_000)


@pytest.mark.parametrize("how", ["node died", "worker restarted"])
def test_a_message_taken_by_a_worker_that_left_is_published_again_at_once(
        repo: Repo, redis_url: str, redis_client: redis.Redis, how: str) -> None:
    """A worker killed between taking a job's message and claiming the job takes the message
    with it. When its heartbeat ends (its node died) or a new process beats under its name
    (its launcher restarted it), the job is published again as soon as a consumer of the queue
    is idle, not after the dispatch timeout (here an hour); while no worker left, it waits."""
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job = submit(repo, tenant.id)
    heartbeat(redis_client, "gpu0@n", ["e31.gpu24"])
    heartbeat(redis_client, "gpu1@n", ["e31.gpu24"], busy_job="j-other")
    scheduler = make(repo, redis_url, dispatch_headroom=0, dispatch_timeout_s=3600)
    assert scheduler.tick() == 1
    taken = list(redis_client.scan_iter(match="e31.gpu24*"))   # every priority bucket
    assert redis_client.delete(*taken) == 1   # gpu0@n took the message, did not claim the job
    assert scheduler.tick() == 0         # nobody left: the message may be on its way

    if how == "node died":
        withdraw(redis_client, "gpu0@n")
        assert scheduler.tick() == 0     # no idle consumer: nothing taken from a queue now
        heartbeat(redis_client, "gpu1@n", ["e31.gpu24"])   # gpu1@n is idle
    else:
        restarted(redis_client, "gpu0@n")
    assert scheduler.tick() == 1
    assert published(redis_client, "e31.gpu24") == [job]
    assert scheduler.tick() == 0         # once: the departure is cleared


def test_a_second_scheduler_waits_while_the_first_leads(repo: Repo, redis_url: str,
                                                        redis_client: redis.Redis) -> None:
    first, second = make(repo, redis_url), make(repo, redis_url)
    assert first.try_lead()
    assert not second.try_lead()
    assert first.try_lead()               # the leader renews
    first.resign()
    assert second.try_lead()


def test_a_submit_wakes_the_scheduler_at_once(repo: Repo, redis_url: str,
                                              redis_client: redis.Redis, tmp_path) -> None:
    from e31.api.services import Services
    from e31.edge.artifacts import ArtifactStore
    tenant, _ = repo.create_tenant("a", now=utcnow())
    heartbeat(redis_client, "gpu0@n", ["e31.gpu24"])
    settings = Settings(redis_url=redis_url, scheduler_tick_s=60)  # a tick would take a minute
    scheduler = Scheduler(settings=settings, repo=repo, redis_client=redis_client,
                          celery=make_celery(settings))
    stop = threading.Event()
    runner = threading.Thread(target=scheduler.run, args=(stop,), daemon=True)
    runner.start()
    try:
        from tests.conftest import wait_for
        wait_for(lambda: redis_client.get(keys.LEADER), what="leadership")
        service = Services(settings=settings, repo=repo,
                           artifacts=ArtifactStore(f"file://{tmp_path}"),
                           redis_client=redis_client).jobs
        job = service.submit(tenant, JobSpec.parse({"entrypoint": "pkg.mod:main"}))
        wait_for(lambda: job.id in published(redis_client, "e31.gpu24"), timeout_s=5,
                 what="the job to be published without waiting for a tick")
    finally:
        stop.set()
        redis_client.rpush(keys.WAKE, "1")
        runner.join(timeout=10)


def test_a_publication_the_broker_refuses_is_a_scheduling_error_naming_the_job(
        repo: Repo, redis_url: str, redis_client: redis.Redis,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given an idle worker, a queued job and a broker that refuses every message
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job_id = submit(repo, tenant.id)
    heartbeat(redis_client, "gpu0@n", ["e31.gpu24"])
    settings = Settings(redis_url=redis_url, dispatch_headroom=0)
    celery = make_celery(settings)

    def refuse(*args: object, **kwargs: object) -> None:
        raise BrokerError("connection refused")

    monkeypatch.setattr(celery, "send_task", refuse)
    scheduler = Scheduler(settings=settings, repo=repo, redis_client=redis_client, celery=celery)

    # When the scheduler publishes it
    with pytest.raises(SchedulingError) as refused:
        scheduler.tick()

    # Then the error names the job and wraps the broker's (the loop logs it and ticks again)
    assert job_id in refused.value.message and "connection refused" in refused.value.message
    assert isinstance(refused.value.__cause__, BrokerError)


def test_a_tick_stores_its_publication_and_why_the_others_wait_in_one_transaction(
        repo: Repo, redis_url: str, redis_client: redis.Redis) -> None:
    # Given two queued jobs and one idle worker, and a scheduler past its recovery
    tenant, _ = repo.create_tenant("a", now=utcnow())
    first, second = submit(repo, tenant.id), submit(repo, tenant.id)
    heartbeat(redis_client, "gpu0@n", ["e31.gpu24"])
    scheduler = make(repo, redis_url, dispatch_headroom=0)
    commits: list[object] = []
    note = commits.append
    event.listen(repo.engine, "commit", note)

    # When it ticks
    try:
        assert scheduler.tick(recover=False) == 1
    finally:
        event.remove(repo.engine, "commit", note)

    # Then the first is published, the second says why it waits, and both were written by
    # one transaction (the reads of the view and the heads are the other two)
    assert published(redis_client, "e31.gpu24") == [first]
    waiting = repo.get_job(tenant.id, second)
    assert waiting.state == "queued"
    assert repo.queue_position(tenant.id, second).stored_reason == "no_capacity"
    assert len(commits) == 3, commits
