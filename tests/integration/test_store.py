"""The results store on real SQLite and PostgreSQL: schema, claim, fence, retries, scoping."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import select

from e31.core.clock import utcnow
from e31.core.errors import NotFound
from e31.core.records import Outcome
from e31.core.sizeclasses import route
from e31.core.spec import JobSpec
from e31.core.states import AttemptReason, JobState
from e31.edge.settings import Settings
from e31.store import Repo
from e31.store import jobs as jobs_module
from e31.store.models import Base, Job

CLASSES = Settings().size_classes
NOT_PUBLISHED = "no-publication"   # a token no publication has


def submit(repo: Repo, tenant_id: str, **fields: object):
    spec = JobSpec.parse({"entrypoint": "pkg.mod:main", **fields})
    return repo.insert_job(tenant_id, spec, route(spec, CLASSES), now=utcnow())


def publish(repo: Repo, job_id: str, now=None) -> str:
    """The token of the job's message: published now, as the scheduler does, or the standing
    publication's (NOT_PUBLISHED when it has none: a running or ended job)."""
    issued = repo.mark_dispatched([job_id], now=now or utcnow())
    if job_id in issued:
        return issued[job_id]
    with repo.engine.connect() as conn:
        return conn.execute(select(Job.dispatch_token).where(Job.id == job_id)).scalar() \
            or NOT_PUBLISHED


def claim(repo: Repo, job_id: str, worker: str = "gpu0@test", now=None, token=None):
    """Claim as the worker that received the job's message (`publish`), or one carrying
    `token`."""
    return repo.claim(job_id, dispatch_token=token or publish(repo, job_id, now),
                      worker=worker, gpus="0", gpu_count=1, now=now or utcnow(), lease_ttl_s=10)


def test_the_migrations_produce_exactly_the_models_schema(repo: Repo) -> None:
    with repo.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []


def test_a_token_resolves_to_its_tenant_and_only_its_hash_is_stored(repo: Repo) -> None:
    tenant, token = repo.create_tenant("team-a", now=utcnow())
    assert repo.tenant_for_token(token) == tenant
    assert repo.tenant_for_token(token + "x") is None
    with repo.engine.connect() as conn:
        stored = [row[0] for row in conn.exec_driver_sql("SELECT token_hash FROM api_keys")]
    assert token not in stored and len(stored[0]) == 64


def test_only_one_of_many_concurrent_claims_wins(repo: Repo) -> None:
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job = submit(repo, tenant.id)
    token = publish(repo, job.id)
    results: list[object] = []
    barrier = threading.Barrier(8)

    def racer(i: int) -> None:   # eight deliveries of the job's one message
        barrier.wait()
        results.append(claim(repo, job.id, worker=f"w{i}", token=token))

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [r for r in results if r is not None]
    assert len(winners) == 1
    record = repo.get_job(None, job.id)
    assert record.state == "running" and len(record.attempts) == 1


def test_a_stale_token_cannot_record_an_outcome(repo: Repo) -> None:
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job = submit(repo, tenant.id, retries={"max": 1, "backoff_s": 0})
    first = claim(repo, job.id)
    assert repo.record_outcome(job.id, first.token, Outcome(AttemptReason.ERROR, error="x"),
                               now=utcnow()) is JobState.QUEUED
    second = claim(repo, job.id, worker="gpu1@test")
    assert second.token == first.token + 1

    refused = repo.record_outcome(job.id, first.token, Outcome(AttemptReason.SUCCEEDED, result=1),
                                  now=utcnow())

    assert refused is None
    assert repo.get_job(None, job.id).state == "running"


def test_the_progress_an_outcome_carries_is_the_ended_jobs_last_progress(repo: Repo) -> None:
    # Given a job that never renewed its lease (it ended before its first tick)
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job = submit(repo, tenant.id)
    held = claim(repo, job.id)

    # When its outcome says how far it got
    assert repo.record_outcome(job.id, held.token, Outcome(AttemptReason.SUCCEEDED,
                                                           progress=(7.0, 8.0)),
                               now=utcnow()) is JobState.SUCCEEDED

    # Then the ended job shows that progress
    ended = repo.get_job(None, job.id)
    assert (ended.progress_done, ended.progress_total) == (7.0, 8.0)


def test_a_failed_attempt_is_retried_after_its_backoff_and_then_fails_for_good(repo: Repo) -> None:
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job = submit(repo, tenant.id, retries={"max": 1, "backoff_s": 30})
    now = utcnow()
    c1 = claim(repo, job.id, now=now)
    repo.record_outcome(job.id, c1.token, Outcome(AttemptReason.ERROR, error="boom"), now=now)
    assert claim(repo, job.id, now=now + timedelta(seconds=29)) is None  # still backing off
    c2 = claim(repo, job.id, now=now + timedelta(seconds=31))
    assert c2 is not None and c2.attempt == 2

    state = repo.record_outcome(job.id, c2.token, Outcome(AttemptReason.TIMEOUT, error="late"),
                                now=now + timedelta(seconds=40))

    assert state is JobState.FAILED
    record = repo.get_job(tenant.id, job.id)
    assert (record.reason, record.error) == ("timeout", "late")
    assert [a.reason for a in record.attempts] == ["error", "timeout"]


def test_a_drained_attempt_is_requeued_without_using_a_retry(repo: Repo) -> None:
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job = submit(repo, tenant.id, retries={"max": 0})
    c1 = claim(repo, job.id)
    assert repo.record_outcome(job.id, c1.token, Outcome(AttemptReason.DRAINED), now=utcnow()) \
        is JobState.QUEUED
    c2 = claim(repo, job.id)
    assert repo.record_outcome(job.id, c2.token, Outcome(AttemptReason.ERROR, error="e"),
                               now=utcnow()) is JobState.FAILED


def test_gpu_seconds_bill_each_attempts_duration_times_its_gpus(repo: Repo) -> None:
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job = submit(repo, tenant.id, resources={"gpus": 2}, retries={"max": 1, "backoff_s": 0})
    t0 = utcnow()
    c1 = repo.claim(job.id, dispatch_token=publish(repo, job.id), worker="w", gpus="0,1",
                    gpu_count=2, now=t0, lease_ttl_s=10)
    repo.record_outcome(job.id, c1.token, Outcome(AttemptReason.ERROR),
                        now=t0 + timedelta(seconds=5))
    c2 = repo.claim(job.id, dispatch_token=publish(repo, job.id), worker="w", gpus="0,1",
                    gpu_count=2, now=t0 + timedelta(seconds=65), lease_ttl_s=10)
    repo.record_outcome(job.id, c2.token, Outcome(AttemptReason.SUCCEEDED, result={"ok": 1}),
                        now=t0 + timedelta(seconds=75))

    record = repo.get_job(tenant.id, job.id)
    assert record.gpu_seconds == pytest.approx((5 + 10) * 2)
    # waiting is tracked, never billed: the 60 s between the attempts, and the first wait from
    # the submit's own clock reading to t0 (a second and more on a loaded machine)
    first_wait_s = (t0 - record.submitted_at).total_seconds()
    assert record.queued_seconds == pytest.approx(60 + first_wait_s, abs=0.1)
    [row] = repo.usage(tenant.id, now=t0 + timedelta(seconds=80))
    assert row.gpu_seconds == pytest.approx(30) and row.jobs == {"succeeded": 1}


def test_cancelling_a_queued_job_means_it_can_never_be_claimed(repo: Repo) -> None:
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job = submit(repo, tenant.id)
    assert repo.request_cancel(tenant.id, job.id, now=utcnow()).state == "cancelled"
    assert claim(repo, job.id) is None


def test_cancelling_a_running_job_asks_its_worker_through_the_lease(repo: Repo) -> None:
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job = submit(repo, tenant.id)
    c = claim(repo, job.id)
    assert repo.renew(job.id, c.token, now=utcnow(), lease_ttl_s=10) == (True, False, False)
    repo.request_cancel(tenant.id, job.id, now=utcnow())
    assert repo.renew(job.id, c.token, now=utcnow(), lease_ttl_s=10) == (True, True, False)
    assert repo.record_outcome(job.id, c.token, Outcome(AttemptReason.CANCELLED), now=utcnow()) \
        is JobState.CANCELLED


def test_a_tenant_cannot_read_or_cancel_another_tenants_job(repo: Repo) -> None:
    a, _ = repo.create_tenant("a", now=utcnow())
    b, _ = repo.create_tenant("b", now=utcnow())
    job = submit(repo, a.id)
    with pytest.raises(NotFound):
        repo.get_job(b.id, job.id)
    with pytest.raises(NotFound):
        repo.request_cancel(b.id, job.id, now=utcnow())
    assert repo.list_jobs(b.id) == []
    assert repo.usage(b.id, now=utcnow()) == []
    assert repo.get_job(a.id, job.id).state == "queued"


def heads(repo: Repo, queue: str = "e31.gpu24", *, now=None) -> list[str]:
    """The ids of the candidates the scheduler reads for `queue`, in the order it reads them."""
    return [c.id for c in repo.heads({queue: 10}, now=now or utcnow())]


def test_candidates_come_in_band_then_submission_order_and_dispatch_marks_once(
        repo: Repo) -> None:
    # Given three queued jobs of one tenant in three priority bands
    tenant, _ = repo.create_tenant("a", now=utcnow())
    low = submit(repo, tenant.id, priority=1)
    high = submit(repo, tenant.id, priority=9)
    mid = submit(repo, tenant.id, priority=5)
    now = utcnow()

    # Then the scheduler reads them highest band first
    assert heads(repo, now=now) == [high.id, mid.id, low.id]

    # And a job is marked published once, is no candidate while it waits for its worker,
    # and holds a slot of its queue meanwhile
    assert list(repo.mark_dispatched([high.id], now=now)) == [high.id]
    assert repo.mark_dispatched([high.id], now=now) == {}  # already published
    assert heads(repo, now=now) == [mid.id, low.id]
    [published] = repo.scheduling_view(now=now, queues=["e31.gpu24"]).outstanding
    assert (published.tenant_id, published.queue) == (tenant.id, "e31.gpu24")

    # And a publication never claimed is forgotten after the timeout, in its own queue only
    later = now + timedelta(seconds=121)
    assert repo.expire_dispatches(["e31.gpu48"], now=later, timeout_s=120) == 0  # other queue
    soon = now + timedelta(seconds=60)
    assert repo.expire_dispatches(["e31.gpu24"], now=soon, timeout_s=120) == 0
    assert repo.expire_dispatches(["e31.gpu24"], now=later, timeout_s=120) == 1
    assert repo.scheduling_view(now=later, queues=["e31.gpu24"]).outstanding == []
    assert heads(repo, now=later) == [high.id, mid.id, low.id]


def test_a_job_in_retry_back_off_is_no_candidate_until_its_back_off_ends(repo: Repo) -> None:
    # Given a job whose first attempt failed with a back-off of 60 s
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job = submit(repo, tenant.id, retries={"max": 1, "backoff_s": 60})
    c = claim(repo, job.id)
    now = utcnow()
    repo.record_outcome(job.id, c.token, Outcome(AttemptReason.ERROR, error="boom"), now=now)

    # Then the scheduler does not read it during the back-off, and does after it
    assert heads(repo, now=now + timedelta(seconds=30)) == []
    assert heads(repo, now=now + timedelta(seconds=61)) == [job.id]


def test_a_cancel_racing_the_workers_outcome_write_is_serialised(
        repo: Repo, monkeypatch: pytest.MonkeyPatch) -> None:
    """The API has read the running job when the worker writes a retryable failure."""
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job = submit(repo, tenant.id, retries={"max": 2, "backoff_s": 0})
    c = claim(repo, job.id)
    writers: list[threading.Thread] = []
    seen: list[object] = []
    original = jobs_module.find_job

    def read_then_race(s, tenant_id, job_id, **kw):  # type: ignore[no-untyped-def]
        found = original(s, tenant_id, job_id, **kw)
        writer = threading.Thread(target=lambda: seen.append(repo.record_outcome(
            job.id, c.token, Outcome(AttemptReason.ERROR, error="boom"), now=utcnow())))
        writer.start()
        writers.append(writer)
        return found

    monkeypatch.setattr(jobs_module, "find_job", read_then_race)
    repo.request_cancel(tenant.id, job.id, now=utcnow())
    monkeypatch.setattr(jobs_module, "find_job", original)
    for w in writers:
        w.join(timeout=30)

    assert seen == [JobState.CANCELLED]        # the worker saw the cancel, not a stale row
    record = repo.get_job(tenant.id, job.id)
    assert record.state == "cancelled" and record.attempts[0].ended_at is not None
    assert heads(repo) == []


def test_a_worker_is_busy_while_its_lease_lives_and_not_after_it_expired(repo: Repo) -> None:
    # Given a worker that claimed a job with a lease of 10 s and then died
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job = submit(repo, tenant.id)
    now = utcnow()
    claim(repo, job.id, worker="gpu0@dead", now=now)

    def live_leases(at: object) -> list[str | None]:
        view = repo.scheduling_view(now=at, queues=["e31.gpu24"])  # type: ignore[arg-type]
        return [r.node for r in view.running if r.lease_live]

    # Then the scheduler counts it busy while the lease lives, and not after it expired (a
    # worker restarted under the same name gets work)
    assert live_leases(now + timedelta(seconds=5)) == ["gpu0@dead"]
    assert live_leases(now + timedelta(seconds=11)) == []
