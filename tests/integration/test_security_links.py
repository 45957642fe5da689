"""Links are never followed: a link a job leaves (or plants in a `file://` store) to a file
outside its directories is neither stored by a worker nor served by the API.

Real store, real Redis, a real worker attempt (`task.run_job`) and the real API app over the
same artifact store. Each attack runs twice: `guarded` (the protection on: the attack fails)
and `unguarded` (the protection switched off by the `guard` fixture: the same test reads the
target's bytes), which proves that the test would catch the hole.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from e31.api import create_app
from e31.api.services import Services
from e31.core.clock import utcnow
from e31.core.errors import LinkRefused
from e31.core.sizeclasses import route
from e31.core.spec import JobSpec
from e31.edge import localwalk as localwalk_module
from e31.edge.artifacts import ArtifactStore
from e31.edge.localwalk import scan_tree
from e31.edge.settings import Settings
from e31.ops.heartbeat import WorkerInfo
from e31.store import Repo
from e31_worker.attempt import task
from e31_worker.attempt.groups import GroupRegistry
from e31_worker.attempt.services import AttemptServices
from tests.integration.test_store import publish

SECRET = b"the-bytes-of-a-file-outside-the-job"
# Every process's /proc/self/environ holds PATH: the bytes an environment leak shows.
ENVIRON_MARK = b"PATH="


@pytest.fixture(params=["guarded", "unguarded"])
def guarded(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """True with the protection on; False with it switched off (links followed, every file
    accepted, no resolved-path check), as the store behaved before it."""
    if request.param == "unguarded":
        monkeypatch.setattr(localwalk_module, "NO_FOLLOW", 0)
        monkeypatch.setattr(localwalk_module, "refusal", lambda st: None)
        monkeypatch.setattr(localwalk_module, "_resolves_beneath", lambda fd, base: True)
    return bool(request.param == "guarded")


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    """A file outside every job directory and outside the store (a password, the database)."""
    path = tmp_path / "outside" / "secret.txt"
    path.parent.mkdir()
    path.write_bytes(SECRET)
    return path


class Api:
    """The real API app over `store`, with one tenant's token."""

    def __init__(self, repo: Repo, store: ArtifactStore, redis_url: str, r: redis.Redis,
                 home: Path, token: str) -> None:
        settings = Settings(redis_url=redis_url, home=home)
        service = Services(settings=settings, repo=repo, artifacts=store, redis_client=r)
        self.client = TestClient(create_app(settings, services=service))
        self.headers = {"Authorization": f"Bearer {token}"}

    def get(self, path: str) -> Any:
        return self.client.get(path, headers=self.headers)


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(f"file://{tmp_path / 'artifacts'}")


@pytest.fixture
def tenant(repo: Repo) -> tuple[str, str]:
    """(tenant id, token)."""
    record, token = repo.create_tenant("team", now=utcnow())
    return record.id, token


@pytest.fixture
def api(repo: Repo, store: ArtifactStore, redis_url: str, redis_client: redis.Redis,
        tmp_path: Path, tenant: tuple[str, str]) -> Iterator[Api]:
    yield Api(repo, store, redis_url, redis_client, tmp_path / "home", tenant[1])


def submit(repo: Repo, tenant_id: str, script: str) -> str:
    spec = JobSpec.parse({"resources": {"gpus": 0}, "command": ["sh", "-c", script]})
    return repo.insert_job(tenant_id, spec, route(spec, Settings().size_classes), now=utcnow()).id


def services(repo: Repo, r: redis.Redis, store: ArtifactStore, tmp_path: Path) -> AttemptServices:
    """A cpu worker's services over the real store, without cgroups."""
    settings = Settings(redis_url="redis://unused", work_dir=str(tmp_path / "work"),
                        heartbeat_interval_s=0.2, kill_grace_s=1)
    identity = WorkerInfo(node="cpu0@test", queues=("e31.cpu",), gpus="", gpu_count=0,
                          size_class="cpu")
    return AttemptServices(settings=settings, identity=identity, repo=repo, artifacts=store,
                           redis=r, groups=GroupRegistry(tmp_path / "work" / ".groups" / "cpu0"),
                           cgroups=None, draining=threading.Event(), busy=lambda _job: None)


def test_a_jobs_links_in_its_outputs_are_refused_by_the_worker_and_never_served(
        guarded: bool, repo: Repo, redis_client: redis.Redis, store: ArtifactStore, api: Api,
        tenant: tuple[str, str], secret_file: Path, tmp_path: Path) -> None:
    # Given a job that leaves, beside a real output, a symbolic link to the worker's own
    # environment, one to a file outside, a hard link to that file and a link to a directory
    # (the store never descended into a linked directory, so that one is not part of the
    # unguarded proof)
    script = (f'cd "$E31_OUTPUT_DIR" && echo fine > fine.txt'
              f' && ln -s /proc/self/environ api-environ && ln -s {secret_file} secret-link'
              f' && ln {secret_file} hard-link')
    if guarded:
        script += f' && ln -s {secret_file.parent} dir-link'
    job_id = submit(repo, tenant[0], script)

    # When a real worker runs it and stores its outputs
    task.run_job(services(repo, redis_client, store, tmp_path), job_id, publish(repo, job_id))

    # Then the job succeeded, and what the API lists and serves depends on the protection
    record = repo.get_job(None, job_id)
    assert record.state == "succeeded", record.error
    listed = [o["path"] for o in api.get(f"/v1/jobs/{job_id}/outputs").json()["outputs"]]
    served = {name: api.get(f"/v1/jobs/{job_id}/outputs/{name}")
              for name in ("api-environ", "secret-link", "hard-link", "dir-link/secret.txt")}
    assert api.get(f"/v1/jobs/{job_id}/outputs/fine.txt").content == b"fine\n"
    if not guarded:  # the hole: the worker copied the targets, the API serves their bytes
        assert ENVIRON_MARK in served["api-environ"].content
        assert served["secret-link"].content == SECRET
        assert served["hard-link"].content == SECRET
        return
    assert listed == ["fine.txt"]
    assert [o["path"] for o in record.outputs] == ["fine.txt"]
    for name, response in served.items():
        assert response.status_code == 404, name
        assert SECRET not in response.content and ENVIRON_MARK not in response.content
    log = api.get(f"/v1/jobs/{job_id}/logs?attempt=1").content.decode()
    assert "output refused: api-environ: symbolic link" in log
    assert "output refused: secret-link: symbolic link" in log
    assert "output refused: hard-link: hard link" in log
    assert "output refused: dir-link: symbolic link" in log


def test_a_link_planted_in_a_file_store_is_never_served_by_the_api(
        guarded: bool, repo: Repo, store: ArtifactStore, api: Api, tenant: tuple[str, str],
        secret_file: Path, tmp_path: Path) -> None:
    # Given a finished job's directory in a file:// store, into which a job on the same
    # machine planted links: to the API process's environment, to a file outside, a hard link
    # to it, and a log that is a link
    job_id = submit(repo, tenant[0], "true")
    job_dir = tmp_path / "artifacts" / tenant[0] / job_id
    (job_dir / "outputs").mkdir(parents=True)
    (job_dir / "logs").mkdir()
    (job_dir / "outputs" / "api-environ").symlink_to("/proc/self/environ")
    (job_dir / "outputs" / "secret").symlink_to(secret_file)
    os.link(secret_file, job_dir / "outputs" / "hard")
    (job_dir / "logs" / "attempt-1.log").symlink_to("/proc/self/environ")

    # When a tenant lists and downloads them, and reads the logs, through the API
    listed = [o["path"] for o in api.get(f"/v1/jobs/{job_id}/outputs").json()["outputs"]]
    environ = api.get(f"/v1/jobs/{job_id}/outputs/api-environ")
    secret = api.get(f"/v1/jobs/{job_id}/outputs/secret")
    hard = api.get(f"/v1/jobs/{job_id}/outputs/hard")
    logs = api.get(f"/v1/jobs/{job_id}/logs?attempt=1")

    # Then the protection answers 404 and an empty log; without it, the targets' bytes
    if not guarded:
        assert ENVIRON_MARK in environ.content and secret.content == SECRET == hard.content
        # the log is served up to the size its lstat gives (the link's), from the target
        assert logs.content and Path("/proc/self/environ").read_bytes().startswith(logs.content)
        return
    assert listed == []
    assert (environ.status_code, secret.status_code, hard.status_code) == (404, 404, 404)
    assert ENVIRON_MARK not in logs.content and logs.content == b""


def test_an_outputs_directory_that_is_a_link_to_another_tenants_job_serves_nothing(
        guarded: bool, repo: Repo, store: ArtifactStore, api: Api, tenant: tuple[str, str],
        tmp_path: Path) -> None:
    # Given another tenant's job with an output, and a job of ours whose outputs directory
    # in the store was replaced by a link to that job's
    other, _ = repo.create_tenant("other-team", now=utcnow())
    theirs = submit(repo, other.id, "true")
    src = tmp_path / "theirs"
    src.mkdir()
    (src / "private.txt").write_bytes(SECRET)
    store.put_tree(src, other.id, theirs, "outputs")
    ours = submit(repo, tenant[0], "true")
    ours_dir = tmp_path / "artifacts" / tenant[0] / ours
    ours_dir.mkdir(parents=True)
    (ours_dir / "outputs").symlink_to(tmp_path / "artifacts" / other.id / theirs / "outputs")

    # When we list and download our job's outputs
    listed = api.get(f"/v1/jobs/{ours}/outputs").json()["outputs"]
    got = api.get(f"/v1/jobs/{ours}/outputs/private.txt")

    # Then nothing of theirs comes back (without the protection, their file would)
    if not guarded:
        assert got.content == SECRET
        return
    assert listed == [] and got.status_code == 404


def test_a_checkpoint_in_a_linked_directory_is_not_uploaded_and_a_linked_one_not_restored(
        guarded: bool, store: ArtifactStore, secret_file: Path, tmp_path: Path) -> None:
    # Given a checkpoint directory whose subdirectory is a link to a directory outside
    checkpoints = tmp_path / "attempt" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "step").symlink_to(secret_file.parent)

    # When the worker uploads a checkpoint file through it, the job's directory as its base
    try:
        store.put_file(checkpoints / "step" / "secret.txt", "t", "j", "checkpoints/secret.txt",
                       base=checkpoints)
        uploaded = True
    except LinkRefused as exc:
        uploaded = False
        assert "step: symbolic link" in str(exc)

    # And a link planted among the stored checkpoints is restored for the next attempt
    stored = tmp_path / "artifacts" / "t" / "j" / "checkpoints"
    stored.mkdir(parents=True, exist_ok=True)
    (stored / "planted").symlink_to(secret_file)
    restored_dir = tmp_path / "next-attempt" / "checkpoints"
    store.get_tree("t", "j", "checkpoints", restored_dir)

    # Then the protection refuses both; without it, the secret travels both ways
    restored = restored_dir / "planted"
    if not guarded:
        assert uploaded and restored.read_bytes() == SECRET
        return
    assert not uploaded and not restored.exists()


def test_scan_tree_names_each_refused_file_with_its_reason(tmp_path: Path,
                                                           secret_file: Path) -> None:
    # Given a job directory with one file of each kind
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "sub" / "real.txt").write_text("ok")
    (out / "link").symlink_to(secret_file)
    (out / "dir").symlink_to(secret_file.parent)
    os.link(secret_file, out / "hard")
    os.mkfifo(out / "fifo")

    # When it is scanned
    scan = scan_tree(out)

    # Then only the regular file of one link is kept, and each other file is named with why
    assert list(scan.files) == ["sub/real.txt"]
    assert sorted(map(str, scan.refused)) == [
        "dir: symbolic link", "fifo: not a regular file", "hard: hard link", "link: symbolic link"]
    assert store_of(tmp_path).put_tree(out, "t", "j", "outputs") == [{"path": "sub/real.txt",
                                                                      "size": 2}]


def store_of(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(f"file://{tmp_path / 'artifacts'}")
