"""The watchdog's spec fields, `idle_timeout_s` and `on_idle`, and the reason `idle`: strict
like every other field, off unless asked, and retried like a timeout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from e31.core.errors import SpecError
from e31.core.spec import JobSpec
from e31.core.states import AttemptReason
from e31.edge.settings import Settings

JOB = {"entrypoint": "pkg.mod:main"}


def refused_field(data: dict[str, Any]) -> str:
    with pytest.raises(SpecError) as caught:
        JobSpec.parse(data)
    [entry] = caught.value.errors
    return entry["field"]


def test_a_job_without_the_fields_has_no_idle_timeout_and_would_only_be_flagged() -> None:
    # Given a job that says nothing about idling
    spec = JobSpec.parse(JOB)

    # Then the pool's default applies, and an idle job is flagged, not killed
    assert spec.idle_timeout_s is None
    assert spec.on_idle == "flag"


def test_a_job_may_ask_to_be_killed_after_a_whole_number_of_idle_seconds() -> None:
    spec = JobSpec.parse({**JOB, "idle_timeout_s": 600, "on_idle": "kill"})
    assert (spec.idle_timeout_s, spec.on_idle) == (600, "kill")
    assert JobSpec.parse(spec.model_dump(mode="json")) == spec   # stored and read back


@pytest.mark.parametrize("value", [0, -5, "600", 1.5, True, 10**9])
def test_an_idle_timeout_that_is_no_positive_whole_number_of_seconds_is_refused(
        value: object) -> None:
    assert refused_field({**JOB, "idle_timeout_s": value}) == "idle_timeout_s"


@pytest.mark.parametrize("value", ["restart", "KILL", "", None, 1])
def test_on_idle_is_flag_or_kill_and_nothing_else(value: object) -> None:
    assert refused_field({**JOB, "on_idle": value}) == "on_idle"


def test_an_idle_kill_is_retried_and_counts_against_retries_like_a_timeout() -> None:
    assert AttemptReason.IDLE.is_retryable is AttemptReason.TIMEOUT.is_retryable is True
    assert AttemptReason.IDLE.counts_against_retries is True


def test_the_pools_idle_timeout_is_off_by_default_and_read_from_the_environment(
        tmp_path: Path) -> None:
    assert Settings().idle_timeout_s is None
    environ = {"E31_HOME": str(tmp_path), "E31_IDLE_TIMEOUT_S": "900"}
    assert Settings.load(environ=environ).idle_timeout_s == 900
