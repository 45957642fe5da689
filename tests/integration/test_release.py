"""A dead worker process's jobs, released by its launcher at once (`e31_worker.node.release`;
docs/reliability.md, "A dead node noticed in seconds"), against a real store and Redis: an
unfinished job ends `lost` and is queued again, with its own token; one whose child finished
is left to the successor, which records it; nothing is done while a process holds the node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import redis

from e31.core import keys
from e31.core.clock import utcnow
from e31.core.sizeclasses import route
from e31.core.spec import JobSpec
from e31.edge.settings import Settings
from e31.store import Repo
from e31_worker.attempt.record import write_claim
from e31_worker.node.release import release_dead_worker
from tests.conftest import wait_for
from tests.integration.test_store import claim

NODE = "cpu0@dead"


def settings_for(database_url: str, tmp_path: Path) -> Settings:
    return Settings(database_url=database_url, work_dir=str(tmp_path / "work"),
                    home=str(tmp_path / "home"), redis_url="redis://unused")


def submit(repo: Repo) -> str:
    tenant = next((t for t in repo.list_tenants() if t.name == "t"), None) \
        or repo.create_tenant("t", now=utcnow())[0]
    spec = JobSpec.parse({"resources": {"gpus": 0}, "entrypoint": "mod:main"})
    return repo.insert_job(tenant.id, spec, route(spec, Settings().size_classes), now=utcnow()).id


def running_job(repo: Repo, settings: Settings, *, finished: bool) -> str:
    """A job claimed by NODE, its claim kept in its attempt's directory as a worker keeps it,
    and (finished) the result its child wrote before the worker died."""
    job_id = submit(repo)
    held = claim(repo, job_id, worker=NODE)
    assert held is not None
    root = settings.resolved_work_dir / job_id / "attempt-1"
    root.mkdir(parents=True)
    write_claim(root, NODE, held)
    if finished:
        (root / "result.json").write_text(json.dumps({"result": 7}))
    return job_id


def test_a_dead_workers_unfinished_job_is_released_lost_and_its_finished_one_left(
        repo: Repo, database_url: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given a worker process of NODE that died holding two jobs: one still running its code,
    # one whose code had returned (its result written) before the outcome was recorded
    settings = settings_for(database_url, tmp_path)
    unfinished = running_job(repo, settings, finished=False)
    finished = running_job(repo, settings, finished=True)
    # and one job that another node holds
    other = submit(repo)
    claim(repo, other, worker="cpu0@alive")
    redis_client.delete(keys.WAKE)

    # When its launcher answers the death
    released = release_dead_worker(settings, NODE, exit_code=-9, redis_client=redis_client)

    # Then the unfinished job's attempt ended lost, said so, and the job is queued again,
    # the scheduler woken; the finished one still waits for the successor to record it
    assert released == [unfinished]
    job = repo.get_job(None, unfinished)
    assert job.state == "queued" and [a.reason for a in job.attempts] == ["lost"]
    assert "its launcher released the job at once" in (job.attempts[0].error or "")
    assert "killed by signal 9" in (job.attempts[0].error or "")
    assert repo.get_job(None, finished).state == "running"
    assert repo.get_job(None, other).state == "running"
    assert redis_client.llen(keys.WAKE) == 1

    # And answering the same death again changes nothing (the write is fenced)
    assert release_dead_worker(settings, NODE, exit_code=-9, redis_client=redis_client) == []
    assert len(repo.get_job(None, unfinished).attempts) == 1


def test_nothing_is_released_while_a_process_serves_the_node(
        repo: Repo, database_url: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given a job of NODE, and a live process holding the node's lock (its successor started)
    settings = settings_for(database_url, tmp_path)
    job_id = running_job(repo, settings, finished=False)
    lock = settings.resolved_work_dir / ".groups" / f"{NODE}.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from pathlib import Path;"
         "from e31_worker.attempt.groups import NodeLock;"
         "assert NodeLock(Path(sys.argv[1])).acquire() is None; print('held', flush=True);"
         "time.sleep(60)", str(lock)], stdout=subprocess.PIPE, env=dict(os.environ))
    try:
        assert holder.stdout is not None
        wait_for(lambda: holder.stdout.readline().strip() == b"held", timeout_s=30,
                 what="the node's lock to be held")

        # When a launcher answers a death that was not its process's
        released = release_dead_worker(settings, NODE, exit_code=1, redis_client=redis_client)

        # Then it leaves the job alone
        assert released == []
        assert repo.get_job(None, job_id).state == "running"
    finally:
        holder.kill()
        holder.wait()

    # And once the lock is free, the release goes through
    assert release_dead_worker(settings, NODE, exit_code=1,
                               redis_client=redis_client) == [job_id]
