"""Facts a worker notes on an attempt (`Repo.note_attempt`), on real SQLite and PostgreSQL:
set once, shown in the job's status, and never made up where not known."""

from __future__ import annotations

import pytest

from e31.core.clock import utcnow
from e31.core.errors import StoreError
from e31.core.sizeclasses import route
from e31.core.spec import JobSpec
from e31.core.states import Isolation, Start
from e31.edge.settings import Settings
from e31.store import Repo
from e31.store.attempts import AttemptFacts

CLASSES = Settings().size_classes


def running_job(repo: Repo, tenant_name: str = "team-a", *,
                gpus: int | None = None) -> tuple[str, str, int]:
    """A claimed job (of `gpus` GPUs when given): (tenant id, job id, attempt number)."""
    tenant, _ = repo.create_tenant(tenant_name, now=utcnow())
    resources = {} if gpus is None else {"resources": {"gpus": gpus}}
    spec = JobSpec.parse({"entrypoint": "pkg.mod:main", **resources})
    job = repo.insert_job(tenant.id, spec, route(spec, CLASSES), now=utcnow())
    token = repo.mark_dispatched([job.id], now=utcnow())[job.id]
    claim = repo.claim(job.id, dispatch_token=token, worker="gpu0@test", gpus="0", gpu_count=1,
                       now=utcnow(), lease_ttl_s=10)
    assert claim is not None
    return tenant.id, job.id, claim.attempt


def test_an_attempts_facts_are_null_until_its_worker_notes_them(repo: Repo) -> None:
    # Given a running attempt that noted nothing
    tenant_id, job_id, _ = running_job(repo)

    # Then its status shows every fact as not known
    [attempt] = repo.get_job(tenant_id, job_id).to_status()["attempts"]
    for key in ("isolation", "start", "start_ms", "setup_s", "gpu_mem_peak_gb", "gpu_util_mean"):
        assert attempt[key] is None


def test_notes_set_only_the_facts_they_carry(repo: Repo) -> None:
    # Given a running attempt
    tenant_id, job_id, n = running_job(repo)

    # When its worker notes how it started, and then (the environment builder) its setup time
    assert repo.note_attempt(job_id, n, AttemptFacts(isolation=Isolation.SANDBOX,
                                                     start=Start.COLD, start_ms=12.5))
    assert repo.note_attempt(job_id, n, AttemptFacts(setup_s=3.25))

    # Then the status shows both notes, the second leaving the first's facts alone
    [attempt] = repo.get_job(tenant_id, job_id).to_status()["attempts"]
    assert (attempt["isolation"], attempt["start"], attempt["start_ms"]) == ("sandbox", "cold",
                                                                             12.5)
    assert attempt["setup_s"] == 3.25
    assert attempt["gpu_mem_peak_gb"] is None


def test_a_note_for_no_such_attempt_says_so_and_a_negative_time_is_refused(repo: Repo) -> None:
    # Given a running attempt
    _, job_id, n = running_job(repo)

    # Then a note for an attempt that does not exist writes nothing, and a negative time fails
    assert not repo.note_attempt(job_id, n + 1, AttemptFacts(isolation=Isolation.PROCESS))
    with pytest.raises(StoreError, match="setup_s"):
        repo.note_attempt(job_id, n, AttemptFacts(setup_s=-1.0))
