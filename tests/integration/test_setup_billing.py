"""Setup is never billed: an attempt's GPU-seconds and run time start where its setup (code,
environment, inputs: `setup_s`, noted by its worker) ended, whether the attempt ends with an
outcome or is lost with its worker. The worker's note goes with its next write (a renewal or
the outcome, `AttemptNote`), as `e31_worker.attempt.notes` sends it; in the outcome's
transaction it is set before the bill is reckoned. Real SQLite and PostgreSQL, times given
exactly."""

from __future__ import annotations

from datetime import timedelta

from e31.core.clock import utcnow
from e31.core.records import Claim, Outcome
from e31.core.sizeclasses import route
from e31.core.spec import JobSpec
from e31.core.states import AttemptReason
from e31.edge.settings import Settings
from e31.store import Repo
from e31.store.attempts import AttemptFacts, AttemptNote

CLASSES = Settings().size_classes
LEASE_TTL_S = 10.0


def claimed(repo: Repo, *, gpus: int, retries: int = 0) -> tuple[str, Claim]:
    """A job of `gpus` GPUs claimed now: (its tenant's id, its claim)."""
    tenant, _ = repo.create_tenant("team-a", now=utcnow())
    spec = JobSpec.parse({"command": ["python", "train.py"], "resources": {"gpus": gpus},
                          "retries": {"max": retries}})
    job = repo.insert_job(tenant.id, spec, route(spec, CLASSES), now=utcnow())
    token = repo.mark_dispatched([job.id], now=utcnow())[job.id]
    claim = repo.claim(job.id, dispatch_token=token, worker="gpu0@test", gpus="0,1",
                       gpu_count=gpus, now=utcnow(), lease_ttl_s=LEASE_TTL_S)
    assert claim is not None
    return tenant.id, claim


def test_an_attempts_bill_leaves_out_its_setup(repo: Repo) -> None:
    # Given a 2-GPU attempt whose setup took 4 s, which no renewal carried (it ran less
    # than a beat)
    tenant_id, claim = claimed(repo, gpus=2)
    [attempt] = repo.get_job(tenant_id, claim.job_id).attempts

    # When it succeeds 10 s after it was claimed, its outcome carrying the note
    repo.record_outcome(claim.job_id, claim.token, Outcome(AttemptReason.SUCCEEDED),
                        now=attempt.started_at + timedelta(seconds=10),
                        note=AttemptNote(claim.attempt, AttemptFacts(setup_s=4.0)))

    # Then it is billed for the 6 s it ran, on each GPU
    status = repo.get_job(tenant_id, claim.job_id).to_status()
    assert status["gpu_seconds"] == 12.0
    assert status["run_seconds"] == 6.0
    assert status["attempts"][0]["setup_s"] == 4.0


def test_a_lost_attempt_is_billed_from_the_end_of_its_setup_too(repo: Repo) -> None:
    # Given a 1-GPU attempt whose setup took 3 s, then whose worker died
    tenant_id, claim = claimed(repo, gpus=1)
    [attempt] = repo.get_job(tenant_id, claim.job_id).attempts
    repo.renew(claim.job_id, claim.token, now=attempt.started_at + timedelta(seconds=4),
               lease_ttl_s=LEASE_TTL_S,
               note=AttemptNote(claim.attempt, AttemptFacts(setup_s=3.0)))
    repo.renew(claim.job_id, claim.token, now=attempt.started_at + timedelta(seconds=5),
               lease_ttl_s=LEASE_TTL_S)

    # When its lease expires and the scheduler recovers it
    repo.expire_leases(now=attempt.started_at + timedelta(seconds=60), lease_ttl_s=LEASE_TTL_S)

    # Then it is billed up to its last renewal, less its setup
    status = repo.get_job(tenant_id, claim.job_id).to_status()
    assert status["attempts"][0]["reason"] == "lost"
    assert status["gpu_seconds"] == 2.0


def test_an_attempt_that_failed_in_its_setup_bills_nothing(repo: Repo) -> None:
    # Given an attempt with retries to spare that spent its whole life in setup (a requirement
    # did not install)
    tenant_id, claim = claimed(repo, gpus=1, retries=3)
    [attempt] = repo.get_job(tenant_id, claim.job_id).attempts

    # When it fails with reason setup just after, its outcome carrying the setup's time
    state = repo.record_outcome(claim.job_id, claim.token,
                                Outcome(AttemptReason.SETUP, error="setup failed: no such pkg"),
                                now=attempt.started_at + timedelta(seconds=7.5),
                                note=AttemptNote(claim.attempt, AttemptFacts(setup_s=7.5)))

    # Then the job failed at once (no retry) and nothing was billed
    status = repo.get_job(tenant_id, claim.job_id).to_status()
    assert state is not None and state.value == "failed"
    assert (status["reason"], status["gpu_seconds"], status["run_seconds"]) == ("setup", 0.0, 0.0)


def test_a_fenced_outcome_still_writes_its_attempts_note(repo: Repo) -> None:
    # Given an attempt whose lease expired and was recovered while it ran
    tenant_id, claim = claimed(repo, gpus=1, retries=3)
    [attempt] = repo.get_job(tenant_id, claim.job_id).attempts
    repo.expire_leases(now=attempt.started_at + timedelta(seconds=60), lease_ttl_s=LEASE_TTL_S)

    # When its worker offers its outcome with what it noted of its start
    state = repo.record_outcome(claim.job_id, claim.token, Outcome(AttemptReason.SUCCEEDED),
                                now=attempt.started_at + timedelta(seconds=61),
                                note=AttemptNote(claim.attempt,
                                                 AttemptFacts(setup_s=2.0, start_ms=12.5)))

    # Then the fence refuses the outcome, and the attempt's note is written all the same:
    # it says how that attempt ran, whoever recorded its end
    assert state is None
    [lost] = repo.get_job(tenant_id, claim.job_id).to_status()["attempts"]
    assert (lost["reason"], lost["setup_s"], lost["start_ms"]) == ("lost", 2.0, 12.5)
