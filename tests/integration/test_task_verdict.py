"""What Celery (and so Flower) is told about a delivered job: the registered `e31.run` task,
run against a real store and Redis, fails when the job failed or timed out and succeeds when
it succeeded; the message is acked either way."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from celery import Task

from e31.core.states import AttemptReason
from e31.edge.artifacts import ArtifactStore
from e31.edge.celeryapp import TASK_NAME, make_celery
from e31.edge.settings import Settings
from e31.store import Repo
from e31_worker.attempt import task
from e31_worker.attempt.verdict import (
    NO_ATTEMPT,
    Ended,
    JobNotSucceeded,
    describe,
    task_result,
)
from tests.integration.test_store import publish
from tests.integration.test_task import services, submit


def registered(repo: Repo, r: redis.Redis, tmp_path: Path) -> Task:
    """`e31.run` as a worker registers it, bound to a cpu worker's services."""
    app = make_celery(Settings(redis_url="redis://unused"))
    task.register(app, services(repo, r, tmp_path, ArtifactStore(f"file://{tmp_path / 'a'}")))
    return app.tasks[TASK_NAME]


def test_a_failed_job_fails_its_task_with_the_job_id_reason_and_state(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given a job whose command exits 3, and the worker's e31.run task
    _, job_id = submit(repo, command=["sh", "-c", "exit 3"])
    run = registered(repo, redis_client, tmp_path)

    # When its message is delivered
    result = run.apply(args=[job_id, publish(repo, job_id)])

    # Then the job is failed in the store, and the task failed with a message that says so
    assert repo.get_job(None, job_id).state == "failed"
    assert result.state == "FAILURE"
    assert isinstance(result.result, JobNotSucceeded)
    assert str(result.result).startswith(f"job {job_id} attempt 1 ended error; the job is failed")
    # And the failure is one the task declares: logged without a traceback, still acked
    assert JobNotSucceeded in run.throws
    assert run.acks_late and run.app.conf.task_acks_on_failure_or_timeout


def test_a_timed_out_job_fails_its_task(repo: Repo, redis_client: redis.Redis,
                                        tmp_path: Path) -> None:
    _, job_id = submit(repo, command=["sleep", "30"], timeout_s=0.5)
    run = registered(repo, redis_client, tmp_path)

    result = run.apply(args=[job_id, publish(repo, job_id)])

    assert result.state == "FAILURE"
    assert f"job {job_id} attempt 1 ended timeout; the job is failed" in str(result.result)


def test_a_succeeded_job_succeeds_its_task_with_a_line_that_names_it(
        repo: Repo, redis_client: redis.Redis, tmp_path: Path) -> None:
    _, job_id = submit(repo, command=["true"])
    run = registered(repo, redis_client, tmp_path)

    result = run.apply(args=[job_id, publish(repo, job_id)])

    assert result.state == "SUCCESS"
    assert result.result == f"job {job_id} attempt 1 succeeded"
    # A second delivery of the same message runs nothing and fails nothing
    again = run.apply(args=[job_id, publish(repo, job_id)])
    assert again.state == "SUCCESS" and again.result == NO_ATTEMPT


@pytest.mark.parametrize(("ended", "said"), [
    (Ended("j1", 2, AttemptReason.CANCELLED, "cancelled"),
     "job j1 attempt 2 ended cancelled; the job is cancelled"),
    (Ended("j1", 1, AttemptReason.ERROR, "queued", "exit code 1\nTraceback"),
     "job j1 attempt 1 ended error; the job is queued again: exit code 1 Traceback"),
    (Ended("j1", 1, AttemptReason.SUCCEEDED, None),
     "job j1 attempt 1 ended succeeded; its outcome was not recorded (the job was recovered "
     "elsewhere)"),
])
def test_every_outcome_but_a_succeeded_job_raises_with_one_line(ended: Ended, said: str) -> None:
    assert describe(ended) == said
    with pytest.raises(JobNotSucceeded, match="^job j1 attempt"):
        task_result(ended)


def test_a_long_error_is_cut_in_what_flower_shows() -> None:
    said = describe(Ended("j1", 1, AttemptReason.ERROR, "failed", "x" * 10_000))
    assert len(said) < 400 and said.endswith("...")
