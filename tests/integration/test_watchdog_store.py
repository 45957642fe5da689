"""What the watchdog and a node's own drain keep in the store, on real SQLite and PostgreSQL:
an attempt flagged idle (and cleared), the idle jobs per class, and the drained nodes with
their reasons."""

from __future__ import annotations

from datetime import timedelta

from e31.core.clock import utcnow
from e31.edge.settings import Settings
from e31.store import Repo
from tests.integration.test_api import api as api  # the fixture, reused
from tests.integration.test_attempt_facts import running_job as claimed_job

CLASSES = Settings().size_classes


def running_job(repo: Repo, tenant_name: str = "team-a") -> tuple[str, str, int]:
    """A claimed gpu24 job: (tenant id, job id, attempt number)."""
    return claimed_job(repo, tenant_name, gpus=1)


def test_an_idle_flag_shows_on_the_job_and_counts_per_class_until_it_is_cleared(
        repo: Repo) -> None:
    # Given two running jobs
    tenant_id, job_id, n = running_job(repo)
    running_job(repo, "team-b")
    since = utcnow() - timedelta(seconds=30)

    # When the watchdog flags the first idle
    assert repo.mark_idle(job_id, n, since)

    # Then its status shows since when, and the class counts one idle job
    status = repo.get_job(tenant_id, job_id).to_status()
    assert status["idle_since"] == since.isoformat()
    assert status["attempts"][0]["idle_since"] == since.isoformat()
    assert repo.idle_jobs() == {"gpu24": 1}

    # When it moves again, the flag goes
    assert repo.mark_idle(job_id, n, None)
    assert repo.get_job(tenant_id, job_id).to_status()["idle_since"] is None
    assert repo.idle_jobs() == {}
    assert not repo.mark_idle(job_id, n + 1, since)   # no such attempt


def test_drained_nodes_carry_their_reason_until_their_worker_starts_again(repo: Repo) -> None:
    # Given an operator's drain and a node's own, for an XID error
    repo.request_drain(["gpu0@a"], now=utcnow())
    repo.request_drain(["gpu1@a"], now=utcnow(), reason="XID 79 on GPU 1")

    # Then both are out of service, with their reasons
    shown = [d.to_dict() for d in repo.drained_nodes()]
    assert [(d["node"], d["reason"]) for d in shown] == [
        ("gpu0@a", "drained by an operator"), ("gpu1@a", "XID 79 on GPU 1")]

    # When their launcher starts them again, they are not
    repo.clear_drain(["gpu0@a", "gpu1@a"])
    assert repo.drained_nodes() == []


def test_the_queue_route_lists_the_nodes_out_of_service_with_their_reason(api, repo: Repo) -> None:
    # Given a node that drained itself for an XID error
    client, _, h = api
    repo.request_drain(["gpu3@host"], now=utcnow(), reason="GPU error: XID 79 on GPU 3")

    # When anyone asks for the queue
    view = client.get("/v1/queue", headers=h["a"]).json()

    # Then the node is there, with why
    assert [(d["node"], d["reason"]) for d in view["drained"]] == [
        ("gpu3@host", "GPU error: XID 79 on GPU 3")]
