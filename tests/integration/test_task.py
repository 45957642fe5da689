"""The worker's task body against a real store and Redis: claim once, record once, keep going."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from e31.core.clock import utcnow
from e31.core.sizeclasses import route
from e31.core.spec import JobSpec
from e31.edge.artifacts import ArtifactStore
from e31.edge.settings import Settings
from e31.ops.heartbeat import WorkerInfo
from e31.store import Repo
from e31_worker.attempt import shipping, task
from e31_worker.attempt.groups import GroupRegistry
from e31_worker.attempt.services import AttemptServices
from tests.integration.test_store import publish


class OutputsFail(ArtifactStore):
    """An artifact store whose output uploads fail, as a full disk or a lost bucket would."""

    def put_tree(self, local_dir: Path, tenant_id: str, job_id: str,
                 prefix: str) -> list[dict[str, Any]]:
        if prefix == "outputs":
            raise OSError(28, "No space left on device")
        return super().put_tree(local_dir, tenant_id, job_id, prefix)


def services(repo: Repo, r: redis.Redis, tmp_path: Path, artifacts: ArtifactStore,
             busy: list[str | None] | None = None) -> AttemptServices:
    """A cpu worker's services, without cgroups; `busy` collects what it says it holds."""
    settings = Settings(redis_url="redis://unused", work_dir=str(tmp_path / "work"),
                        heartbeat_interval_s=0.2, kill_grace_s=1)
    identity = WorkerInfo(node="cpu0@test", queues=("e31.cpu",), gpus="", gpu_count=0,
                          size_class="cpu")
    said = busy if busy is not None else []
    return AttemptServices(settings=settings, identity=identity, repo=repo, artifacts=artifacts,
                           redis=r,
                           groups=GroupRegistry(tmp_path / "work" / ".groups" / "cpu0@test"),
                           cgroups=None, draining=threading.Event(), busy=said.append)


def submit(repo: Repo, **fields: Any) -> tuple[str, str]:
    tenant, _ = repo.create_tenant("t", now=utcnow())
    spec = JobSpec.parse({"resources": {"gpus": 0}, **fields})
    job = repo.insert_job(tenant.id, spec, route(spec, Settings().size_classes), now=utcnow())
    return tenant.id, job.id


def test_a_second_delivery_of_a_finished_job_runs_nothing(repo: Repo, redis_client: redis.Redis,
                                                          tmp_path: Path) -> None:
    marker = tmp_path / "runs"
    _, job_id = submit(repo, command=["sh", "-c", f"echo run >> {marker}"])
    busy: list[str | None] = []
    svc = services(repo, redis_client, tmp_path, ArtifactStore(f"file://{tmp_path / 'a'}"), busy)

    token = publish(repo, job_id)

    task.run_job(svc, job_id, token)
    task.run_job(svc, job_id, token)            # the same message delivered again
    task.run_job(svc, {"not": "an id"}, token)  # a malformed message

    assert marker.read_text() == "run\n"
    record = repo.get_job(None, job_id)
    assert record.state == "succeeded" and len(record.attempts) == 1
    assert busy == [job_id, None]        # the node's heartbeat heard of the one run only


def test_outputs_that_cannot_be_stored_fail_the_attempt_with_that_reason(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shipping, "UPLOAD_BACKOFF_S", 0.0)
    tenant_id, job_id = submit(repo, command=["sh", "-c", "echo hi; echo x > $E31_OUTPUT_DIR/x"])
    artifacts = OutputsFail(f"file://{tmp_path / 'a'}")

    svc = services(repo, redis_client, tmp_path, artifacts)
    svc = dataclasses.replace(svc, settings=svc.settings.model_copy(
        update={"artifacts_wait_s": 0.0}))     # no wait on the worker for the store's return
    task.run_job(svc, job_id, publish(repo, job_id))

    record = repo.get_job(None, job_id)
    # The artifact store's fault, the pool's (issue 27): the job is queued again, its
    # retries.max (0) unspent
    assert record.state == "queued" and record.attempts[0].reason == "upload_failed"
    assert "outputs could not be stored" in record.error and "No space left" in record.error
    log = artifacts.log_view(tenant_id, job_id, 1)
    assert b"".join(log.read(0, log.size_bytes)) == b"hi\n"  # the log still made it


class OutputsFailOnce(ArtifactStore):
    """The first output upload fails, as a blip of the object store would."""

    failed = False

    def put_tree(self, local_dir: Path, tenant_id: str, job_id: str,
                 prefix: str) -> list[dict[str, Any]]:
        if prefix == "outputs" and not self.failed:
            self.failed = True
            raise OSError("transient")
        return super().put_tree(local_dir, tenant_id, job_id, prefix)


def test_an_upload_that_succeeds_on_retry_keeps_the_job_succeeded(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shipping, "UPLOAD_BACKOFF_S", 0.0)
    _, job_id = submit(repo, command=["sh", "-c", "echo x > $E31_OUTPUT_DIR/x.txt"])

    artifacts = OutputsFailOnce(f"file://{tmp_path / 'a'}")
    task.run_job(services(repo, redis_client, tmp_path, artifacts), job_id, publish(repo, job_id))

    record = repo.get_job(None, job_id)
    assert record.state == "succeeded" and record.outputs == [{"path": "x.txt", "size": 2}]
    job_dir = tmp_path / "work" / job_id
    assert not job_dir.exists() or not any(job_dir.iterdir())


# Renewed every 0.2 s, a 2.5 s lease survives a 2 s stall of a busy CI machine (a 1 s one did
# not: the timeout was fenced off as `lost` on PostgreSQL), and the 5 s grace still outlives it.
GRACE_TEST_LEASE_S = 2.5


@pytest.mark.parametrize("renew_in_grace", [True, False])
def test_a_job_that_ignores_sigterm_at_its_timeout_ends_once_as_a_timeout(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, renew_in_grace: bool) -> None:
    """The kill grace (5 s) outlives the lease TTL (2.5 s): the lease is renewed through the
    grace, so the attempt is recorded once with reason `timeout`. Without the renewal (the
    control), the lease lapses during the grace and the outcome is fenced off: the bug this
    guards against, where such a job ended `lost` and then as a poison job."""
    _, job_id = submit(repo, command=["sh", "-c", "trap '' TERM; sleep 30"], timeout_s=1)
    svc = services(repo, redis_client, tmp_path, ArtifactStore(f"file://{tmp_path / 'a'}"))
    svc = dataclasses.replace(svc, settings=svc.settings.model_copy(
        update={"lease_ttl_s": GRACE_TEST_LEASE_S, "kill_grace_s": 2 * GRACE_TEST_LEASE_S}))
    if not renew_in_grace:
        from e31_worker.attempt.supervisor import Supervisor
        monkeypatch.setattr(Supervisor, "_wait_out_grace",
                            lambda self, proc, why: time.sleep(self._plan.kill_grace_s))

    stop = threading.Event()

    def reconciler() -> None:   # the scheduler's sweep of expired leases, as in a real pool
        while not stop.wait(0.2):
            repo.expire_leases(now=utcnow(), lease_ttl_s=GRACE_TEST_LEASE_S)

    sweeper = threading.Thread(target=reconciler, daemon=True)
    sweeper.start()
    try:
        task.run_job(svc, job_id, publish(repo, job_id))
    finally:
        stop.set()
        sweeper.join()

    record = repo.get_job(None, job_id)
    if renew_in_grace:
        assert (record.state, record.reason) == ("failed", "timeout")
        assert [a.reason for a in record.attempts] == ["timeout"]
    else:   # the lease lapsed in the grace: the attempt was taken as lost, the timeout fenced
        assert [a.reason for a in record.attempts] == ["lost"]
        assert record.state == "queued"
