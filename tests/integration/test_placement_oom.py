"""OOM to the next size (issue 15, item 3), in the store: an attempt that ran out of memory
sends its job to the next bigger class when `resources.on_oom` (or the pool's default) says
so, is billed and noted on the attempt, and is not counted against the retries; at the
biggest class, or with `fail`, it ends like any `oom`. Real SQLite/PostgreSQL."""

from __future__ import annotations

from e31.core.clock import utcnow
from e31.core.records import Outcome
from e31.core.sizeclasses import DEFAULT_SIZE_CLASSES, OomRule
from e31.core.states import AttemptReason
from e31.store import Repo
from tests.integration.test_fair_scheduling import one
from tests.integration.test_store import publish

RULE = OomRule.of(DEFAULT_SIZE_CLASSES, "fail")
OOM = Outcome(AttemptReason.OOM, exit_code=1, error="CUDA out of memory")


def run_out_of_memory(repo: Repo, job_id: str, rule: OomRule | None = RULE) -> str | None:
    """Claim the job on a worker and end its attempt with reason oom; the job's new state."""
    claim = repo.claim(job_id, dispatch_token=publish(repo, job_id), worker="gpu0@n", gpus="0",
                       gpu_count=1, now=utcnow(), lease_ttl_s=60)
    assert claim is not None
    state = repo.record_outcome(job_id, claim.token, OOM, now=utcnow(), oom=rule)
    return state.value if state else None


def test_an_oom_moves_the_job_up_class_by_class_without_using_its_retries(repo: Repo) -> None:
    # Given a gpu48 job that may move on after an OOM, with no retries at all
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job_id = one(repo, tenant.id, resources={"gpu_mem_gb": 40, "on_oom": "next_class"})

    # When its attempts run out of memory on gpu48, then gpu80, then gpu141 (the biggest)
    states = [run_out_of_memory(repo, job_id) for _ in range(3)]

    # Then it was queued in gpu80, then in gpu141, at once, and failed with oom at the end
    assert states == ["queued", "queued", "failed"]
    job = repo.get_job(tenant.id, job_id)
    assert (job.size_class, job.queue, job.reason) == ("gpu141", "e31.gpu141", "oom")
    assert [(a.reason, a.moved_to) for a in job.attempts] == \
        [("oom", "gpu80"), ("oom", "gpu141"), ("oom", None)]
    assert job.attempts[0].to_dict()["moved_to"] == "gpu80"
    # and every attempt was billed, the moved ones included
    assert job.gpu_seconds > 0 and all(a.ended_at is not None for a in job.attempts)


def test_a_moved_job_is_queued_without_back_off_and_says_where_it_went(repo: Repo) -> None:
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job_id = one(repo, tenant.id, resources={"gpus": 2, "gpu_mem_gb": 20, "on_oom": "next_class"},
                 retries={"max": 1, "backoff_s": 600})
    assert run_out_of_memory(repo, job_id) == "queued"
    job = repo.get_job(tenant.id, job_id)
    assert (job.size_class, job.queue) == ("gpu48", "e31.gpu48.x2")
    assert job.not_before is not None and job.not_before <= utcnow()
    assert job.error is not None and job.error.startswith("oom: moved to gpu48")


def test_without_next_class_an_oom_stays_in_its_class_and_fails_like_any_failure(
        repo: Repo) -> None:
    # Given two gpu24 jobs without retries: one says nothing (the pool's default, fail), one
    # says on_oom fail; and a third that says next_class, ended without the pool's rule
    tenant, _ = repo.create_tenant("a", now=utcnow())
    default = one(repo, tenant.id, resources={"gpu_mem_gb": 20})
    fail = one(repo, tenant.id, resources={"gpu_mem_gb": 20, "on_oom": "fail"})
    no_rule = one(repo, tenant.id, resources={"gpu_mem_gb": 20, "on_oom": "next_class"})

    # When each attempt runs out of memory, then each fails with oom in gpu24
    assert run_out_of_memory(repo, default) == "failed"
    assert run_out_of_memory(repo, fail) == "failed"
    assert run_out_of_memory(repo, no_rule, rule=None) == "failed"
    for job_id in (default, fail, no_rule):
        job = repo.get_job(tenant.id, job_id)
        assert (job.size_class, job.reason, job.attempts[0].moved_to) == ("gpu24", "oom", None)

    # And a pool whose default is next_class moves a job that says nothing
    moved = one(repo, tenant.id, resources={"gpu_mem_gb": 20})
    assert run_out_of_memory(repo, moved, OomRule.of(DEFAULT_SIZE_CLASSES,
                                                     "next_class")) == "queued"
    assert repo.get_job(tenant.id, moved).size_class == "gpu48"
