"""A package index that is briefly unreachable costs the user nothing (docs/reliability.md,
"Whose failure it is"): a real HTTP index on loopback in a thread, the worker's own task body
(`run_job`) building the job's environment with the worker's uv, a real store and Redis. An
index that answers 503 ends the attempt `setup_transient` (the pool's, retried on its
account); once it answers, a requirement it does not have ends the job `setup` (the user's,
final)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from e31.core.clock import utcnow
from e31.edge.artifacts import ArtifactStore
from e31.store import Repo
from e31_worker.attempt import task
from tests.integration.test_http_inputs import Quiet, Serving, submit
from tests.integration.test_pool_failures import reasons
from tests.integration.test_store import publish
from tests.integration.test_task import services


class Index(Serving):
    """A package index on 127.0.0.1, in a thread, that has no package: each GET is answered
    with `status` (503 while it is down, 404 once it is up: uv's "not found in the package
    registry"); `asked` lists the paths asked."""

    def __init__(self) -> None:
        self.status = 503
        self.asked: list[str] = []
        index = self

        class Handler(Quiet):
            def do_GET(self) -> None:
                index.asked.append(self.path)
                self.send_response(index.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

        super().__init__(Handler)
        self.url = f"{self.base}/simple"


@pytest.fixture
def index(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The worker's only index (its uv settings, as an operator sets them): this one."""
    for name in ("UV_EXTRA_INDEX_URL", "UV_INDEX", "UV_FIND_LINKS", "UV_CONFIG_FILE",
                 "UV_DEFAULT_INDEX", "UV_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    with Index() as served:
        monkeypatch.setenv("UV_INDEX_URL", served.url)
        yield served


def test_an_index_that_answers_503_is_the_pools_and_a_missing_requirement_the_users(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path, index: Index) -> None:
    # Given a job with no retries (retries.max 0) that asks for a package, and an index
    # that answers 503
    svc = services(repo, redis_client, tmp_path, ArtifactStore(f"file://{tmp_path / 'a'}"))
    tenant, _ = repo.create_tenant("team-a", now=utcnow())
    job_id = submit(repo, tenant.id, command=["true"], python={"pip": ["nothing-here"]},
                    retries={"max": 0, "backoff_s": 0})

    # When a worker runs it
    task.run_job(svc, job_id, publish(repo, job_id))

    # Then its attempt ended setup_transient, the pool's: the job is queued again although it
    # has no retry of its own, and the error names the index's answer
    record = repo.get_job(None, job_id)
    assert reasons(repo, job_id) == ["setup_transient"] and record.state == "queued"
    error = record.attempts[0].error or ""
    assert "503 Service Unavailable" in error and "the package index failed" in error
    assert index.asked and all(p.endswith("/nothing-here/") for p in index.asked)

    # When the index answers again (it has no such package) and a worker runs the job
    index.status = 404
    task.run_job(svc, job_id, publish(repo, job_id))

    # Then the requirement that does not exist is the user's: `setup`, and final
    record = repo.get_job(None, job_id)
    assert reasons(repo, job_id) == ["setup_transient", "setup"]
    assert record.state == "failed" and record.to_status()["reason"] == "setup"
    assert "nothing-here was not found in the package registry" in (record.error or "")
