"""Artifacts on S3 (`artifacts_url = "s3://bucket/prefix"`) against a real local S3 server:
moto in server mode (tests/integration/conftest.py), reached over HTTP by s3fs.

What holds on `file://` holds here: outputs, logs, checkpoints and bundles round-trip; no key
outside the job's prefix is ever asked for, whatever path a caller names; a download through
the API is read in bounded ranged GETs, never whole; and a checkpoint written by a worker on
one node resumes on another node that shares nothing with it but the S3 store (and the SQL
store and the broker).
"""

from __future__ import annotations

import os
import posixpath
import re
import signal
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from e31.api import create_app
from e31.api.services import Services
from e31.core.clock import utcnow
from e31.core.errors import NotFound
from e31.edge import artifacts as artifacts_module
from e31.edge.artifacts import ArtifactStore
from e31.edge.bundlestore import BundleStore
from e31.edge.settings import Settings
from e31.edge.wiring import storage_options
from e31.store import Repo, make_engine
from tests.conftest import job_processes, wait_for
from tests.integration.conftest import SECRET_KEY, S3Request, S3Server

TENANT, JOB, OTHER_JOB = "t-one", "j-one", "j-two"


@pytest.fixture
def store(s3: S3Server, s3_url: str) -> ArtifactStore:
    return ArtifactStore(s3_url, storage_options=s3.options)


def _prefix(url: str) -> str:
    """The key prefix of an `s3://bucket/prefix` URL."""
    return url.split("/", 3)[3]


def test_settings_give_the_store_its_endpoint_and_credentials_and_nothing_else(
        s3: S3Server, s3_url: str) -> None:
    settings = Settings.load(environ={"E31_ARTIFACTS_URL": s3_url, **s3.env()})
    assert storage_options(settings) == s3.options
    # A local store takes none of them; an s3:// one with none set leaves them to botocore.
    assert storage_options(Settings.load(environ=s3.env())) == {}
    assert storage_options(Settings.load(environ={"E31_ARTIFACTS_URL": s3_url})) == {}


def test_outputs_logs_checkpoints_and_bundles_round_trip_through_s3(
        s3: S3Server, s3_url: str, store: ArtifactStore, tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "sub" / "r.txt").write_text("result")
    (out / "a.bin").write_bytes(b"\0" * 1000)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "state.json").write_text('{"step": 3}')
    log = tmp_path / "attempt-1.log"
    log.write_text("hello\n")

    # A worker stores them
    assert store.put_tree(out, TENANT, JOB, "outputs") == [
        {"path": "a.bin", "size": 1000}, {"path": "sub/r.txt", "size": 6}]
    store.put_tree(ckpt, TENANT, JOB, "checkpoints")
    store.put_file(log, TENANT, JOB, "logs/attempt-1.log")

    # Every key lies under the job's prefix, and no upload's temporary name is left
    prefix = f"{_prefix(s3_url)}/{TENANT}/{JOB}/"
    assert s3.keys(_prefix(s3_url)) == [prefix + k for k in (
        "checkpoints/state.json", "logs/attempt-1.log", "outputs/a.bin", "outputs/sub/r.txt")]

    # The API reads them, from another store object (another process sees the same)
    reader = ArtifactStore(s3_url, storage_options=s3.options)
    assert reader.list_outputs(TENANT, JOB) == [{"path": "a.bin", "size": 1000},
                                                {"path": "sub/r.txt", "size": 6}]
    with reader.open_output(TENANT, JOB, "sub/r.txt") as f:
        assert f.read() == b"result"
    view = reader.log_view(TENANT, JOB, None)
    assert b"".join(view.read(0, view.size_bytes)) == b"=== attempt 1 ===\nhello\n"

    # The next attempt, on any node, gets the checkpoint back
    back = tmp_path / "back"
    assert reader.get_tree(TENANT, JOB, "checkpoints", back) == 1
    assert (back / "state.json").read_text() == '{"step": 3}'

    # Bundles sit beside the artifacts, under the same prefix
    bundles = BundleStore(s3_url, reader.storage_options)
    with bundles.upload(TENANT) as upload:
        upload.write(b"a tar")
        digest = bundles.commit(upload, TENANT)
    assert bundles.size(TENANT, digest) == 5
    with bundles.open(TENANT, digest) as f:
        assert f.read() == b"a tar"
    assert bundles.path(TENANT, digest).startswith(f"{s3.bucket}/{_prefix(s3_url)}/bundles/")

    # e31 gc removes all of the job's, and only the job's
    assert reader.remove_job(TENANT, JOB).files == 4
    assert s3.keys(prefix) == []
    assert bundles.exists(TENANT, digest)


@pytest.fixture(params=["guarded", "unguarded"])
def guarded(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """True with the path check on; False with `_safe` switched off (paths taken as given)."""
    if request.param == "unguarded":
        monkeypatch.setattr(artifacts_module, "_safe", lambda rel: rel)
    return bool(request.param == "guarded")


def _escaped(requests: list[S3Request], prefix: str) -> list[str]:
    """The keys asked for that lie outside `prefix` as a normalising server or proxy reads them
    (`..` resolved, `//` folded)."""
    return [r.key for r in requests
            if not posixpath.normpath("/" + r.key).startswith("/" + prefix)]


def test_no_key_outside_the_jobs_prefix_is_asked_for_whatever_path_is_named(
        s3: S3Server, s3_url: str, store: ArtifactStore, tmp_path: Path, guarded: bool) -> None:
    # Given another job's output, and a file a worker might be told to store
    other = f"{_prefix(s3_url)}/{TENANT}/{OTHER_JOB}/outputs/secret.txt"
    s3.client().put_object(Bucket=s3.bucket, Key=other, Body=b"the other job's bytes")
    planted = tmp_path / "planted.txt"
    planted.write_bytes(b"overwritten")
    s3.take()

    # When paths that climb out (`..`) or start at the root name it
    refused = 0
    for rel in ("../../j-two/outputs/secret.txt", f"sub/../../../{OTHER_JOB}/outputs/secret.txt",
                f"/{s3.bucket}/{other}"):
        try:
            with store.open_output(TENANT, JOB, rel) as f:
                f.read()
        except NotFound:
            refused += 1
    for rel in (f"../{OTHER_JOB}/outputs/secret.txt", f"/{s3.bucket}/{other}"):
        try:
            store.put_file(planted, TENANT, JOB, rel)
        except NotFound:
            refused += 1

    escaped = _escaped(s3.take(), f"{_prefix(s3_url)}/{TENANT}/{JOB}/")
    body = s3.client().get_object(Bucket=s3.bucket, Key=other)["Body"].read()
    if guarded:
        # Then each is refused before any request: no key outside the job's is named, and
        # the other job's output is untouched
        assert refused == 5 and escaped == []
        assert body == b"the other job's bytes"
    else:
        # Without the check the same calls name keys of the other job, and an absolute path
        # overwrites its output
        assert escaped, "without the path check no request left the job's prefix"
        assert body == b"overwritten"


@pytest.fixture
def api(sqlite_repo: Repo, redis_url: str, redis_client: redis.Redis, tmp_path: Path,
        s3: S3Server, s3_url: str) -> tuple[TestClient, ArtifactStore, dict[str, str], str]:
    settings = Settings(redis_url=redis_url, home=tmp_path, artifacts_url=s3_url,
                        s3_endpoint_url=s3.endpoint, s3_access_key_id=s3.options["key"],
                        s3_secret_access_key=s3.options["secret"])
    artifacts = ArtifactStore(s3_url, storage_options=storage_options(settings))
    service = Services(settings=settings, repo=sqlite_repo, artifacts=artifacts,
                      redis_client=redis_client)
    tenant, token = sqlite_repo.create_tenant("team-s3", now=utcnow())
    client = TestClient(create_app(settings, services=service))
    return client, artifacts, {"Authorization": f"Bearer {token}"}, tenant.id


@pytest.fixture(params=["bounded", "whole"])
def block_bytes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """The store's read block: its own, or (`whole`) one larger than any file here, as an
    unbounded read would be, to show that the test sees the difference."""
    if request.param == "whole":
        monkeypatch.setattr(artifacts_module, "REMOTE_BLOCK_BYTES", 64 << 20)
    return int(artifacts_module.REMOTE_BLOCK_BYTES)


def test_a_download_through_the_api_reads_s3_in_bounded_ranges_not_whole(
        s3: S3Server, api: tuple[TestClient, ArtifactStore, dict[str, str], str],
        tmp_path: Path, block_bytes: int) -> None:
    client, artifacts, headers, tenant_id = api
    job = client.post("/v1/jobs", json={"entrypoint": "m:f"}, headers=headers).json()
    big = tmp_path / "big.bin"
    size = 5 * (1 << 20) + 17
    big.write_bytes(os.urandom(size))
    artifacts.put_file(big, tenant_id, job["id"], "outputs/big.bin")
    s3.take()

    got = client.get(f"/v1/jobs/{job['id']}/outputs/big.bin", headers=headers)

    assert got.status_code == 200 and got.content == big.read_bytes()
    gets = [r for r in s3.take() if r.method == "GET" and r.key.endswith("/outputs/big.bin")]
    spans = [_span(r.range) for r in gets]
    # s3fs reads one block ahead of each 1 MiB read: at most two blocks per GET
    largest = max(spans)
    if block_bytes < size:
        assert largest <= 2 * block_bytes < size and len(gets) >= size // (2 * block_bytes)
    else:
        assert largest == size and len(gets) == 1   # the whole file in one GET: detected


def _span(header: str | None) -> int:
    m = re.fullmatch(r"bytes=(\d+)-(\d+)", header or "")
    assert m, f"a GET without a byte range: {header!r}"
    return int(m.group(2)) - int(m.group(1)) + 1


# -- a checkpoint written on one node resumes on another ------------------------------------

@pytest.mark.slow   # two launchers on one S3: on demand (-m slow)
def test_a_checkpoint_written_on_one_node_resumes_on_another_sharing_only_s3(
        s3: S3Server, s3_url: str, tmp_path: Path) -> None:
    from tests.e2e.chaos.conftest import make_cluster
    from tests.e2e.chaos.test_drain import (
        _checkpointing_job,
        _resumed_where_it_stopped,
        _steps_of_attempt,
    )

    cluster = make_cluster(tmp_path / "home", E31_ARTIFACTS_URL=s3_url, **s3.env())
    try:
        # Two nodes, each with its own work directory: they share the stores, not a disk
        cluster.e31("db", "upgrade")
        engine = make_engine(f"sqlite:///{tmp_path / 'home' / 'e31.db'}")
        cluster.token = Repo(engine, half_life_s=3600).create_tenant("s3", now=utcnow())[1]
        engine.dispose()
        cluster.spawn("api", "api")
        cluster.spawn("scheduler", "scheduler")
        for host in ("ha", "hb"):
            cluster.start_worker(host, env=dict(cluster.env,
                                                E31_WORK_DIR=str(tmp_path / f"work-{host}")))
        wait_for(cluster._api_up, timeout_s=60, what="the API to answer")
        for host in ("ha", "hb"):
            cluster.wait_worker(host)

        # Given a checkpointing job a few steps in on one node
        job = _checkpointing_job(cluster)
        host = cluster.running_on(job.id)
        wait_for(lambda: len(_steps_of_attempt(cluster, job.id, 1)) >= 3, timeout_s=30,
                 what="three steps")
        # (the store's credentials are E31_* settings: none reaches the job's environment)
        environs = [Path(f"/proc/{pid}/environ").read_bytes() for pid in job_processes(job.id)]
        assert environs and not any(SECRET_KEY.encode() in e for e in environs)

        # When that node's `e31 worker` is drained (SIGTERM)
        launcher = cluster.procs[f"worker-{host}"]
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 0

        # Then the job resumes on the other node from the checkpoint it reads from S3
        _resumed_where_it_stopped(cluster, job, host)
        keys = s3.keys(f"{_prefix(s3_url)}/")
        assert any(f"/{job.id}/checkpoints/" in k for k in keys), keys
        assert not (tmp_path / "home" / "artifacts").exists()   # nothing went to a local disk
        log = job.logs()   # both attempts' logs, written on two nodes, read through the API
        assert "=== attempt 1 ===" in log and "=== attempt 2 ===" in log
    finally:
        cluster.stop()
