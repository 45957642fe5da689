"""The API's /metrics and /v1/top over a real store and Redis: the series move as jobs are
submitted, run, fail, time out and are lost; the backlog gauge is the store's count; no label
holds a job id; the endpoint's guard refuses a scrape without its token."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from e31.api import create_app
from e31.api.services import Services
from e31.core import keys, metrics
from e31.core.clock import utcnow
from e31.core.records import Outcome
from e31.core.sizeclasses import route
from e31.core.spec import JobSpec
from e31.core.states import AttemptReason
from e31.edge.artifacts import ArtifactStore
from e31.edge.celeryapp import make_celery
from e31.edge.settings import Settings
from e31.ops import heartbeat
from e31.ops.heartbeat import GpuSample, WorkerInfo
from e31.ops.scrape import PoolCollector, registry, render
from e31.scheduling.leader import Scheduler
from e31.store import Repo
from e31.store.models import Job
from e31_worker.attempt import task
from tests.conftest import wait_for
from tests.integration.test_api_limits import serving
from tests.integration.test_store import publish
from tests.integration.test_task import services

TOKEN = "metrics-secret"
BOUNDED_LABELS = {"class", "tenant", "state", "reason", "node", "gpu", "process", "le"}
JOB_ID = re.compile(r"\b[ja]-[0-9a-f]{12,}\b")
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture
def api(repo: Repo, redis_url: str, redis_client: redis.Redis,
        tmp_path: Path) -> Iterator[tuple[TestClient, Repo]]:
    settings = Settings(redis_url=redis_url, home=tmp_path, metrics_token=TOKEN)
    (tmp_path / "artifacts").mkdir()
    service = Services(settings=settings, repo=repo,
                      artifacts=ArtifactStore(f"file://{tmp_path / 'artifacts'}"),
                      redis_client=redis_client)
    with TestClient(create_app(settings, services=service)) as client:
        yield client, repo


def scrape(client: TestClient) -> Samples:
    """Every sample of one authorised scrape, parsed by Prometheus's own parser; also checks
    that no label is unbounded."""
    response = client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            assert set(s.labels) <= BOUNDED_LABELS, s
            assert not any(JOB_ID.search(v) for v in s.labels.values()), s
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum over every series of `name` that has these labels (others free)."""
    return sum(v for (n, ls), v in samples.items()
               if n == name and all((k, want) in ls for k, want in labels.items()))


def submit(repo: Repo, tenant_id: str, **fields: Any) -> str:
    spec = JobSpec.parse({"resources": {"gpus": 0}, **fields})
    return repo.insert_job(tenant_id, spec, route(spec, Settings().size_classes), now=utcnow()).id


def test_the_metrics_move_as_jobs_are_submitted_run_fail_time_out_and_are_lost(
        api: tuple[TestClient, Repo], redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given a tenant's four cpu jobs: one succeeds, one fails, one times out, one is lost
    client, repo = api
    tenant, _ = repo.create_tenant("team-a", now=utcnow())
    ok = submit(repo, tenant.id, command=["true"])
    bad = submit(repo, tenant.id, command=["sh", "-c", "exit 3"])
    slow = submit(repo, tenant.id, command=["sleep", "30"], timeout_s=1)
    gone = submit(repo, tenant.id, command=["true"])
    before = scrape(client)
    assert value(before, "e31_jobs", state="queued", **{"class": "cpu"}, tenant="team-a") == 4
    assert value(before, "e31_jobs", state="running", **{"class": "cpu"}, tenant="team-a") == 0
    assert value(before, "e31_oldest_queued_age_seconds", **{"class": "cpu"}) >= 0
    assert total(before, "e31_attempts_ended_total") == 0

    # When three run on a real worker harness, and the fourth's worker vanishes with its lease
    svc = services(repo, redis_client, tmp_path, ArtifactStore(f"file://{tmp_path / 'a'}"))
    for job_id in (ok, bad, slow):
        task.run_job(svc, job_id, publish(repo, job_id))
    claim = repo.claim(gone, dispatch_token=publish(repo, gone), worker="cpu9@vanished", gpus="",
                       gpu_count=0, now=utcnow(), lease_ttl_s=60)
    assert claim is not None
    held = scrape(client)

    # Then the ends are counted by reason, and the vanished node is a lost worker
    cpu = {"class": "cpu"}
    assert value(held, "e31_attempts_ended_total", **cpu, reason="succeeded") == 1
    assert value(held, "e31_attempts_ended_total", **cpu, reason="error") == 1
    assert value(held, "e31_attempts_ended_total", **cpu, reason="timeout") == 1
    assert value(held, "e31_jobs_ended_total", state="succeeded", **cpu, tenant="team-a") == 1
    assert value(held, "e31_jobs_ended_total", state="failed", **cpu, tenant="team-a") == 2
    assert value(held, "e31_jobs", state="running", **cpu, tenant="team-a") == 1
    assert value(held, "e31_jobs", state="queued", **cpu, tenant="team-a") == 0
    assert value(held, "e31_workers", **cpu, state="lost") == 1
    assert value(held, "e31_queue_wait_seconds_bucket", **cpu, le="+Inf") == 4
    assert value(held, "e31_run_seconds_bucket", **cpu, le="+Inf") == 3
    assert value(held, "e31_run_seconds_bucket", **cpu, le="10.0") == 3   # none ran 10 s
    assert value(held, "e31_lease_expiries_total", **cpu) == 0
    assert value(held, "e31_jobs_idle", **cpu) == 0

    # When the watchdog flags the running job idle
    assert repo.mark_idle(gone, 1, utcnow())

    # Then it is counted as idle
    assert value(scrape(client), "e31_jobs_idle", **cpu) == 1

    # When the scheduler recovers the lost job
    recovered = repo.expire_leases(now=utcnow() + timedelta(seconds=120), lease_ttl_s=60)
    assert [job_id for job_id, _ in recovered] == [gone]
    after = scrape(client)

    # Then its attempt counts as a lease expiry and the node is no longer held
    assert value(after, "e31_lease_expiries_total", **cpu) == 1
    assert value(after, "e31_attempts_ended_total", **cpu, reason="lost") == 1
    assert value(after, "e31_workers", **cpu, state="lost") == 0
    assert value(after, "e31_jobs", state="queued", **cpu, tenant="team-a") == 1


def test_gpu_seconds_are_counted_per_tenant_and_class(api: tuple[TestClient, Repo]) -> None:
    # Given a 2-GPU job that ran 100 s
    client, repo = api
    tenant, _ = repo.create_tenant("team-b", now=utcnow())
    job_id = submit(repo, tenant.id, command=["true"], resources={"gpus": 2, "gpu_mem_gb": 20})
    t0 = utcnow()
    claim = repo.claim(job_id, dispatch_token=publish(repo, job_id, t0), worker="gpu0@n",
                       gpus="0,1", gpu_count=2, now=t0, lease_ttl_s=600)
    assert claim is not None

    # When it succeeds
    assert repo.record_outcome(job_id, claim.token, Outcome(AttemptReason.SUCCEEDED),
                               now=t0 + timedelta(seconds=100)) is not None

    # Then its tenant and class are billed 200 GPU-seconds
    samples = scrape(client)
    assert value(samples, "e31_gpu_seconds_total", tenant="team-b",
                 **{"class": "gpu24"}) == pytest.approx(200.0)


def test_the_backlog_gauge_equals_the_stores_count(api: tuple[TestClient, Repo]) -> None:
    # Given queued jobs of two tenants in three classes, and one that left the queue
    client, repo = api
    a, _ = repo.create_tenant("a", now=utcnow())
    b, _ = repo.create_tenant("b", now=utcnow())
    for tenant, resources, n in ((a, {"gpus": 0}, 3), (a, {"gpus": 1, "gpu_mem_gb": 40}, 2),
                                 (b, {"gpus": 1, "gpu_mem_gb": 40}, 4),
                                 (b, {"gpus": 1, "gpu_mem_gb": 80}, 1)):
        for _ in range(n):
            submit(repo, tenant.id, command=["true"], resources=resources)
    repo.request_cancel(a.id, submit(repo, a.id, command=["true"]), now=utcnow())

    # When the pool is scraped
    samples = scrape(client)

    # Then each class's queued series add up to the store's count of queued jobs
    with repo.engine.connect() as conn:
        stored = dict(conn.execute(select(Job.size_class, func.count())
                                   .where(Job.state == "queued").group_by(Job.size_class)).all())
    assert stored == {"cpu": 3, "gpu48": 6, "gpu80": 1}
    for cls in ("cpu", "gpu24", "gpu48", "gpu80", "gpu141"):
        assert total(samples, "e31_jobs", state="queued", **{"class": cls}) == stored.get(cls, 0)
    assert value(samples, "e31_jobs_ended_total", state="cancelled", **{"class": "cpu"},
                 tenant="a") == 1


def test_workers_and_gpus_are_counted_by_state_with_their_telemetry(
        api: tuple[TestClient, Repo], redis_client: redis.Redis) -> None:
    # Given gpu24 workers: one idle, one busy, one asked to drain; each relays its GPU
    client, _ = api
    for i, busy in enumerate((None, "j-00000000000000000001", None)):
        sample = GpuSample(index=i, util_pct=50.0 * i, mem_used_bytes=i * 2**30,
                           mem_total_bytes=24 * 2**30, temperature_c=40.0 + i, power_w=100.0,
                           xid_errors=0, simulated=True)
        heartbeat.write(redis_client, WorkerInfo(
            node=f"gpu{i}@h", queues=("e31.gpu24",), gpus=str(i), gpu_count=1,
            size_class="gpu24", busy_job=busy, gpus_telemetry=(sample,)), interval_s=5)
    redis_client.set(keys.drain("gpu2@h"), "now")

    # When the pool is scraped
    samples = scrape(client)

    # Then the slots and GPUs are counted by state, every class has its series, and each GPU's
    # readings are there, labelled by host and index (a busy worker's job id is not)
    g24 = {"class": "gpu24"}
    assert [value(samples, "e31_workers", **g24, state=s) for s in metrics.WORKER_STATES] == \
        [1, 1, 1, 0]
    assert [value(samples, "e31_gpus", **g24, state=s) for s in metrics.WORKER_STATES] == \
        [1, 1, 1, 0]
    assert value(samples, "e31_workers", **{"class": "gpu80"}, state="idle") == 0
    assert value(samples, "e31_gpu_utilization_ratio", node="h", gpu="1") == 0.5
    assert value(samples, "e31_gpu_memory_used_bytes", node="h", gpu="2") == 2 * 2**30
    assert value(samples, "e31_gpu_temperature_celsius", node="h", gpu="0") == 40.0
    assert value(samples, "e31_gpu_power_watts", node="h", gpu="0") == 100.0
    assert value(samples, "e31_gpu_xid_errors_total", node="h", gpu="0") == 0
    assert value(samples, "e31_gpu_simulated", node="h", gpu="0") == 1
    assert [value(samples, "e31_gpu_busy", node="h", gpu=str(i)) for i in range(3)] == [0, 1, 0]
    assert value(samples, "e31_broker_up") == 1 and value(samples, "e31_store_up") == 1
    # and the artifact store's filesystem has its free and total bytes
    assert 0 < value(samples, "e31_artifact_store_free_bytes") <= value(
        samples, "e31_artifact_store_size_bytes")


def test_the_scheduler_health_and_error_counts_reach_the_metrics(
        api: tuple[TestClient, Repo], redis_url: str, redis_client: redis.Redis) -> None:
    # Given a leading scheduler
    client, repo = api
    settings = Settings(redis_url=redis_url, scheduler_tick_s=0.2)
    scheduler = Scheduler(settings=settings, repo=repo, redis_client=redis_client,
                          celery=make_celery(settings))
    stop = threading.Event()
    runner = threading.Thread(target=scheduler.run, args=(stop,), daemon=True)

    # When it ticks
    runner.start()
    try:
        wait_for(lambda: redis_client.hget(keys.HEALTH, metrics.TICK_AT), what="a tick noted")
    finally:
        stop.set()
        runner.join(timeout=10)
    samples = scrape(client)

    # Then the tick's time, duration and publications are series
    assert value(samples, "e31_scheduler_last_tick_timestamp_seconds") > 0
    assert value(samples, "e31_scheduler_tick_duration_seconds") >= 0
    assert value(samples, "e31_scheduler_published_last_tick") == 0
    assert value(samples, "e31_fenced_writes_total") == 0

    # When a process meets errors while Redis is away, then Redis answers again
    tally = metrics.ErrorTally("scheduler")
    tally.store_error()
    tally.broker_error()
    unreachable = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    with pytest.raises(redis.RedisError):
        tally.flush(unreachable)
    tally.flush(redis_client)
    metrics.note_fenced_write(redis_client)

    # Then none of its counts was lost
    samples = scrape(client)
    assert value(samples, "e31_store_errors_total", process="scheduler") == 1
    assert value(samples, "e31_broker_errors_total", process="scheduler") == 1
    assert value(samples, "e31_fenced_writes_total") == 1


def test_a_scrape_without_the_metrics_token_is_refused(api: tuple[TestClient, Repo],
                                                       repo: Repo) -> None:
    client, _ = api
    _, tenant_token = repo.create_tenant("team-c", now=utcnow())
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.get("/metrics", headers={"Authorization": f"Bearer {tenant_token}"}
                      ).status_code == 401            # a tenant's token is not the metrics token
    assert client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


@pytest.mark.parametrize("host, status", [("127.0.0.1", 200), ("::1", 200), ("10.1.2.3", 403),
                                          ("testclient", 403)])
def test_without_a_metrics_token_only_loopback_clients_are_answered(
        repo: Repo, redis_url: str, redis_client: redis.Redis, tmp_path: Path, host: str,
        status: int) -> None:
    settings = Settings(redis_url=redis_url, home=tmp_path)
    service = Services(settings=settings, repo=repo, artifacts=ArtifactStore(f"file://{tmp_path}"),
                      redis_client=redis_client)
    client = TestClient(create_app(settings, services=service), client=(host, 50000))
    response = client.get("/metrics")
    assert response.status_code == status
    if status == 200:
        assert "e31_jobs" in response.text


def test_a_store_that_cannot_be_read_is_a_gap_and_store_up_zero(
        api: tuple[TestClient, Repo]) -> None:
    client, repo = api
    repo.engine.dispose()
    with repo.engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE attempts")   # every grouped read now fails
    samples = scrape(client)
    assert value(samples, "e31_store_up") == 0
    assert value(samples, "e31_broker_up") == 1
    assert not any(name == "e31_jobs" for name, _ in samples)


def test_top_shows_a_tenant_its_own_jobs_and_the_others_merged(
        api: tuple[TestClient, Repo], redis_client: redis.Redis) -> None:
    # Given one running job of each of two tenants on gpu24 workers, and a queued one
    client, repo = api
    a, token_a = repo.create_tenant("a", now=utcnow())
    b, token_b = repo.create_tenant("b", now=utcnow())
    admin, token_admin = repo.create_tenant("ops", admin=True, now=utcnow())
    running = {}
    for i, tenant in enumerate((a, b)):
        job_id = submit(repo, tenant.id, command=["true"], name=f"train-{tenant.name}",
                        resources={"gpus": 1, "gpu_mem_gb": 20})
        assert repo.claim(job_id, dispatch_token=publish(repo, job_id), worker=f"gpu{i}@h",
                          gpus=str(i), gpu_count=1, now=utcnow(), lease_ttl_s=60)
        repo.renew(job_id, 1, now=utcnow(), lease_ttl_s=60, progress=(1, 4))
        heartbeat.write(redis_client, WorkerInfo(
            node=f"gpu{i}@h", queues=("e31.gpu24",), gpus=str(i), gpu_count=1,
            size_class="gpu24", busy_job=job_id, gpus_telemetry=(GpuSample(
                index=i, util_pct=80.0, mem_used_bytes=11 * 2**30,
                mem_total_bytes=24 * 2**30),)), interval_s=5)
        running[tenant.name] = job_id
    submit(repo, a.id, command=["true"], resources={"gpus": 1, "gpu_mem_gb": 20})

    # When each asks for the pool
    seen_a = client.get("/v1/top", headers={"Authorization": f"Bearer {token_a}"}).json()
    seen_admin = client.get("/v1/top", headers={"Authorization": f"Bearer {token_admin}"}).json()

    # Then a tenant sees its own job by id, with its runtime and GPU use, and b's merged
    [mine] = seen_a["running"]
    assert mine["id"] == running["a"] and mine["name"] == "train-a" and mine["tenant"] == "a"
    assert mine["gpu_utilization"] == 0.8 and mine["gpu_memory_used_bytes"] == 11 * 2**30
    assert mine["progress"] == 0.25 and mine["runtime_s"] >= 0 and mine["idle_since"] is None
    assert seen_a["others"] == [{"tenant": "others", "size_class": "gpu24", "jobs": 1, "gpus": 1}]
    assert running["b"] not in str(seen_a)
    [g24] = [c for c in seen_a["classes"] if c["size_class"] == "gpu24"]
    assert (g24["gpus"], g24["busy_gpus"], g24["idle_gpus"], g24["queued"], g24["running"]) == \
        (2, 2, 0, 1, 2)
    assert g24["utilization"] == 0.8 and g24["oldest_queued_s"] >= 0
    assert {g["job"] for g in seen_a["gpus"]} == {running["a"], None}
    # and an admin sees both jobs by id, nothing merged
    assert {j["id"] for j in seen_admin["running"]} == set(running.values())
    assert seen_admin["others"] == []
    assert client.get("/v1/top").status_code == 401
    assert client.get("/v1/top", headers={"Authorization": f"Bearer {token_b}"}).json()[
        "running"][0]["id"] == running["b"]


def test_history_is_read_once_per_process_and_no_end_is_counted_twice(
        repo: Repo, redis_client: redis.Redis) -> None:
    # Given a collector on a clock the test turns, a job that ended an hour ago and one running
    clock = [utcnow()]
    reg = registry(PoolCollector(reads=repo, redis_client=redis_client,
                                                 classes=["cpu"], clock=lambda: clock[0]))
    tenant, _ = repo.create_tenant("team-d", now=utcnow())

    def ran(seconds: float, *, ended_ago_s: float) -> None:
        job_id = submit(repo, tenant.id, command=["true"],
                        resources={"gpus": 1, "gpu_mem_gb": 20})
        t0 = clock[0] - timedelta(seconds=ended_ago_s + seconds)
        claim = repo.claim(job_id, dispatch_token=publish(repo, job_id, t0), worker="gpu0@n",
                           gpus="0", gpu_count=1, now=t0, lease_ttl_s=86400)
        assert claim is not None
        assert repo.record_outcome(job_id, claim.token, Outcome(AttemptReason.SUCCEEDED),
                                   now=t0 + timedelta(seconds=seconds))

    def billed() -> tuple[float | None, float | None]:
        samples: Samples = {}
        for family in text_string_to_metric_families(render(reg).decode()):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        g24 = {"class": "gpu24"}
        return (value(samples, "e31_gpu_seconds_total", tenant="team-d", **g24),
                value(samples, "e31_attempts_ended_total", reason="succeeded", **g24))

    ran(100, ended_ago_s=3600)
    assert billed() == (100, 1)          # the first scrape reads the history

    # When a job ends now, and the clock then moves past the settling time, scraping as it goes
    ran(10, ended_ago_s=0)
    assert billed() == (110, 2)
    for minutes in (5, 11, 30):
        clock[0] += timedelta(minutes=minutes)
        # Then each end is counted once: while it is recent, and once it has settled
        assert billed() == (110, 2)


def test_top_and_queue_of_a_cpu_only_pool_count_its_cpu_slots_and_make_no_gpu_claim(
        api: tuple[TestClient, Repo], redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given a pool of two CPU workers and no GPU one, one of them running a CPU job
    # (issue 32, rough edge 12: top said busy 0 idle 0, queue counted it under GPUs, and top
    # ended with "GPU sim: simulated, its readings made up")
    client, repo = api
    tenant, token = repo.create_tenant("a", now=utcnow())
    job_id = submit(repo, tenant.id, command=["true"], name="etl")
    assert repo.claim(job_id, dispatch_token=publish(repo, job_id), worker="cpu0@h", gpus="",
                      gpu_count=0, now=utcnow(), lease_ttl_s=60)
    for i in range(2):
        heartbeat.write(redis_client, WorkerInfo(
            node=f"cpu{i}@h", queues=("e31.cpu",), gpus="", gpu_count=0, size_class="cpu",
            busy_job=job_id if i == 0 else None), interval_s=5)
    h = {"Authorization": f"Bearer {token}"}

    # When the pool is asked for, as JSON and by the CLI against the API on a port
    top = client.get("/v1/top", headers=h).json()
    queue = client.get("/v1/queue", headers=h).json()
    env = {k: v for k, v in os.environ.items() if not k.startswith("E31_")}
    with serving(client.app) as port:      # type: ignore[arg-type]
        env.update(E31_URL=f"http://127.0.0.1:{port}", E31_TOKEN=token, E31_HOME=str(tmp_path))
        shown_top, shown_queue = (
            subprocess.run([sys.executable, "-m", "e31.cli", *args], env=env, text=True,
                           capture_output=True, timeout=60, check=False)
            for args in (("top", "--once"), ("queue",)))

    # Then the cpu class counts one slot a worker, one busy, one idle, and says they are CPUs
    [cpu] = top["classes"]
    assert (cpu["size_class"], cpu["slot_kind"], cpu["workers"], cpu["gpus"],
            cpu["busy_gpus"], cpu["idle_gpus"], cpu["running"]) == ("cpu", "cpu", 2, 2, 1, 1, 1)
    assert top["gpus"] == []
    [queued] = [c for c in queue["classes"] if c["size_class"] == "cpu"]
    assert (queued["slot_kind"], queued["gpus"], queued["busy_gpus"]) == ("cpu", 2, 1)
    # and the CLI prints them as CPU slots, with no word of a simulated GPU
    assert shown_top.returncode == 0, shown_top.stderr
    assert row_of(shown_top.stdout, "cpu")[:6] == ["cpu", "2", "2", "CPU", "1", "1"]
    assert "GPU sim" not in shown_top.stdout
    assert shown_queue.returncode == 0, shown_queue.stderr
    assert row_of(shown_queue.stdout, "class")[:3] == ["class", "slots", "busy"]
    assert row_of(shown_queue.stdout, "cpu")[:4] == ["cpu", "2", "CPU", "1"]


def row_of(table: str, first: str) -> list[str]:
    """The words of the table's line whose first is `first` (its rules left out)."""
    rows = [[w for w in line.split() if w not in "│┃"] for line in table.splitlines()]
    return next((r for r in rows if r[:1] == [first]), [table])
