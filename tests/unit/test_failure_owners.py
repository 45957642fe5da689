"""Whose failure an attempt's ending is (e31.core.states.REASONS), and what the store makes of
it (`_next_state`): only the user's endings spend `retries.max`; the pool's own faults are
retried on its account up to `infra_retries`, then fail with a text that says the pool failed
the job; lost, drained and preempted attempts keep their own rules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from e31.core.records import Outcome
from e31.core.retries import RetryPolicy
from e31.core.states import REASONS, AttemptReason, Cap, JobState, Owner
from e31.edge.settings import Settings
from e31.store.attempts import Tally, _backoff_s, _next_state
from e31.store.models import Job

# How today's reasons went on before the table (main at 6e80b6c): retried?, spends retries.max?
BEFORE_THE_TABLE = {
    "succeeded": (False, False), "cancelled": (False, False), "setup": (False, False),
    "error": (True, True), "timeout": (True, True), "oom": (True, True), "idle": (True, True),
    "disk_quota": (True, True), "lost": (True, False), "drained": (True, False),
    "preempted": (True, False),
}


def job(**retries: Any) -> Job:
    return Job(spec={"retries": retries}, cancel_requested=False)


def test_every_reason_has_one_row_and_an_owner() -> None:
    # Given the table of attempt endings
    # Then every reason is in it, each with an owner and a cap
    assert set(REASONS) == set(AttemptReason)
    assert all(isinstance(rule.owner, Owner) and isinstance(rule.cap, Cap)
               for rule in REASONS.values())


@pytest.mark.parametrize("reason", sorted(BEFORE_THE_TABLE))
def test_todays_reasons_go_on_as_before_the_table(reason: str) -> None:
    # Given a reason that existed before the table
    r = AttemptReason(reason)
    # Then whether it is retried and whether it spends retries.max are what they were
    assert (r.is_retryable, r.counts_against_retries) == BEFORE_THE_TABLE[reason]


@pytest.mark.parametrize("reason", list(AttemptReason))
def test_only_the_users_endings_spend_retries_max(reason: AttemptReason) -> None:
    if reason.counts_against_retries:
        assert reason.owner is Owner.USER and REASONS[reason].cap is Cap.RETRIES_MAX
    if reason.owner is Owner.POOL:
        assert not reason.counts_against_retries and reason.is_retryable


@pytest.mark.parametrize("reason", [AttemptReason.SETUP_TRANSIENT, AttemptReason.UPLOAD_FAILED,
                                    AttemptReason.WORKER_CRASHED, AttemptReason.GPU_FAULT])
def test_the_pools_own_faults_are_its_and_capped_by_infra_retries(reason: AttemptReason) -> None:
    assert reason.owner is Owner.POOL
    assert reason.is_retryable and not reason.counts_against_retries
    assert reason.is_infra_fault


@pytest.mark.parametrize("reason", [AttemptReason.LOST, AttemptReason.DRAINED,
                                    AttemptReason.PREEMPTED])
def test_lost_drained_and_preempted_are_the_pools_but_not_capped_by_infra_retries(
        reason: AttemptReason) -> None:
    assert reason.owner is Owner.POOL and not reason.is_infra_fault


def test_a_setup_failure_stays_the_users_and_final() -> None:
    assert AttemptReason.SETUP.owner is Owner.USER and not AttemptReason.SETUP.is_retryable


def test_a_pool_fault_requeues_a_job_without_retries() -> None:
    # Given a job with no retries of its own, whose attempt ended for a fault of the pool's
    outcome = Outcome(AttemptReason.SETUP_TRANSIENT, error="setup failed: 503")

    # When it is the first, and the fourth, of the pool's five
    # Then the job is queued again: its retries.max is not spent
    for n in (1, 4):
        assert _next_state(job(max=0), outcome, Tally(infra=n), 5) == (
            JobState.QUEUED, "setup failed: 503")


def test_a_job_that_exhausts_the_pools_patience_fails_with_the_pools_text() -> None:
    # Given the fifth fault of the pool's own, with infra_retries = 5
    outcome = Outcome(AttemptReason.UPLOAD_FAILED, error="the job succeeded but ...")

    # When the store decides
    state, error = _next_state(job(max=10), outcome, Tally(infra=5), 5)

    # Then the job fails, and its error says the pool failed it (its own retries left or not)
    assert state is JobState.FAILED
    assert error == ("the pool failed this job: 5 faults of its own (infra_retries=5); "
                     "last: the job succeeded but ...")


def test_the_users_failures_and_the_pools_faults_are_counted_apart() -> None:
    # Given a job with one retry, which spent it already, and two pool faults
    counts = Tally(failures=2, infra=2)
    # Then a further pool fault still requeues it, and a further user failure fails it
    assert _next_state(job(max=1), Outcome(AttemptReason.SETUP_TRANSIENT), counts, 5)[0] \
        is JobState.QUEUED
    assert _next_state(job(max=1), Outcome(AttemptReason.ERROR), counts, 5)[0] \
        is JobState.FAILED


def test_lost_keeps_its_own_poison_cap_whatever_infra_retries() -> None:
    outcome = Outcome(AttemptReason.LOST, error="lease expired")
    assert _next_state(job(max_lost=3), outcome, Tally(lost=2, infra=9), 1)[0] \
        is JobState.QUEUED
    state, error = _next_state(job(max_lost=3), outcome, Tally(lost=3), 100)
    assert state is JobState.FAILED and error is not None and error.startswith("poison job")


@pytest.mark.parametrize("reason", [AttemptReason.DRAINED, AttemptReason.PREEMPTED])
def test_drained_and_preempted_are_never_capped(reason: AttemptReason) -> None:
    assert _next_state(job(max=0), Outcome(reason), Tally(infra=99, lost=99), 1)[0] \
        is JobState.QUEUED


def test_the_pools_faults_back_off_by_their_own_count() -> None:
    # Given a job that spent no retry of its own, and a policy of 10 s doubling
    retries = RetryPolicy(backoff_s=10, backoff_max_s=600)
    # Then its third pool fault waits 40 s; a loss waits not at all
    assert _backoff_s(retries, AttemptReason.SETUP_TRANSIENT, Tally(infra=3)) == 40
    assert _backoff_s(retries, AttemptReason.ERROR, Tally(failures=1, infra=3)) == 10
    assert _backoff_s(retries, AttemptReason.LOST, Tally(lost=2)) == 0


def test_infra_retries_is_a_setting_with_a_default(tmp_path: Path) -> None:
    assert Settings().infra_retries == 5
    s = Settings.load(environ={"E31_HOME": str(tmp_path), "E31_INFRA_RETRIES": "2"})
    assert s.infra_retries == 2
