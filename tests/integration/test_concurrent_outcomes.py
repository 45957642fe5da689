"""Many workers end one tenant's jobs at once on PostgreSQL: no deadlock, no usage lost.

Eight worker engines (as eight GPU worker processes build them) each live four jobs of the
same tenant at once: submit, publish, claim, renew, record. Each end bills the tenant's
decayed usage under a row lock (`tenants.bill`); with `FOR UPDATE` two ends deadlocked
(PostgreSQL: "deadlock detected … while locking tuple in relation tenants"), which a worker
rides out only by retrying its outcome write after PostgreSQL's deadlock timeout. At a
thousand GPUs, ends of one tenant's jobs meet all the time (docs/scale.md).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import select

from e31.core.clock import utcnow
from e31.core.records import Outcome
from e31.core.sizeclasses import route
from e31.core.spec import JobSpec
from e31.core.states import AttemptReason, JobState
from e31.edge.settings import Settings
from e31.store import Repo, make_engine
from e31.store.migrate import upgrade
from e31.store.models import Job, Tenant
from tests.conftest import fresh_postgres_database

pytestmark = pytest.mark.postgres

WORKERS = 8
JOBS_PER_WORKER = 4


def submit_one(repo: Repo, tenant_id: str) -> str:
    """A queued job of the tenant, as the API stores one."""
    spec = JobSpec.parse({"entrypoint": "pkg.mod:main", "timeout_s": 60})
    return repo.insert_job(tenant_id, spec, route(spec, Settings().size_classes),
                           now=utcnow()).id


def live(repo: Repo, job_id: str, node: str) -> JobState | None:
    """A queued job's life as a worker lives it: published, claimed, renewed, recorded."""
    token = repo.mark_dispatched([job_id], now=utcnow())[job_id]
    claim = repo.claim(job_id, dispatch_token=token, worker=node, gpus="0", gpu_count=1,
                       now=utcnow(), lease_ttl_s=30)
    assert claim is not None
    for step in range(3):
        assert repo.renew(job_id, claim.token, now=utcnow(), lease_ttl_s=30,
                          progress=(step, 3)) == (True, False, False)
    return repo.record_outcome(job_id, claim.token, Outcome(AttemptReason.SUCCEEDED),
                               now=utcnow())


def run_workers(repos: list[Repo], next_job: Callable[[Repo], str]
                ) -> tuple[list[JobState | None], list[BaseException]]:
    """Every repo's worker lives JOBS_PER_WORKER jobs (each from `next_job`), all at once;
    their ends and errors."""
    ends: list[JobState | None] = []
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(JOBS_PER_WORKER):
                ends.append(live(repos[i], next_job(repos[i]), f"gpu{i}@node"))
        except BaseException as exc:  # noqa: BLE001 - the caller asserts on them
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(repos))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return ends, errors


@pytest.fixture
def worker_repos() -> Iterator[list[Repo]]:
    with fresh_postgres_database() as url:
        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()
        half_life_s = Settings().fair_share_half_life_s
        repos = [Repo(make_engine(url, worker=True), half_life_s=half_life_s)
                 for _ in range(WORKERS)]
        yield repos
        for r in repos:
            r.engine.dispose()


def test_eight_workers_ending_one_tenants_jobs_at_once_neither_deadlock_nor_lose_usage(
        worker_repos: list[Repo]) -> None:
    # Given one tenant and eight workers
    tenant, _ = worker_repos[0].create_tenant("busy", now=utcnow())
    # When each lives four of its jobs at the same time as the others
    ends, errors = run_workers(worker_repos, lambda repo: submit_one(repo, tenant.id))
    # Then no store call failed (a deadlock is a StoreError) and every job succeeded
    assert not errors, errors
    assert ends == [JobState.SUCCEEDED] * WORKERS * JOBS_PER_WORKER
    # And the tenant was billed every job's GPU-seconds: no concurrent end was lost
    with worker_repos[0].engine.connect() as conn:
        billed = sum(conn.scalars(select(Job.gpu_seconds).where(Job.tenant_id == tenant.id)))
        usage = conn.scalar(select(Tenant.usage_gpu_s).where(Tenant.id == tenant.id))
    assert billed > 0
    assert usage == pytest.approx(billed, rel=0.01)   # the half-life is hours: seconds decay ~0


def test_eight_workers_ending_items_of_one_array_at_once_do_not_deadlock(
        worker_repos: list[Repo]) -> None:
    # Given an array of 32 queued items
    tenant, _ = worker_repos[0].create_tenant("sweep", now=utcnow())
    spec = JobSpec.parse({"entrypoint": "pkg.mod:main", "timeout_s": 60})
    where = route(spec, Settings().size_classes)
    array = worker_repos[0].insert_array(tenant.id, "sweep",
                                         [(spec, where)] * (WORKERS * JOBS_PER_WORKER),
                                         now=utcnow())
    items: queue.SimpleQueue[str] = queue.SimpleQueue()
    for item in array.items:
        items.put(item.id)
    # When eight workers run its items, ending them at the same time as each other
    ends, errors = run_workers(worker_repos, lambda _repo: items.get_nowait())
    # Then no outcome write failed (PostgreSQL broke no deadlock) and every item succeeded
    assert not errors, errors
    assert ends == [JobState.SUCCEEDED] * WORKERS * JOBS_PER_WORKER
    assert worker_repos[0].get_array(tenant.id, array.id, items=False).counts == {
        JobState.SUCCEEDED.value: WORKERS * JOBS_PER_WORKER}
