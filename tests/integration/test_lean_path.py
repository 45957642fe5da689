"""The lean control path (issue 11, item 4), on a real store (SQLite and PostgreSQL), a real
artifact store and the suite's redis-server: what a tiny job costs the worker and the API.

- An attempt that leaves no file asks the artifact store for nothing but its log, and its
  claim and outcome run a bounded number of SQL statements; one that leaves an output still
  lists, uploads and records it.
- What an attempt notes of its start (how it started, its limits, its setup's time) goes
  with its next write: its outcome for a job that ends within a beat, no write of its own
  (issue 31), else its lease's first renewal.
- Without the lease check that an attempt with nothing to store now skips, a late outcome is
  still refused by the fence.
- `GET /v1/jobs/{id}?wait_s=N` answers when the job ends: woken by the worker's announcement,
  or, for an end no worker announces (a cancel), by its own read of the store.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import event

from e31.api import create_app, waits
from e31.api.services import Services
from e31.core import keys
from e31.core.clock import utcnow
from e31.core.records import Claim, Outcome
from e31.core.states import AttemptReason
from e31.edge.artifacts import ArtifactStore
from e31.edge.settings import Settings
from e31.store import Repo
from e31.store.attempts import AttemptFacts
from e31_worker.attempt import task
from e31_worker.attempt.record import finish_attempt
from e31_worker.attempt.services import AttemptServices
from e31_worker.attempt.shipping import Shipper, earlier_log_bytes
from e31_worker.attempt.warm import WarmStarter, warm_env
from tests.conftest import wait_for
from tests.integration.test_store import publish
from tests.integration.test_task import services, submit

# Statements other than BEGIN (which only SQLite's driver sees as one), measured on both
# backends. A claim: the UPDATE … RETURNING that takes the job, the one that moves its queued
# time, the INSERT of the attempt. An outcome that ends the job: the job row locked, its
# attempt read and ended, the job moved, its dependants released (_satisfy), 6 in all;
# before the cut it was 11: the lease check (an UPDATE), the outputs' quota (a SELECT and an
# UPDATE of the tenant) and the tally of earlier endings that only a retry needs.
CLAIM_STATEMENTS_MAX = 3
OUTCOME_STATEMENTS_MAX = 6


class CountingStore(ArtifactStore):
    """A real file-backed artifact store that counts the calls a worker makes."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.calls: Counter[str] = Counter()

    def put_file(self, *a: Any, **k: Any) -> int:
        self.calls["put_file"] += 1
        return super().put_file(*a, **k)

    def put_tree(self, *a: Any, **k: Any) -> list[dict[str, Any]]:
        self.calls["put_tree"] += 1
        return super().put_tree(*a, **k)

    def list_outputs(self, *a: Any, **k: Any) -> list[dict[str, Any]]:
        self.calls["list_outputs"] += 1
        return super().list_outputs(*a, **k)

    def log_sizes(self, *a: Any, **k: Any) -> dict[int, int]:
        self.calls["log_sizes"] += 1
        return super().log_sizes(*a, **k)


@contextmanager
def statements(repo: Repo) -> Iterator[list[str]]:
    """The SQL statements run on the repo's engine meanwhile, BEGIN left out."""
    seen: list[str] = []

    def note(_conn: Any, _cur: Any, statement: str, *_: Any) -> None:
        if not statement.lstrip().upper().startswith("BEGIN"):
            seen.append(statement)

    event.listen(repo.engine, "before_cursor_execute", note)
    try:
        yield seen
    finally:
        event.remove(repo.engine, "before_cursor_execute", note)


def _claimed(repo: Repo, svc: AttemptServices, job_id: str) -> tuple[Claim, list[str]]:
    token = publish(repo, job_id)
    with statements(repo) as seen:
        claim = repo.claim(job_id, dispatch_token=token, worker=svc.identity.node, gpus="",
                           gpu_count=0, now=utcnow(), lease_ttl_s=10)
    assert claim is not None
    return claim, seen


def _ended_attempt(svc: AttemptServices, claim: Claim, *, output: bool) -> Shipper:
    """The attempt's directories as its child leaves them: a log, and an output or none."""
    plan = task.attempt_plan(svc, claim)
    plan.make_dirs()
    plan.log_path.write_text("done\n")
    if output:
        (plan.output_dir / "answer.txt").write_text("42\n")
    shipper = Shipper(svc, claim, plan)
    shipper.mark_checkpoints()
    return shipper


def test_an_attempt_without_files_asks_the_store_for_its_log_only_in_few_statements(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given a claimed first attempt whose child ended leaving only its log
    _, job_id = submit(repo, command=["true"])
    store = CountingStore(f"file://{tmp_path / 'a'}")
    svc = services(repo, redis_client, tmp_path, store)
    claim, claim_sql = _claimed(repo, svc, job_id)
    assert earlier_log_bytes(svc, claim) == 0        # a first attempt: no earlier logs to ask
    shipper = _ended_attempt(svc, claim, output=False)

    # When it is shipped and recorded
    with statements(repo) as outcome_sql:
        state = finish_attempt(svc, claim, shipper, Outcome(AttemptReason.SUCCEEDED,
                                                            exit_code=0))

    # Then the job succeeded; the store was asked to keep the log, nothing else; and the
    # claim and the outcome stayed within their statements
    assert state == "succeeded"
    assert store.calls == Counter({"put_file": 1})
    assert len(claim_sql) <= CLAIM_STATEMENTS_MAX, claim_sql
    assert len(outcome_sql) <= OUTCOME_STATEMENTS_MAX, outcome_sql


def test_an_attempt_with_an_output_still_checks_its_lease_and_stores_it(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given a claimed attempt that wrote an output
    tenant_id, job_id = submit(repo, command=["true"])
    store = CountingStore(f"file://{tmp_path / 'a'}")
    svc = services(repo, redis_client, tmp_path, store)
    claim, _ = _claimed(repo, svc, job_id)
    shipper = _ended_attempt(svc, claim, output=True)

    # When it is shipped and recorded
    with statements(repo) as outcome_sql:
        state = finish_attempt(svc, claim, shipper, Outcome(AttemptReason.SUCCEEDED,
                                                            exit_code=0))

    # Then the lease was checked, the quota read, the output listed, uploaded and recorded
    assert state == "succeeded"
    assert store.calls["list_outputs"] == 1 and store.calls["put_tree"] == 1
    assert len(outcome_sql) > OUTCOME_STATEMENTS_MAX
    assert repo.get_job(None, job_id).outputs == [{"path": "answer.txt", "size": 3}]
    assert store.list_outputs(tenant_id, job_id) == [{"path": "answer.txt", "size": 3}]


@pytest.mark.parametrize(("fields", "warm", "start"), [
    ({"entrypoint": "e31_worker.examples:hello"}, True, "warm"),
    ({"command": ["true"]}, False, "cold"),
    ({"entrypoint": "e31_worker.examples:hello"}, False, "cold"),
], ids=["warm-entrypoint", "command", "cold-entrypoint"])
def test_an_attempts_start_goes_with_its_outcome_when_it_ends_within_a_beat(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        fields: dict[str, Any], warm: bool, start: str) -> None:
    # Given a job, and a worker (with a warm process or without) whose first beat comes
    # after the job's end
    _, job_id = submit(repo, **fields)
    svc = services(repo, redis_client, tmp_path, ArtifactStore(f"file://{tmp_path / 'a'}"))
    svc = dataclasses.replace(svc, settings=svc.settings.model_copy(
        update={"heartbeat_interval_s": 600.0}))
    if warm:
        svc = dataclasses.replace(svc, warm=WarmStarter(env=warm_env(os.environ)))
        assert isinstance(svc.warm, WarmStarter)
        svc.warm.start()
        assert svc.warm.wait_ready(60), "the warm process did not start"
    notes: list[AttemptFacts] = []
    monkeypatch.setattr(repo, "note_attempt", lambda job, n, facts: notes.append(facts))
    token = publish(repo, job_id)

    # When the worker runs it
    with statements(repo) as seen:
        try:
            task.run_job(svc, job_id, token)
        finally:
            if isinstance(svc.warm, WarmStarter):
                svc.warm.close()

    # Then it succeeded, and its start, limits and setup time were written by one statement,
    # the outcome's, with no note of their own (two transactions fewer for a cold entrypoint
    # job, one for the others)
    [attempt] = repo.get_job(None, job_id).to_status()["attempts"]
    assert attempt["reason"] == "succeeded", attempt
    assert notes == []
    assert len([q for q in seen if q.lstrip().upper().startswith("UPDATE ATTEMPTS")]) == 1, seen
    assert attempt["start"] == start and attempt["limits"] is not None
    assert attempt["setup_s"] is not None and attempt["isolation"] == "process"


def test_a_running_attempts_start_is_noted_by_its_first_renewal(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given a job that runs for several beats (0.2 s each)
    _, job_id = submit(repo, command=["sleep", "3"])
    svc = services(repo, redis_client, tmp_path, ArtifactStore(f"file://{tmp_path / 'a'}"))
    token = publish(repo, job_id)

    # When its worker runs it
    worker = threading.Thread(target=task.run_job, args=(svc, job_id, token))
    worker.start()
    try:
        # Then its start and limits show while it runs, carried by a renewal of its lease
        def noted() -> dict[str, Any] | None:
            status = repo.get_job(None, job_id).to_status()
            attempts = status["attempts"]
            return status if attempts and attempts[0]["limits"] is not None else None

        status = wait_for(noted, timeout_s=30, what="the attempt's start to be noted")
        assert status["state"] == "running", status
        assert status["attempts"][0]["start"] == "cold"
        assert status["attempts"][0]["setup_s"] is not None
    finally:
        worker.join(timeout=60)
    assert repo.get_job(None, job_id).state == "succeeded"


def test_without_the_lease_check_a_late_outcome_is_still_refused_by_the_fence(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given an attempt without files whose lease expired and was recovered meanwhile
    _, job_id = submit(repo, command=["true"])
    svc = services(repo, redis_client, tmp_path, CountingStore(f"file://{tmp_path / 'a'}"))
    claim, _ = _claimed(repo, svc, job_id)
    shipper = _ended_attempt(svc, claim, output=False)
    repo.expire_leases(now=utcnow() + timedelta(seconds=60), lease_ttl_s=10)

    # When its worker records the success it saw
    state = finish_attempt(svc, claim, shipper, Outcome(AttemptReason.SUCCEEDED, exit_code=0))

    # Then the outcome is refused: the job waits for its next attempt, this one stays lost
    assert state is None
    record = repo.get_job(None, job_id)
    assert record.state == "queued" and [a.reason for a in record.attempts] == ["lost"]


@pytest.fixture
def api(sqlite_repo: Repo, redis_url: str, redis_client: redis.Redis,
        tmp_path: Path) -> Iterator[tuple[TestClient, dict[str, str]]]:
    """The API over SQLite only: what a long poll reads of the store is one SELECT by key."""
    settings = Settings(redis_url=redis_url, home=tmp_path)
    service = Services(settings=settings, repo=sqlite_repo,
                      artifacts=ArtifactStore(f"file://{tmp_path / 'artifacts'}"),
                      redis_client=redis_client)
    _, token = sqlite_repo.create_tenant("team-a", now=utcnow())
    app = create_app(settings, services=service)
    yield TestClient(app), {"Authorization": f"Bearer {token}"}
    app.state.job_ends.close()


def _running(api: tuple[TestClient, dict[str, str]], repo: Repo, r: redis.Redis,
             tmp_path: Path) -> tuple[str, AttemptServices, Claim]:
    """A command job submitted through the API and claimed by a worker: its id, the worker's
    services and the claim."""
    client, headers = api
    job_id = client.post("/v1/jobs", json={"command": ["true"], "resources": {"gpus": 0}},
                         headers=headers).json()["id"]
    svc = services(repo, r, tmp_path, ArtifactStore(f"file://{tmp_path / 'a'}"))
    claim, _ = _claimed(repo, svc, job_id)
    return job_id, svc, claim


def _long_poll(client: TestClient, headers: dict[str, str], job_id: str,
               wait_s: int) -> tuple[threading.Thread, dict[str, Any]]:
    answer: dict[str, Any] = {}

    def ask() -> None:
        r = client.get(f"/v1/jobs/{job_id}", params={"wait_s": wait_s}, headers=headers)
        answer.update(status=r.status_code, body=r.json())

    thread = threading.Thread(target=ask)
    thread.start()
    return thread, answer


def test_a_long_poll_answers_when_the_worker_announces_the_end(
        api: tuple[TestClient, dict[str, str]], sqlite_repo: Repo, redis_client: redis.Redis,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a running job, and a long poll of it that reads the store only every 10 minutes
    monkeypatch.setattr(waits, "RECHECK_S", 600.0)
    client, headers = api
    job_id, svc, claim = _running(api, sqlite_repo, redis_client, tmp_path)
    shipper = _ended_attempt(svc, claim, output=False)
    with statements(sqlite_repo) as seen:
        thread, answer = _long_poll(client, headers, job_id, wait_s=waits.WAIT_MAX_S)
        wait_for(lambda: dict(redis_client.pubsub_numsub(keys.JOB_ENDED)).get(
            keys.JOB_ENDED.encode(), 0) >= 1, what="the API to listen for job ends")
        wait_for(lambda: any("jobs.state" in q for q in seen), what="the poll's first read")

        # When its worker records the end (and announces it)
        state = finish_attempt(svc, claim, shipper, Outcome(AttemptReason.SUCCEEDED,
                                                            exit_code=0))

        # Then the held request answers with the final status; had the announcement not
        # woken it, it would have answered "running" after its WAIT_MAX_S
        thread.join()
    assert state == "succeeded"
    assert answer["status"] == 200 and answer["body"]["state"] == "succeeded"
    # And it read the job's state once, before it waited: the announcement is not read back
    # (a worker announces an end once it is stored, and the answer reads the job anyway)
    assert len([q for q in seen if q.lstrip().startswith("SELECT jobs.state ")]) == 1, seen


def test_a_long_poll_sees_an_end_no_worker_announces_by_reading_the_store(
        api: tuple[TestClient, dict[str, str]], monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a queued job and a long poll of it (no worker: nothing will be announced)
    monkeypatch.setattr(waits, "RECHECK_S", 0.05)
    client, headers = api
    job_id = client.post("/v1/jobs", json={"command": ["true"], "resources": {"gpus": 0}},
                         headers=headers).json()["id"]
    thread, answer = _long_poll(client, headers, job_id, wait_s=waits.WAIT_MAX_S)

    # When its owner cancels it
    assert client.post(f"/v1/jobs/{job_id}/cancel", headers=headers).status_code == 200

    # Then the held request answers with the cancelled status
    thread.join()
    assert answer["status"] == 200 and answer["body"]["state"] == "cancelled"


def test_a_long_poll_past_its_bounds_is_refused_naming_wait_s(
        api: tuple[TestClient, dict[str, str]]) -> None:
    client, headers = api
    job_id = client.post("/v1/jobs", json={"command": ["true"], "resources": {"gpus": 0}},
                         headers=headers).json()["id"]
    for wait_s in (str(waits.WAIT_MAX_S + 1), "-1", "1.5", "x"):
        r = client.get(f"/v1/jobs/{job_id}", params={"wait_s": wait_s}, headers=headers)
        assert r.status_code == 422 and "wait_s" in r.text, (wait_s, r.text)


def test_an_admins_wait_for_an_ended_job_reads_its_row_in_full_once(
        api: tuple[TestClient, dict[str, str]], sqlite_repo: Repo, redis_client: redis.Redis,
        tmp_path: Path) -> None:
    # Given a tenant's job that ended, and an admin's token (which reads any tenant's job)
    client, _ = api
    job_id, svc, claim = _running(api, sqlite_repo, redis_client, tmp_path)
    finish_attempt(svc, claim, _ended_attempt(svc, claim, output=False),
                   Outcome(AttemptReason.SUCCEEDED, exit_code=0))
    _, admin_token = sqlite_repo.create_tenant("ops", admin=True, now=utcnow())

    # When the admin waits for it
    with statements(sqlite_repo) as seen:
        r = client.get(f"/v1/jobs/{job_id}", params={"wait_s": 8},
                       headers={"Authorization": f"Bearer {admin_token}"})

    # Then the answer is the ended job, with its tenant's name; whose job it is was read as
    # one column, its state once, and its row in full once, joined to its tenant's name
    assert r.status_code == 200 and r.json()["state"] == "succeeded"
    assert r.json()["tenant"] == "team-a"
    reads = [" ".join(q.split()).split(" FROM ")[0] for q in seen
             if q.lstrip().startswith("SELECT")]
    assert reads.count("SELECT jobs.tenant_id") == 1, reads
    assert reads.count("SELECT jobs.state") == 1, reads
    assert len([q for q in reads if q.startswith("SELECT jobs.id, jobs.tenant_id")]) == 1, reads
    assert "SELECT tenants.name" not in reads, reads
