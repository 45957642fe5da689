"""The pool's default cap of a tenant's stored outputs is what the artifact store can hold
(issue 25): with `tenant_outputs_max_bytes` unset, a local store's file system size; an object
store sets none; an explicit setting, or a tenant's own cap, wins. Real store, real Redis, real
worker attempts over a `file://` artifact store.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import redis

from e31.core.clock import utcnow
from e31.edge.artifacts import NO_CAP_BYTES, ArtifactStore
from e31.edge.settings import Settings
from e31.store import Repo
from tests.integration.test_cli_ops import e31
from tests.integration.test_quotas import read_log, run_to_the_end, services, submit

HUGE = 1 << 50


@pytest.fixture
def artifacts(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(f"file://{tmp_path / 'artifacts'}")


def test_unset_the_default_is_the_local_stores_file_system_size(artifacts: ArtifactStore,
                                                               tmp_path: Path) -> None:
    # Given the setting's default, and a local store whose directory does not exist yet
    assert Settings().tenant_outputs_max_bytes is None
    assert not (tmp_path / "artifacts").exists()

    # Then the cap is the size of the file system it will live on; a setting wins
    disk = shutil.disk_usage(tmp_path).total
    assert artifacts.capacity_bytes() == disk
    assert artifacts.outputs_cap_bytes(None) == disk
    assert artifacts.outputs_cap_bytes(5000) == 5000
    assert artifacts.outputs_cap_bytes(0) == 0


def test_an_object_store_sets_no_cap_of_its_own() -> None:
    store = ArtifactStore("s3://e31-bucket/artifacts", storage_options={
        "endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"})   # never contacted
    assert store.capacity_bytes() is None
    assert store.outputs_cap_bytes(None) == NO_CAP_BYTES
    assert store.outputs_cap_bytes(7) == 7


def test_a_job_cannot_store_more_than_the_disk_holds_by_default(
        repo: Repo, redis_client: redis.Redis, artifacts: ArtifactStore, tmp_path: Path) -> None:
    # Given a worker with the default tenant cap (and no per-job cap to speak of), and a job
    # that leaves a sparse output one byte larger than the store's file system (it takes no
    # room on the disk; the worker refuses it by its size, before reading any of it)
    tenant, _ = repo.create_tenant("t", now=utcnow())
    svc = services(repo, redis_client, artifacts, tmp_path, job_outputs_max_bytes=HUGE)
    disk = shutil.disk_usage(tmp_path).total
    job = submit(repo, tenant.id, f'truncate -s {disk + 1} "$E31_OUTPUT_DIR/huge.bin"; '
                                  'echo small > "$E31_OUTPUT_DIR/small.txt"')

    # When it runs
    assert run_to_the_end(repo, svc, job) == "succeeded"

    # Then the huge output is refused over the tenant's quota, which is the disk's size, and
    # the small one is stored
    assert artifacts.list_outputs(tenant.id, job) == [{"path": "small.txt", "size": 6}]
    assert (f"output refused: huge.bin: {disk + 1} bytes: over the tenant's outputs quota "
            f"({disk} bytes, 6 in use)") in read_log(artifacts, tenant.id, job, 1).decode()


def test_an_explicit_setting_and_a_tenants_own_cap_win_over_the_default(
        repo: Repo, redis_client: redis.Redis, artifacts: ArtifactStore, tmp_path: Path) -> None:
    # Given a pool cap set to 1000 bytes, one tenant on it and one with its own 3000 bytes
    plain, _ = repo.create_tenant("plain", now=utcnow())
    own, _ = repo.create_tenant("own", now=utcnow())
    repo.set_outputs_quota("own", 3000)
    svc = services(repo, redis_client, artifacts, tmp_path, tenant_outputs_max_bytes=1000)
    script = 'head -c 2000 /dev/zero > "$E31_OUTPUT_DIR/out.bin"'

    # When each leaves a 2000-byte output
    first, second = submit(repo, plain.id, script), submit(repo, own.id, script)
    assert run_to_the_end(repo, svc, first) == "succeeded"
    assert run_to_the_end(repo, svc, second) == "succeeded"

    # Then the pool's setting refuses it, and the tenant's own cap takes it
    assert artifacts.list_outputs(plain.id, first) == []
    assert "over the tenant's outputs quota (1000 bytes, 0 in use)" in read_log(
        artifacts, plain.id, first, 1).decode()
    assert artifacts.list_outputs(own.id, second) == [{"path": "out.bin", "size": 2000}]


def test_tenant_update_shows_the_disk_size_as_the_default_cap(database_url: str,
                                                             tmp_path: Path) -> None:
    # Given a tenant, on a pool whose artifact store is local and has no cap set
    created = e31("tenant", "create", "t", home=tmp_path, database_url=database_url)
    assert created.returncode == 0, created.stderr

    # When the operator returns its outputs cap to the pool's default
    shown = e31("tenant", "update", "t", "--outputs-max-bytes", "default", "--json",
                home=tmp_path, database_url=database_url)

    # Then the cap shown is the size of the file system the artifact store lives on
    assert shown.returncode == 0, shown.stderr
    printed = json.loads(shown.stdout)
    assert printed["outputs_max_is_default"] is True
    assert printed["outputs_max_bytes"] == shutil.disk_usage(tmp_path).total
