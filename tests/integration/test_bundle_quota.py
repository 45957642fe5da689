"""A tenant's bundles, all together, are capped by `tenant_bundle_gb`: through the real API and
store, an upload past the quota is a 413 naming the quota and what is used, and stores nothing;
two concurrent uploads cannot both pass it (issue 25)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import tarfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi.testclient import TestClient

from e31.api.services.bundles import GIB, BundleService
from e31.core.clock import utcnow
from e31.core.errors import TooLarge
from e31.edge.bundlestore import STALE_UPLOAD_S, TMP_PREFIX, BundleStore
from e31.edge.settings import Settings
from e31.store import Repo
from tests.integration.conftest import MakeApp, S3Server, bearer

BUNDLE_BYTES = 20 * 1024                 # each test bundle: a tar of this size exactly
QUOTA_BYTES = 3 * BUNDLE_BYTES // 2      # room for one bundle, not two
QUOTA_GB = QUOTA_BYTES / GIB             # exact: a multiple of 2**-30


def bundle(seed: str) -> bytes:
    """A valid bundle of BUNDLE_BYTES bytes, different for each seed."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        data = hashlib.sha256(seed.encode()).hexdigest().encode() * 200   # 12800 bytes
        info = tarfile.TarInfo("main.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    out = buf.getvalue()
    assert len(out) == BUNDLE_BYTES, len(out)
    return out


def digest(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def stored_bytes(tmp_path: Path) -> int:
    root = tmp_path / "artifacts" / "bundles"
    return sum(p.stat().st_size for p in root.rglob("*.tar")) if root.exists() else 0


def test_an_upload_past_the_tenants_bundle_quota_is_a_413_naming_it(
        repo: Repo, make_app: MakeApp, tmp_path: Path) -> None:
    # Given a pool whose tenants may keep one bundle's worth, and a tenant holding one
    _, token = repo.create_tenant("team-a", now=utcnow())
    _, other = repo.create_tenant("team-b", now=utcnow())
    http = TestClient(make_app(tenant_bundle_gb=QUOTA_GB))
    first = bundle("first")
    assert http.put(f"/v1/bundles/{digest(first)}", content=first,
                    headers=bearer(token)).status_code == 201

    # When it uploads a second bundle
    second = bundle("second")
    answer = http.put(f"/v1/bundles/{digest(second)}", content=second, headers=bearer(token))

    # Then it is refused naming the quota and what its bundles take, and nothing is stored
    assert answer.status_code == 413, answer.text
    body = answer.json()
    assert body["limit_bytes"] == QUOTA_BYTES
    assert f"quota of {QUOTA_BYTES} bytes" in body["message"]
    assert "tenant_bundle_gb" in body["message"]
    assert f"{BUNDLE_BYTES} bytes are in use" in body["message"]
    assert stored_bytes(tmp_path) == BUNDLE_BYTES
    # while the bundle it holds is still answered as held, and another tenant has its own quota
    assert http.put(f"/v1/bundles/{digest(first)}", content=first,
                    headers=bearer(token)).status_code == 200
    assert http.put(f"/v1/bundles/{digest(second)}", content=second,
                    headers=bearer(other)).status_code == 201


def test_a_quota_of_zero_takes_no_bundle(repo: Repo, make_app: MakeApp, tmp_path: Path) -> None:
    _, token = repo.create_tenant("team-a", now=utcnow())
    http = TestClient(make_app(tenant_bundle_gb=0))
    data = bundle("any")
    answer = http.put(f"/v1/bundles/{digest(data)}", content=data, headers=bearer(token))
    assert answer.status_code == 413 and "bundles are off" in answer.json()["message"]
    assert stored_bytes(tmp_path) == 0


def test_the_default_quota_takes_bundles(repo: Repo, make_app: MakeApp) -> None:
    _, token = repo.create_tenant("team-a", now=utcnow())
    data = bundle("default")
    assert Settings().tenant_bundle_gb == 10.0
    assert TestClient(make_app()).put(f"/v1/bundles/{digest(data)}", content=data,
                                      headers=bearer(token)).status_code == 201


def checks_over(tmp_path: Path) -> tuple[BundleService, BundleStore]:
    store = BundleStore(f"file://{tmp_path / 'artifacts'}")
    return BundleService(settings=Settings(tenant_bundle_gb=QUOTA_GB), store=store), store


async def paused(data: bytes, gate: asyncio.Event | None) -> AsyncIterator[bytes]:
    """The body in two halves, waiting on `gate` between them."""
    half = len(data) // 2
    yield data[:half]
    if gate is not None:
        await gate.wait()
    yield data[half:]


def test_two_concurrent_uploads_cannot_both_pass_the_quota(repo: Repo, tmp_path: Path) -> None:
    # Given a tenant with room for one bundle, and the API's checks over the real store
    tenant, _ = repo.create_tenant("team-a", now=utcnow())
    checks, _ = checks_over(tmp_path)
    a, b = bundle("a"), bundle("b")

    async def race(order: str) -> list[object]:
        gate = asyncio.Event()

        async def upload(data: bytes, wait: bool) -> object:
            try:
                return await checks.receive(tenant, digest(data), paused(data, gate if wait
                                                                         else None), None)
            except TooLarge as exc:
                return exc
            finally:
                gate.set()

        # A writes half its body and waits while B uploads all of its own, then A finishes
        first, second = (a, b) if order == "ab" else (b, a)
        return list(await asyncio.gather(upload(first, True), upload(second, False)))

    # When the two uploads overlap
    results = asyncio.run(race("ab"))

    # Then one of them at most is stored, and the tenant's bundles stay within the quota
    stored = [r for r in results if isinstance(r, dict) and r["stored"]]
    refused = [r for r in results if isinstance(r, TooLarge)]
    assert len(stored) <= 1 and len(stored) + len(refused) == 2, results
    assert stored_bytes(tmp_path) <= QUOTA_BYTES
    assert not [p for p in (tmp_path / "artifacts").rglob(f"{TMP_PREFIX}*")]


def test_an_upload_file_left_by_a_dead_api_process_stops_counting(repo: Repo,
                                                                  tmp_path: Path) -> None:
    # Given an upload file a dead API process left, as big as the quota
    tenant, _ = repo.create_tenant("team-a", now=utcnow())
    checks, store = checks_over(tmp_path)
    left = tmp_path / "artifacts" / "bundles" / tenant.id / f"{TMP_PREFIX}dead"
    left.parent.mkdir(parents=True)
    left.write_bytes(b"\0" * QUOTA_BYTES)

    # While it is fresh it counts (it may be a live upload), and a bundle is refused
    assert store.used_bytes(tenant.id) == QUOTA_BYTES
    data = bundle("after")
    try:
        asyncio.run(checks.receive(tenant, digest(data), paused(data, None), None))
        raise AssertionError("a fresh upload file did not count")
    except TooLarge:
        pass

    # When it has not been written to for STALE_UPLOAD_S, it no longer counts
    old = time.time() - STALE_UPLOAD_S - 1
    os.utime(left, (old, old))
    assert store.used_bytes(tenant.id) == 0
    assert asyncio.run(checks.receive(tenant, digest(data), paused(data, None),
                                      None))["stored"] is True


def test_an_object_stores_bundles_are_counted_as_a_local_stores(s3: S3Server,
                                                                s3_url: str) -> None:
    # Given a tenant's bundle committed on s3, and an upload of it in progress
    store = BundleStore(s3_url, s3.options)
    assert store.used_bytes("t-1") == 0
    with store.upload("t-1") as upload:
        upload.write(b"x" * 5)
        store.commit(upload, "t-1")
    with store.upload("t-1") as upload:
        upload.write(b"y" * 7)
        store.open_upload(upload).close()   # written out, as before the last check

        # Then both count, read afresh from the store; a stale upload does not
        assert store.used_bytes("t-1") == 12
        assert store.used_bytes("t-1", now_s=time.time() + STALE_UPLOAD_S + 60) == 5
    assert store.used_bytes("t-1") == 5
