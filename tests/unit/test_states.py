"""Job states, the one transitions table, and which attempt endings count against retries."""

from __future__ import annotations

import pytest

from e31.core.states import FINAL_STATES, TRANSITIONS, AttemptReason, JobState, can_transition


def test_the_transitions_table_covers_every_state() -> None:
    # Given the job states
    # When the table is read
    # Then each state has an entry
    assert set(TRANSITIONS) == set(JobState)


@pytest.mark.parametrize("final", [JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED])
def test_a_final_state_has_no_exits(final: JobState) -> None:
    # Given a finished job
    # When any move is asked for
    # Then none is allowed
    assert final.is_final
    assert TRANSITIONS[final] == frozenset()
    assert not any(can_transition(final, dst) for dst in JobState)


def test_exactly_succeeded_failed_and_cancelled_are_final() -> None:
    assert FINAL_STATES == {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
    assert not JobState.QUEUED.is_final
    assert not JobState.RUNNING.is_final


def test_a_status_string_is_tested_against_the_final_states_as_it_is() -> None:
    # Given states as a client reads them from a status dict
    # Then the one set of final states answers for the plain strings too
    assert {"succeeded", "failed", "cancelled"} <= FINAL_STATES
    assert "queued" not in FINAL_STATES and "running" not in FINAL_STATES


def test_a_queued_job_may_start_running() -> None:
    assert can_transition(JobState.QUEUED, JobState.RUNNING)


def test_a_queued_job_ends_only_by_being_cancelled() -> None:
    # Given a job that never ran
    # Then it cannot succeed or fail without running; it can only be cancelled
    assert [s for s in JobState if can_transition(JobState.QUEUED, s) and s.is_final] == [
        JobState.CANCELLED]


def test_a_queued_job_cannot_succeed_without_running() -> None:
    assert not can_transition(JobState.QUEUED, JobState.SUCCEEDED)


def test_a_succeeded_job_cannot_run_again() -> None:
    assert not can_transition(JobState.SUCCEEDED, JobState.RUNNING)


def test_a_running_job_may_go_back_to_queued_for_a_retry() -> None:
    assert can_transition(JobState.RUNNING, JobState.QUEUED)


@pytest.mark.parametrize("live", [JobState.QUEUED, JobState.RUNNING])
def test_a_live_job_may_be_cancelled(live: JobState) -> None:
    assert can_transition(live, JobState.CANCELLED)


def test_states_are_their_wire_strings() -> None:
    # Given the states as stored and sent
    # Then each is a str equal to its lower-case name
    assert [s.value for s in JobState] == ["queued", "running", "succeeded", "failed", "cancelled"]
    assert JobState("running") is JobState.RUNNING
    assert JobState.QUEUED == "queued"


@pytest.mark.parametrize(("reason", "counted"), [
    (AttemptReason.ERROR, True), (AttemptReason.TIMEOUT, True), (AttemptReason.OOM, True),
    (AttemptReason.SUCCEEDED, False), (AttemptReason.CANCELLED, False),
    (AttemptReason.LOST, False), (AttemptReason.DRAINED, False),
])
def test_only_errors_timeouts_and_ooms_count_against_retries(reason: AttemptReason,
                                                             counted: bool) -> None:
    assert reason.counts_against_retries is counted


@pytest.mark.parametrize("reason", [AttemptReason.LOST, AttemptReason.DRAINED])
def test_a_lost_or_drained_attempt_is_retried_without_spending_a_retry(
        reason: AttemptReason) -> None:
    # Given an attempt ended by infrastructure, not by the job
    # Then it is retried, and it is not the user's failure
    assert reason.is_retryable
    assert not reason.counts_against_retries


@pytest.mark.parametrize("reason", [AttemptReason.ERROR, AttemptReason.TIMEOUT])
def test_an_error_or_timeout_is_retryable(reason: AttemptReason) -> None:
    assert reason.is_retryable


@pytest.mark.parametrize("reason", [AttemptReason.SUCCEEDED, AttemptReason.CANCELLED])
def test_a_success_or_a_cancel_is_not_retried(reason: AttemptReason) -> None:
    assert not reason.is_retryable
