"""Array items in a row (docs/scheduling.md): `AttemptStore.claim_next_item` on the real store.

A worker that ended an array's item claims the next one itself, without a publication, only
where the scheduler would have had no other choice: each refusal below is shown to be the
refusal's doing by the same claim succeeding once its cause is gone.
"""

from __future__ import annotations

from sqlalchemy import select

from e31.core.clock import utcnow
from e31.core.records import Claim, Outcome
from e31.core.states import AttemptReason, JobState
from e31.store import Repo
from e31.store.models import Attempt, Job
from tests.integration.test_dependencies import array
from tests.integration.test_fair_scheduling import one
from tests.integration.test_store import publish

WORKER = "gpu0@n"
GPU24 = "e31.gpu24"


def run(repo: Repo, job_id: str) -> Claim:
    """Claim the job as its published message would, and end its attempt succeeded."""
    claim = repo.claim(job_id, dispatch_token=publish(repo, job_id), worker=WORKER, gpus="0",
                       gpu_count=1, now=utcnow(), lease_ttl_s=60)
    assert claim is not None
    assert repo.record_outcome(job_id, claim.token, Outcome(AttemptReason.SUCCEEDED),
                               now=utcnow()) is JobState.SUCCEEDED
    return claim


def chain(repo: Repo, after: str, queue: str | None = GPU24) -> Claim | None:
    return repo.claim_next_item(after, queue=queue, worker=WORKER, gpus="0", gpu_count=1,
                                now=utcnow(), lease_ttl_s=60)


def test_the_next_unpublished_item_is_claimed_with_its_own_attempt_and_fencing_token(
        repo: Repo) -> None:
    # Given a four-item array whose item 0 ran and whose item 1 the scheduler has published
    tenant, _ = repo.create_tenant("a", now=utcnow())
    _, items = array(repo, tenant.id, 4)
    run(repo, items[0])
    publish(repo, items[1])

    # When the worker that ran item 0 asks for the next item
    claim = chain(repo, items[0])

    # Then it holds item 2 (item 1's message is another worker's), running under a lease of
    # its own with an attempt row, never published
    assert claim is not None and claim.job_id == items[2] and claim.attempt == 1
    assert repo.get_job(None, items[3]).state == "queued"    # one claim, one item
    with repo.engine.connect() as conn:
        job = conn.execute(select(Job.state, Job.lease_owner, Job.lease_token, Job.dispatch_count,
                                  Job.queued_since).where(Job.id == items[2])).one()
        waited = conn.execute(select(Job.queued_seconds).where(Job.id == items[2])).scalar()
        attempts = conn.execute(select(Attempt.n, Attempt.worker)
                                .where(Attempt.job_id == items[2])).all()
    assert tuple(job) == ("running", WORKER, claim.token, 0, None)
    assert waited > 0       # its time in the queue, counted as a published job's is
    assert [tuple(a) for a in attempts] == [(1, WORKER)]
    # and its outcome is fenced by that token as any claim's
    assert repo.record_outcome(items[2], claim.token + 1, Outcome(AttemptReason.SUCCEEDED),
                               now=utcnow()) is None
    assert repo.record_outcome(items[2], claim.token, Outcome(AttemptReason.SUCCEEDED),
                               now=utcnow()) is JobState.SUCCEEDED
    # and item 1's message still claims item 1
    assert repo.claim(items[1], dispatch_token=publish(repo, items[1]), worker="gpu1@n",
                      gpus="1", gpu_count=1, now=utcnow(), lease_ttl_s=60) is not None
    # and after the last item, and for a job of no array, there is nothing to chain
    after_last = chain(repo, items[2])
    assert after_last is not None and after_last.job_id == items[3]
    assert chain(repo, items[3]) is None
    single = one(repo, tenant.id)
    run(repo, single)
    assert chain(repo, single) is None


def test_no_item_is_chained_while_another_tenants_job_waits_in_the_queue(repo: Repo) -> None:
    # Given an array of tenant a whose item 0 ran, and a job of tenant b queued in its queue
    a, _ = repo.create_tenant("a", now=utcnow())
    b, _ = repo.create_tenant("b", now=utcnow())
    _, items = array(repo, a.id, 3)
    run(repo, items[0])
    theirs = one(repo, b.id)

    # When the worker asks for the next item, then the scheduler decides instead
    assert chain(repo, items[0]) is None

    # and once b's job runs, the next item is chained
    run(repo, theirs)
    claim = chain(repo, items[0])
    assert claim is not None and claim.job_id == items[1]


def test_no_item_is_chained_before_the_tenants_own_higher_band_or_older_job(
        repo: Repo) -> None:
    # Given an array whose item 0 ran, and the same tenant's urgent job queued after it
    tenant, _ = repo.create_tenant("a", now=utcnow())
    older = one(repo, tenant.id)
    _, items = array(repo, tenant.id, 3)
    run(repo, items[0])
    urgent = one(repo, tenant.id, priority=5)

    # Then neither the higher band nor the older job of the same band is passed over
    assert chain(repo, items[0]) is None
    run(repo, urgent)
    assert chain(repo, items[0]) is None
    run(repo, older)

    # and a younger job of the same band does not stop the row (the array is older)
    one(repo, tenant.id)
    claim = chain(repo, items[0])
    assert claim is not None and claim.job_id == items[1]


def test_the_tenants_quota_and_a_disabled_tenant_stop_the_row(repo: Repo) -> None:
    # Given a tenant with a quota of one gpu24 GPU, its array's item 0 ended, and one of its
    # jobs of the class running elsewhere (claimed after the item ended)
    tenant, _ = repo.create_tenant("a", quotas={"gpu24": 1}, now=utcnow())
    _, items = array(repo, tenant.id, 3)
    run(repo, items[1])
    other = repo.claim(items[0], dispatch_token=publish(repo, items[0]), worker="gpu1@n",
                       gpus="1", gpu_count=1, now=utcnow(), lease_ttl_s=60)
    assert other is not None

    # Then one more item would pass the quota: none is chained
    assert chain(repo, items[1]) is None

    # and once that job ended, the next item is
    repo.record_outcome(items[0], other.token, Outcome(AttemptReason.SUCCEEDED), now=utcnow())
    tenant_disabled = repo.set_tenant_disabled("a", disabled=True, now=utcnow())
    assert tenant_disabled.disabled_at is not None
    assert chain(repo, items[1]) is None          # but not for a disabled tenant
    repo.set_tenant_disabled("a", disabled=False, now=utcnow())
    claim = chain(repo, items[1])
    assert claim is not None and claim.job_id == items[2]


def test_a_cancelled_item_or_one_waiting_for_its_retry_is_not_chained(repo: Repo) -> None:
    # Given an array whose item 0 ran, item 1 cancelled while queued
    tenant, _ = repo.create_tenant("a", now=utcnow())
    _, items = array(repo, tenant.id, 3)
    run(repo, items[0])
    repo.request_cancel(tenant.id, items[1], now=utcnow())

    # Then the row goes on at item 2
    claim = chain(repo, items[0])
    assert claim is not None and claim.job_id == items[2]


def test_an_item_a_bigger_worker_took_from_a_queue_it_spills_to_is_not_followed(
        repo: Repo) -> None:
    # Given a gpu24 array whose item 0 a gpu48 worker ran (a spill)
    tenant, _ = repo.create_tenant("a", now=utcnow())
    _, items = array(repo, tenant.id, 3)
    run(repo, items[0])

    # Then that worker chains nothing; one of the class's own would, and so would a gang
    # worker (no queue of its own: its dispatch gave it GPUs for the item's class)
    assert chain(repo, items[0], queue="e31.gpu48") is None
    claim = chain(repo, items[0])
    assert claim is not None and claim.job_id == items[1]
    gang = chain(repo, items[1], queue=None)
    assert gang is not None and gang.job_id == items[2]
