"""`JobRecord.to_status`: the status dict of the public contract (`job.status()`)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from e31.core.records import AttemptRecord, JobRecord

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)

CONTRACT_KEYS = {"id", "name", "state", "size_class", "queue", "submitted_at", "started_at",
                 "ended_at", "gpu_seconds", "result", "attempts"}
ATTEMPT_KEYS = {"n", "worker", "gpus", "started_at", "ended_at", "reason"}


def record(**changes: object) -> JobRecord:
    attempt1 = AttemptRecord(n=1, worker="gpu0@h", gpus="0,1", gpu_count=2, started_at=T0,
                             ended_at=T0 + timedelta(seconds=30), reason="lost", error=None,
                             exit_code=None)
    attempt2 = AttemptRecord(n=2, worker="gpu2@h", gpus="2,3", gpu_count=2,
                             started_at=T0 + timedelta(seconds=40),
                             ended_at=T0 + timedelta(seconds=100), reason="succeeded", error=None,
                             exit_code=0)
    values: dict[str, object] = dict(
        id="j-1", tenant="acme", name="finetune", spec={"entrypoint": "m:f"}, state="succeeded",
        size_class="gpu24", queue="e31.gpu24.x2", gpus=2, priority=5, reason=None, error=None,
        result={"loss": 0.1}, submitted_at=T0 - timedelta(seconds=5), started_at=T0,
        ended_at=T0 + timedelta(seconds=100), not_before=None, gpu_seconds=180.00049,
        run_seconds=90.0, queued_seconds=5.0, progress_done=None, progress_total=None,
        outputs=[], attempts=[attempt1, attempt2])
    values.update(changes)
    return JobRecord(**values)  # type: ignore[arg-type]


def test_the_status_has_every_key_of_the_public_contract() -> None:
    # Given a finished job with two attempts
    # When its status is built
    status = record().to_status()

    # Then every contract key is there, and every attempt has its keys
    assert CONTRACT_KEYS <= set(status)
    assert len(status["attempts"]) == 2
    for attempt in status["attempts"]:
        assert ATTEMPT_KEYS <= set(attempt)


def test_the_status_carries_the_records_values_with_iso_times() -> None:
    # Given a finished job
    # When its status is built
    status = record().to_status()

    # Then the values are the record's, times as ISO 8601 text
    assert (status["id"], status["name"], status["state"]) == ("j-1", "finetune", "succeeded")
    assert (status["size_class"], status["queue"]) == ("gpu24", "e31.gpu24.x2")
    assert status["submitted_at"] == "2025-03-01T11:59:55+00:00"
    assert status["started_at"] == "2025-03-01T12:00:00+00:00"
    assert status["ended_at"] == "2025-03-01T12:01:40+00:00"
    assert status["gpu_seconds"] == 180.0
    assert status["result"] == {"loss": 0.1}
    assert status["attempts"][0] == {
        "n": 1, "worker": "gpu0@h", "gpus": "0,1", "started_at": "2025-03-01T12:00:00+00:00",
        "ended_at": "2025-03-01T12:00:30+00:00", "reason": "lost", "error": None, "exit_code": None,
        "isolation": None, "start": None, "start_ms": None, "setup_s": None,
        "gpu_mem_peak_gb": None, "gpu_util_mean": None, "idle_since": None, "moved_to": None,
        "limits": None}
    assert status["attempts"][1]["n"] == 2 and status["attempts"][1]["reason"] == "succeeded"
    assert status["idle_since"] is None


def test_a_queued_job_has_null_times_and_no_attempts() -> None:
    # Given a job that has not started
    rec = record(state="queued", started_at=None, ended_at=None, result=None, gpu_seconds=0.0,
                 attempts=[])

    # When its status is built
    status = rec.to_status()

    # Then its start and end are null and it has no attempts
    assert status["state"] == "queued"
    assert status["started_at"] is None and status["ended_at"] is None
    assert status["attempts"] == []
    assert status["progress"] is None


def test_a_running_job_reports_its_progress() -> None:
    rec = record(state="running", ended_at=None, progress_done=3.0, progress_total=10.0)
    assert rec.to_status()["progress"] == {"done": 3.0, "total": 10.0}


def test_the_status_is_plain_json() -> None:
    # Given a finished job
    # When its status is serialised
    text = json.dumps(record().to_status())

    # Then it round-trips without custom encoders
    assert json.loads(text)["attempts"][1]["worker"] == "gpu2@h"


def test_a_running_job_shows_when_its_watchdog_flagged_its_attempt_idle() -> None:
    # Given a running job whose current attempt was flagged idle
    idle = AttemptRecord(n=1, worker="gpu0@h", gpus="0", gpu_count=1, started_at=T0,
                         ended_at=None, reason=None, error=None, exit_code=None,
                         idle_since=T0 + timedelta(seconds=60))

    # When its status is built, running and once it ended
    running = record(state="running", ended_at=None, result=None, attempts=[idle]).to_status()
    ended = record(state="failed", attempts=[idle]).to_status()

    # Then the running job carries the flag, the ended one only on its attempt
    assert running["idle_since"] == "2025-03-01T12:01:00+00:00"
    assert running["attempts"][0]["idle_since"] == "2025-03-01T12:01:00+00:00"
    assert ended["idle_since"] is None
    assert ended["attempts"][0]["idle_since"] == "2025-03-01T12:01:00+00:00"
