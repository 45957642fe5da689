"""The worker's prepare stage over a real store and real files: bundles fetched once per host
into a bounded cache, unpacked read-only, refused when bad; inputs staged by name."""

from __future__ import annotations

import io
import os
import tarfile
import types
from pathlib import Path
from typing import Any

import pytest

from e31.core.bundles import bundle_input
from e31.core.errors import SetupError
from e31.core.spec import JobSpec
from e31.edge.artifacts import ArtifactStore
from e31.edge.bundlestore import BundleStore
from e31.edge.settings import Settings
from e31_worker.attempt.code import BundleCache, remove_tree, stage_code, unpack
from e31_worker.attempt.inputs import stage_inputs
from e31_worker.attempt.plan import AttemptPlan

TENANT = "t-test"


def tar_of(**files: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name.replace("__", "/"))
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def store_bundle(store: BundleStore, data: bytes, tenant: str = TENANT) -> str:
    """Put `data` in the store as the API would (no checks: the worker must do its own)."""
    with store.upload(tenant) as up:
        up.write(data)
        return store.commit(up, tenant)


@pytest.fixture
def world(tmp_path: Path) -> types.SimpleNamespace:
    shared = tmp_path / "shared"
    shared.mkdir()
    settings = Settings(redis_url="redis://unused", work_dir=str(tmp_path / "work"),
                        input_file_roots=(str(shared),), bundle_cache_max_bytes=1 << 20)
    artifacts = ArtifactStore(f"file://{tmp_path / 'artifacts'}")
    # no sandbox: file:// inputs are copied (a sandboxed worker binds a readable file instead:
    # tests/integration/test_footage_staging.py)
    return types.SimpleNamespace(settings=settings, artifacts=artifacts, shared=shared,
                                 store=BundleStore(artifacts.url), root=tmp_path / "attempt",
                                 sandbox=None)


def claim_and_plan(world: types.SimpleNamespace, **spec: Any) -> tuple[Any, AttemptPlan]:
    job = JobSpec.parse({"command": ["true"], **spec})
    claim = types.SimpleNamespace(job_id="j-test", attempt=1, tenant_id=TENANT, spec=job)
    plan = AttemptPlan(job_id="j-test", attempt=1, spec=job, gpus="", root=world.root,
                       kill_grace_s=1, log_max_bytes=1 << 20, tick_interval_s=1)
    return claim, plan


def test_code_is_fetched_once_per_host_and_unpacked_read_only(world) -> None:
    # Given a stored bundle and a job naming it
    digest = store_bundle(world.store, tar_of(m__py=b"x = 1\n", **{"pkg__a.py": b""}))
    claim, plan = claim_and_plan(world, code=digest)

    # When two attempts stage it
    stage_code(world, claim, plan)
    first = sorted(p.relative_to(plan.code_dir).as_posix() for p in plan.code_dir.rglob("*"))
    remove_tree(plan.root)
    stage_code(world, claim, plan)

    # Then the code is there, without write bits, and the cache holds one copy
    assert first == ["m", "m/py", "pkg", "pkg/a.py"]
    assert not os.stat(plan.code_dir / "pkg" / "a.py").st_mode & 0o222
    assert not os.stat(plan.code_dir / "pkg").st_mode & 0o222
    cached = list((Path(world.settings.work_dir) / ".bundles").glob("*.tar"))
    assert [p.name for p in cached] == [digest.split(":")[1] + ".tar"]
    remove_tree(plan.root)
    assert not plan.root.exists()


@pytest.mark.parametrize("name, kind", [("../evil", tarfile.REGTYPE), ("/abs", tarfile.REGTYPE),
                                        ("dev", tarfile.CHRTYPE)])
def test_the_worker_refuses_a_bad_bundle_the_store_holds(world, name: str, kind: bytes) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.type = kind
        tar.addfile(info, io.BytesIO(b""))
    claim, plan = claim_and_plan(world, code=store_bundle(world.store, buf.getvalue()))
    with pytest.raises(SetupError) as refused:
        stage_code(world, claim, plan)
    assert "refused" in refused.value.message
    assert not plan.code_dir.exists() and not (world.root.parent / "evil").exists()


def test_a_bundle_missing_from_the_store_is_a_setup_error(world) -> None:
    claim, plan = claim_and_plan(world, code="sha256:" + "0" * 64)
    with pytest.raises(SetupError) as refused:
        stage_code(world, claim, plan)
    assert "not in the store" in refused.value.message


def test_the_cache_evicts_the_least_recently_used_bundle(world, tmp_path: Path) -> None:
    # Given a cache of 700 KiB and three bundles of about 300 KiB (two fit)
    cache = BundleCache(tmp_path / "cache", max_bytes=700 * 1024)
    a = store_bundle(world.store, tar_of(a=b"a" * 300 * 1024))
    b = store_bundle(world.store, tar_of(b=b"b" * 300 * 1024))
    c = store_bundle(world.store, tar_of(c=b"c" * 300 * 1024))

    # When a, b are fetched, a is used again, then c is fetched
    for digest in (a, b):
        cache.open(world.store, TENANT, digest)[0].close()
    f, held = cache.open(world.store, TENANT, a)
    f.close()
    os.utime(cache.root / f"{b.split(':')[1]}.tar", (1, 1))   # b was used long ago
    cache.open(world.store, TENANT, c)[0].close()

    # Then a was a hit, and b (least recently used) made room for c
    assert held
    kept = sorted(p.name[:4] for p in cache.root.glob("*.tar"))
    assert kept == sorted(d.split(":")[1][:4] for d in (a, c))


def test_inputs_are_staged_by_name_from_a_bundle_and_a_file_url(world) -> None:
    # Given an uploaded input (a file) and a shared directory readable through file://
    digest = store_bundle(world.store, tar_of(**{"rows.csv": b"a,b\n1,2\n"}))
    (world.shared / "images").mkdir()
    (world.shared / "images" / "1.txt").write_text("one")
    (world.shared / "images" / "leak").symlink_to("/etc/hostname")
    claim, plan = claim_and_plan(world, inputs={
        "rows": bundle_input(digest, "rows.csv"),
        "images": f"file://{world.shared}/images"})

    # When they are staged
    stage_inputs(world, claim, plan)

    # Then each is under its name, and the link was not followed
    assert (plan.input_dir / "rows").read_text() == "a,b\n1,2\n"
    assert (plan.input_dir / "images" / "1.txt").read_text() == "one"
    assert sorted(p.name for p in plan.input_dir.iterdir()) == ["images", "rows"]
    assert not (plan.input_dir / "images" / "leak").exists()


def test_a_file_input_that_resolves_outside_the_roots_is_refused(world) -> None:
    (world.shared / "escape").symlink_to("/etc")
    claim, plan = claim_and_plan(world, inputs={"etc": f"file://{world.shared}/escape"})
    with pytest.raises(SetupError) as refused:
        stage_inputs(world, claim, plan)
    assert refused.value.message.startswith("inputs.etc:")
    assert "outside input_file_roots" in refused.value.message


def test_unpack_refuses_before_writing_anything(tmp_path: Path) -> None:
    data = tar_of(ok=b"fine", **{"../../x": b"bad"})
    with pytest.raises(SetupError):
        unpack(io.BytesIO(data), tmp_path / "code")
    assert not (tmp_path / "code").exists()
