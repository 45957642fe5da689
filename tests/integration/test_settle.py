"""A restarted worker settles what its dead predecessor left on the node: a finished
attempt is recorded (no second run), a fenced one stores nothing, an unfinished one is
only cleaned up."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import redis

from e31.core.clock import utcnow
from e31.core.records import Claim
from e31.core.spec import JobSpec
from e31.edge.artifacts import ArtifactStore
from e31.store import Repo
from e31_worker.attempt import task
from e31_worker.attempt.record import CLAIM_FILE, claim_from_file_data, write_claim
from e31_worker.attempt.services import AttemptServices
from e31_worker.attempt.settle import settle_left_attempts
from tests.integration.test_store import publish
from tests.integration.test_task import services, submit


def _left_behind(svc: AttemptServices, repo: Repo, job_id: str, *, result: object | None,
                 node: str | None = None):
    """A claimed attempt directory as a worker process leaves it when SIGKILLed."""
    claim = repo.claim(job_id, dispatch_token=publish(repo, job_id), worker=svc.identity.node,
                       gpus="", gpu_count=0, now=utcnow(), lease_ttl_s=10)
    assert claim is not None
    plan = task.attempt_plan(svc, claim)
    for d in (plan.work_dir, plan.output_dir, plan.checkpoint_dir):
        d.mkdir(parents=True, exist_ok=True)
    write_claim(plan.root, node or svc.identity.node, claim)
    if result is not None:
        (plan.output_dir / "answer.txt").write_text("42\n")
        (plan.root / "result.json").write_text(json.dumps({"result": result}))
    return plan


def test_a_finished_attempt_of_a_dead_worker_is_recorded_by_its_successor_without_a_rerun(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given a job whose code returned, and whose worker died before recording it
    tenant_id, job_id = submit(repo, entrypoint="pkg.mod:main")
    artifacts = ArtifactStore(f"file://{tmp_path / 'a'}")
    svc = services(repo, redis_client, tmp_path, artifacts)
    plan = _left_behind(svc, repo, job_id, result={"answer": 42})

    # When the worker process that replaces it starts
    settled = settle_left_attempts(svc)

    # Then the outcome is recorded with the old token, the outputs stored, the dir removed
    assert settled == 1
    record = repo.get_job(None, job_id)
    assert record.state == "succeeded" and record.result == {"answer": 42}
    assert [a.reason for a in record.attempts] == ["succeeded"]
    assert [o["path"] for o in artifacts.list_outputs(tenant_id, job_id)] == ["answer.txt"]
    assert not plan.root.exists()


def test_a_finished_attempt_whose_job_was_recovered_elsewhere_stores_nothing(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given a finished attempt left behind, whose lease the scheduler already expired
    tenant_id, job_id = submit(repo, entrypoint="pkg.mod:main")
    artifacts = ArtifactStore(f"file://{tmp_path / 'a'}")
    svc = services(repo, redis_client, tmp_path, artifacts)
    _left_behind(svc, repo, job_id, result={"answer": 42})
    repo.expire_leases(now=utcnow() + timedelta(seconds=60), lease_ttl_s=10)

    # When the successor starts
    settle_left_attempts(svc)

    # Then the fence refuses the late outcome, and no file of the losing copy is stored
    record = repo.get_job(None, job_id)
    assert record.state == "queued" and [a.reason for a in record.attempts] == ["lost"]
    assert artifacts.list_outputs(tenant_id, job_id) == []


def test_an_unfinished_attempt_is_only_cleaned_up_and_another_nodes_is_left_alone(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given an attempt that had not finished, and one that belongs to another node
    _, unfinished = submit(repo, entrypoint="pkg.mod:main")
    svc = services(repo, redis_client, tmp_path, ArtifactStore(f"file://{tmp_path / 'a'}"))
    mine = _left_behind(svc, repo, unfinished, result=None)
    other, _ = repo.create_tenant("other", now=utcnow())
    theirs_job = repo.insert_job(other.id, *_spec_and_route(), now=utcnow()).id
    theirs = _left_behind(svc, repo, theirs_job, result={"x": 1}, node="cpu9@elsewhere")

    # When the successor starts
    assert settle_left_attempts(svc) == 0

    # Then its own unfinished attempt is gone (the scheduler recovers the job as lost),
    # nothing was recorded, and the other node's directory is untouched
    assert not mine.root.exists()
    assert repo.get_job(None, unfinished).state == "running"
    assert theirs.root.exists()
    assert repo.get_job(None, theirs_job).state == "running"


def _spec_and_route():
    from e31.core.sizeclasses import route
    from e31.edge.settings import Settings
    spec = JobSpec.parse({"entrypoint": "pkg.mod:main", "resources": {"gpus": 0}})
    return spec, route(spec, Settings().size_classes)


def test_the_claim_file_keeps_the_typed_spec_through_its_json_round_trip(tmp_path: Path) -> None:
    # Given a claim whose spec has params, env, resources and a timeout
    spec = JobSpec.parse({"entrypoint": "pkg.mod:main", "params": {"n": [1, 2]},
                          "env": {"MODE": "fast"}, "resources": {"gpus": 0, "mem_gb": 2},
                          "timeout_s": 30})
    claim = Claim(job_id="j-1", tenant_id="t-1", token=4, attempt=2, spec=spec, gpus=0)

    # When it is kept beside the attempt and read back by a successor
    write_claim(tmp_path, "cpu0@test", claim)
    data = json.loads((tmp_path / CLAIM_FILE).read_text())

    # Then the node and the same claim come back, the spec still a JobSpec
    assert data.pop("node") == "cpu0@test"
    assert claim_from_file_data(data) == claim
