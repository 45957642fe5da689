"""Failures that are ours never cost the user (docs/reliability.md, "Whose failure it is"): an
input server that fails for a while, an artifact store that cannot take a job's outputs. Real
HTTP servers on loopback in a thread, the worker's own task body (`run_job`), a real store
and Redis, a real file artifact store."""

from __future__ import annotations

import dataclasses
import socket
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis

from e31.core.clock import utcnow
from e31.core.errors import SetupError, SetupTransient
from e31.core.records import Outcome
from e31.core.states import AttemptReason
from e31.edge.artifacts import ArtifactStore
from e31.store import Repo
from e31_worker.attempt import shipping, task
from e31_worker.attempt.services import AttemptServices
from tests.conftest import wait_for
from tests.integration.test_http_inputs import Quiet, Serving, stage, submit
from tests.integration.test_store import claim, publish
from tests.integration.test_task import services

BODY = b"the input's bytes\n"
LOOPBACK = ("127.0.0.0/8",)


class FlakyServer(Serving):
    """A real HTTP server on 127.0.0.1, in a thread, that answers each GET with the next of
    `statuses` (an empty body), then with 200 and BODY; `asked` counts the GETs."""

    def __init__(self, statuses: list[int]) -> None:
        left = list(statuses)
        self.asked = 0

        server = self

        class Handler(Quiet):
            def do_GET(self) -> None:
                server.asked += 1
                status, body = (left.pop(0), b"") if left else (200, BODY)
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        super().__init__(Handler)
        self.url = f"{self.base}/data"


@pytest.fixture
def worker(repo: Repo, redis_client: redis.Redis, tmp_path: Path) -> AttemptServices:
    """A cpu worker's services on a pool that lets inputs reach the loopback (the test's
    servers), with a file artifact store."""
    svc = services(repo, redis_client, tmp_path, ArtifactStore(f"file://{tmp_path / 'a'}"))
    return dataclasses.replace(svc, settings=svc.settings.model_copy(
        update={"input_allowed_networks": LOOPBACK}))


def run_until_final(svc: AttemptServices, repo: Repo, job_id: str, most: int = 8) -> None:
    """Run the job's attempts as a worker would, one message each, until it ended."""
    for _ in range(most):
        task.run_job(svc, job_id, publish(repo, job_id))
        if repo.get_job(None, job_id).state in ("succeeded", "failed", "cancelled"):
            return
    raise AssertionError(f"job {job_id} did not end in {most} attempts")


def reasons(repo: Repo, job_id: str) -> list[str | None]:
    return [a.reason for a in repo.get_job(None, job_id).attempts]


def copy_job(repo: Repo, source: str, copied: Path, **fields: Any) -> str:
    tenant, _ = repo.create_tenant("team-a", now=utcnow())
    return submit(repo, tenant.id, command=["sh", "-c", f'cat "$E31_INPUT_DIR/m" > {copied}'],
                  inputs={"m": source}, **fields)


def test_an_input_server_that_fails_twice_then_serves_costs_the_user_no_retry(
        worker: AttemptServices, repo: Repo, tmp_path: Path) -> None:
    # Given a job with no retries (retries.max 0) whose input server answers 503 twice
    copied = tmp_path / "copied"
    with FlakyServer([503, 503]) as server:
        job_id = copy_job(repo, server.url, copied, retries={"max": 0, "backoff_s": 0})

        # When workers run it until it ends
        run_until_final(worker, repo, job_id)

    # Then it succeeded: the two 503s were the pool's faults, retried on its account
    record = repo.get_job(None, job_id)
    assert record.state == "succeeded"
    assert reasons(repo, job_id) == ["setup_transient", "setup_transient", "succeeded"]
    assert "503" in (record.attempts[0].error or "")
    assert copied.read_bytes() == BODY and server.asked == 3


def test_an_input_that_is_not_there_stays_the_users_and_final(
        worker: AttemptServices, repo: Repo, tmp_path: Path) -> None:
    # Given a job with retries to spare whose input server answers 404
    copied = tmp_path / "copied"
    with FlakyServer([404]) as server:
        job_id = copy_job(repo, server.url, copied, retries={"max": 3, "backoff_s": 0})

        # When a worker runs it
        task.run_job(worker, job_id, publish(repo, job_id))

    # Then it failed at once with the user's reason `setup`, asked once
    record = repo.get_job(None, job_id)
    assert record.state == "failed" and reasons(repo, job_id) == ["setup"]
    assert record.to_status()["reason"] == "setup" and "404" in (record.error or "")
    assert not copied.exists() and server.asked == 1


def test_a_job_whose_pool_faults_pass_infra_retries_fails_as_the_pools_failure(
        worker: AttemptServices, repo: Repo, tmp_path: Path) -> None:
    # Given a pool whose patience is two faults of its own, and an input server that answers
    # 503 for longer than that
    svc = dataclasses.replace(worker, settings=worker.settings.model_copy(
        update={"infra_retries": 2}))
    with FlakyServer([503] * 5) as server:
        job_id = copy_job(repo, server.url, tmp_path / "copied",
                          retries={"max": 3, "backoff_s": 0})

        # When workers run it until it ends
        run_until_final(svc, repo, job_id)

    # Then it failed after two attempts, with the pool's reason and a text that says the pool
    # failed it; none of the user's three retries was spent
    record = repo.get_job(None, job_id)
    assert record.state == "failed"
    assert reasons(repo, job_id) == ["setup_transient", "setup_transient"]
    status = record.to_status()
    assert status["reason"] == "setup_transient"
    assert status["error"].startswith(
        "the pool failed this job: 2 faults of its own (infra_retries=2); last: setup failed: "
        "inputs.m: cannot read ")
    assert server.asked == 2


def test_outputs_the_artifact_store_cannot_take_end_upload_failed_without_a_user_retry(
        worker: AttemptServices, repo: Repo, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shipping, "UPLOAD_BACKOFF_S", 0.0)
    worker = with_settings(worker, artifacts_wait_s=0.0)   # the wait is over at once
    # Given a job with no retries that writes an output, and a file artifact store where its
    # outputs cannot be written (a file stands where their directory goes)
    tenant, _ = repo.create_tenant("team-a", now=utcnow())
    job_id = submit(repo, tenant.id, command=["sh", "-c", "echo out > $E31_OUTPUT_DIR/x.txt"],
                    retries={"max": 0, "backoff_s": 0})
    blocked = tmp_path / "a" / tenant.id / job_id / "outputs"
    blocked.parent.mkdir(parents=True)
    blocked.write_text("not a directory")

    # When a worker runs it
    task.run_job(worker, job_id, publish(repo, job_id))

    # Then the attempt ended upload_failed, the pool's: the job is queued again, not failed
    record = repo.get_job(None, job_id)
    assert record.state == "queued" and reasons(repo, job_id) == ["upload_failed"]
    assert "outputs could not be stored" in (record.error or "")

    # And once the store takes writes again, its next attempt succeeds with its outputs
    blocked.unlink()
    run_until_final(worker, repo, job_id)
    record = repo.get_job(None, job_id)
    assert record.state == "succeeded"
    assert reasons(repo, job_id) == ["upload_failed", "succeeded"]
    assert record.outputs == [{"path": "x.txt", "size": 4}]
    assert (blocked / "x.txt").read_text() == "out\n"


def held_for_the_store(worker: AttemptServices, repo: Repo, tmp_path: Path,
                       caplog: pytest.LogCaptureFixture) -> tuple[str, str, Path, threading.Thread]:
    """A job with no retries that writes an output, on an artifact store that cannot take it
    (a file stands where its outputs' directory goes), run by `worker` in a thread until the
    worker holds it for the store; returns (tenant, job, the blocking file, the thread)."""
    tenant, _ = repo.create_tenant("team-a", now=utcnow())
    job_id = submit(repo, tenant.id, command=["sh", "-c", "echo out > $E31_OUTPUT_DIR/x.txt"],
                    retries={"max": 0, "backoff_s": 0})
    blocked = tmp_path / "a" / tenant.id / job_id / "outputs"
    blocked.parent.mkdir(parents=True)
    blocked.write_text("not a directory")
    runner = threading.Thread(target=task.run_job, args=(worker, job_id, publish(repo, job_id)))
    runner.start()
    wait_for(lambda: "artifacts_wait " in caplog.text, what="the job held for the artifact store")
    return tenant.id, job_id, blocked, runner


def test_a_succeeded_job_waits_on_its_worker_for_the_artifact_store_and_succeeds_once(
        worker: AttemptServices, repo: Repo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(shipping, "UPLOAD_BACKOFF_S", 0.0)
    worker = with_settings(worker, artifacts_wait_s=60.0, heartbeat_interval_s=0.2)
    # Given a succeeded job held on its worker for an artifact store that cannot take its output
    tenant_id, job_id, blocked, runner = held_for_the_store(worker, repo, tmp_path, caplog)
    assert repo.get_job(None, job_id).state == "running"     # held, its lease renewed

    # When the store takes writes again while the job waits on the worker
    blocked.unlink()
    runner.join(timeout=60)

    # Then its one attempt succeeded with its outputs intact: nothing ran twice, nothing spent
    record = repo.get_job(None, job_id)
    assert record.state == "succeeded" and reasons(repo, job_id) == ["succeeded"]
    assert record.outputs == [{"path": "x.txt", "size": 4}]
    assert (blocked / "x.txt").read_text() == "out\n"
    # And the tenant is charged for the bytes once, not once per try
    assert repo.charge_outputs(tenant_id, [], default_max_bytes=0).used_bytes == 4


def test_a_worker_that_drains_stops_waiting_for_the_artifact_store(
        worker: AttemptServices, repo: Repo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(shipping, "UPLOAD_BACKOFF_S", 0.0)
    worker = with_settings(worker, artifacts_wait_s=600.0, heartbeat_interval_s=0.2)
    # Given a succeeded job waiting on its worker for an artifact store that stays down
    _, job_id, _, runner = held_for_the_store(worker, repo, tmp_path, caplog)

    # When its node drains
    worker.draining.set()
    runner.join(timeout=60)

    # Then the wait ends at once: the attempt is the pool's `upload_failed`, the job queued again
    assert not runner.is_alive()
    record = repo.get_job(None, job_id)
    assert record.state == "queued" and reasons(repo, job_id) == ["upload_failed"]


def with_settings(svc: AttemptServices, **update: Any) -> AttemptServices:
    return dataclasses.replace(svc, settings=svc.settings.model_copy(update=update))


def test_a_failed_job_whose_upload_failed_too_keeps_its_own_reason(

        worker: AttemptServices, repo: Repo, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shipping, "UPLOAD_BACKOFF_S", 0.0)
    # Given a job that writes an output and then fails, on a store that cannot take it
    tenant, _ = repo.create_tenant("team-a", now=utcnow())
    job_id = submit(repo, tenant.id, command=["sh", "-c", "echo o > $E31_OUTPUT_DIR/x; exit 3"])
    blocked = tmp_path / "a" / tenant.id / job_id / "outputs"
    blocked.parent.mkdir(parents=True)
    blocked.write_text("not a directory")

    # When a worker runs it
    task.run_job(worker, job_id, publish(repo, job_id))

    # Then the failure is still the job's own
    record = repo.get_job(None, job_id)
    assert record.state == "failed" and reasons(repo, job_id) == ["error"]


@pytest.mark.parametrize(("status", "transient"), [
    (500, True), (502, True), (503, True), (504, True), (429, True),
    (400, False), (403, False), (404, False),
])
def test_what_failed_decides_whose_setup_failure_it_is(status: int, transient: bool,
                                                       tmp_path: Path) -> None:
    # Given an input server that answers `status` once
    with FlakyServer([status]) as server:
        # When the worker stages the input
        with pytest.raises(SetupError) as failed:
            stage(server.url, tmp_path / "a", LOOPBACK)

    # Then a 5xx or a 429 is the pool's fault that may pass, a 4xx the user's
    assert isinstance(failed.value, SetupTransient) is transient
    assert str(status) in failed.value.message


def test_a_refused_connection_is_transient_and_a_refused_address_is_not(tmp_path: Path) -> None:
    # Given a loopback port where nothing listens
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/data"

    # Then a connection it refuses is the pool's fault that may pass
    with pytest.raises(SetupTransient):
        stage(url, tmp_path / "a", LOOPBACK)

    # But the same URL on a pool that refuses the loopback is the user's (the pool's rule)
    with pytest.raises(SetupError) as refused:
        stage(url, tmp_path / "b")
    assert not isinstance(refused.value, SetupTransient)


def test_a_pool_fault_is_retried_after_the_retry_policys_back_off(repo: Repo) -> None:
    # Given a job with no retries, a back-off of 10 s, whose attempt ended setup_transient
    tenant, _ = repo.create_tenant("team-a", now=utcnow())
    job_id = submit(repo, tenant.id, command=["true"], retries={"max": 0, "backoff_s": 10})
    c = claim(repo, job_id)
    now = utcnow()

    # When the store records it
    state = repo.record_outcome(job_id, c.token, Outcome(AttemptReason.SETUP_TRANSIENT,
                                                         error="setup failed: 503"), now=now)

    # Then the job is queued again, not before the back-off
    assert state is not None and state.value == "queued"
    record = repo.get_job(None, job_id)
    assert record.reason == "setup_transient"
    assert claim(repo, job_id, now=now + timedelta(seconds=9)) is None
    assert claim(repo, job_id, now=now + timedelta(seconds=11)) is not None


def test_a_worker_that_fails_around_a_healthy_job_costs_the_user_no_retry(
        worker: AttemptServices, repo: Repo, tmp_path: Path) -> None:
    # Given a job with no retries, and a worker that cannot make its first attempt's
    # directory (a file stands where it goes: the worker's own fault, not the job's)
    tenant, _ = repo.create_tenant("team-a", now=utcnow())
    marker = tmp_path / "ran"
    job_id = submit(repo, tenant.id, command=["sh", "-c", f"echo ran >> {marker}"],
                    retries={"max": 0, "backoff_s": 0})
    blocked = worker.settings.resolved_work_dir / job_id / "attempt-1"
    blocked.parent.mkdir(parents=True)
    blocked.write_text("not a directory")

    # When workers run it until it ends
    run_until_final(worker, repo, job_id)

    # Then its first attempt ended worker_crashed, the pool's, and its second ran it once
    record = repo.get_job(None, job_id)
    assert record.state == "succeeded"
    assert reasons(repo, job_id) == ["worker_crashed", "succeeded"]
    assert (record.attempts[0].error or "").startswith("worker error: ")
    assert marker.read_text() == "ran\n"
