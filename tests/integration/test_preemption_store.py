"""Preemption in the store (SQLite and PostgreSQL): who may be asked, how the worker learns
it, and what a preempted attempt leaves: requeued, not counted against retries, billed for
the time it ran, its place in the fair order kept."""

from __future__ import annotations

from datetime import timedelta

import pytest

from e31.core.clock import utcnow
from e31.core.records import Outcome
from e31.core.states import AttemptReason, JobState
from e31.store import Repo
from tests.integration.test_store import claim, submit

PREEMPTED = Outcome(AttemptReason.PREEMPTED, error="preempted")


def test_only_a_running_preemptible_job_is_asked_once_and_its_worker_hears_it(
        repo: Repo) -> None:
    tenant, _ = repo.create_tenant("a", now=utcnow())
    trains = submit(repo, tenant.id, entrypoint="e31_worker.workloads.training:run")  # by default
    plain = submit(repo, tenant.id)                             # not by default
    marked = submit(repo, tenant.id, preemptible=True)
    queued = submit(repo, tenant.id, preemptible=True)
    leases = {job.id: claim(repo, job.id) for job in (trains, plain, marked)}

    asked = repo.request_preemption([trains.id, plain.id, marked.id, queued.id], now=utcnow())

    assert sorted(asked) == sorted([trains.id, marked.id])
    assert repo.request_preemption([trains.id], now=utcnow()) == []   # asked already
    for job_id, lease in leases.items():
        renewal = repo.renew(job_id, lease.token, now=utcnow(), lease_ttl_s=10)
        assert renewal.ours and renewal.preempt == (job_id != plain.id)
    assert repo.get_job(None, queued.id).state == JobState.QUEUED.value


def test_a_preempted_attempt_is_requeued_billed_and_not_counted_against_retries(
        repo: Repo) -> None:
    # Given a preemptible job with no retries, running for 40 s, then asked to stop
    tenant, _ = repo.create_tenant("a", now=utcnow())
    job = submit(repo, tenant.id, preemptible=True, retries={"max": 0})
    started = utcnow()
    first = claim(repo, job.id, now=started)
    repo.request_preemption([job.id], now=started + timedelta(seconds=30))

    # When its worker records the attempt as preempted, twice over two attempts
    ended = started + timedelta(seconds=40)
    assert repo.record_outcome(job.id, first.token, PREEMPTED, now=ended) is JobState.QUEUED
    second = claim(repo, job.id, now=ended + timedelta(seconds=1))
    assert second is not None
    # the request was for the first attempt: the second runs on
    assert not repo.renew(job.id, second.token, now=ended + timedelta(seconds=2),
                          lease_ttl_s=10).preempt
    repo.request_preemption([job.id], now=ended + timedelta(seconds=5))
    again = ended + timedelta(seconds=21)
    assert repo.record_outcome(job.id, second.token, PREEMPTED, now=again) is JobState.QUEUED

    # Then it is queued again each time (no retries were allowed), billed for 40 + 20 s,
    # keeps its submission time, and says why it waits
    record = repo.get_job(None, job.id)
    assert record.state == JobState.QUEUED.value and record.reason == "preempted"
    assert [a.reason for a in record.attempts] == ["preempted", "preempted"]
    assert record.gpu_seconds == pytest.approx(60)
    assert record.submitted_at == job.submitted_at

    # And a real failure after them is still its first counted one: no retry left, it fails
    third = claim(repo, job.id, now=again + timedelta(seconds=1))
    assert third is not None
    assert repo.record_outcome(job.id, third.token, Outcome(AttemptReason.ERROR, error="boom"),
                               now=again + timedelta(seconds=2)) is JobState.FAILED


def test_the_scheduler_sees_which_running_jobs_are_preemptible_and_asked(repo: Repo) -> None:
    tenant, _ = repo.create_tenant("a", now=utcnow())
    asked = submit(repo, tenant.id, preemptible=True, priority=3)
    other = submit(repo, tenant.id)
    for job in (asked, other):
        claim(repo, job.id)
    repo.request_preemption([asked.id], now=utcnow())

    view = repo.scheduling_view(now=utcnow(), queues=["e31.gpu24"])

    running = {r.id: r for r in view.running}
    assert (running[asked.id].preemptible, running[asked.id].preempt_requested,
            running[asked.id].priority) == (True, True, 3)
    assert (running[other.id].preemptible, running[other.id].preempt_requested) == (False, False)
