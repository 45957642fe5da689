"""Bundles and inputs through the real API over a real store: each bad upload or reference gets
its clear error and stores nothing; a tenant names only its own bundles."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from e31.api import create_app
from e31.api.services import Services
from e31.client import Client
from e31.client.bundle import pack
from e31.core.clock import utcnow
from e31.core.errors import ClientError, SpecError
from e31.edge.artifacts import ArtifactStore
from e31.edge.settings import Settings
from e31.store import Repo

LIMIT_BYTES = 64 * 1024


@pytest.fixture
def api(repo: Repo, redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> dict[str, Any]:
    shared = tmp_path / "shared"
    shared.mkdir()
    settings = Settings(redis_url=redis_url, home=tmp_path, bundle_max_bytes=LIMIT_BYTES,
                        input_file_roots=(str(shared),))
    artifacts = ArtifactStore(f"file://{tmp_path / 'artifacts'}")
    service = Services(settings=settings, repo=repo, artifacts=artifacts, redis_client=redis_client)
    tenant_a, token_a = repo.create_tenant("team-a", now=utcnow())
    tenant_b, token_b = repo.create_tenant("team-b", now=utcnow())
    http = TestClient(create_app(settings, services=service))
    return {"http": http, "shared": shared, "bundles": tmp_path / "artifacts" / "bundles",
            "ids": {"a": tenant_a.id, "b": tenant_b.id},
            "h": {"a": {"Authorization": f"Bearer {token_a}"},
                  "b": {"Authorization": f"Bearer {token_b}"}}}


def tar_of(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    """A hand-made tar of these members (data for regular files)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return buf.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info


def digest(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def stored_files(api: dict[str, Any]) -> list[Path]:
    """Every file under the store's bundles, temporary uploads included."""
    root: Path = api["bundles"]
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def put(api: dict[str, Any], data: bytes, name: str | None = None, who: str = "a") -> Any:
    return api["http"].put(f"/v1/bundles/{name or digest(data)}", content=data,
                           headers=api["h"][who])


def api_client(api: dict[str, Any], who: str = "a") -> Client:
    """The Python client talking to the test app."""
    client = Client("http://testserver", api["h"][who]["Authorization"].split()[1])
    client._http = api["http"]
    client._http.headers.update(api["h"][who])
    return client


def test_a_bundle_is_stored_once_and_a_second_upload_sends_nothing(api, tmp_path: Path) -> None:
    # Given a packed directory
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text("print('hi')\n")
    packed = pack(tmp_path / "code")
    data = packed.path.read_bytes()

    # When it is uploaded twice
    first, second = put(api, data), put(api, data)

    # Then the first stores it, the second finds it held, and only its tenant sees it
    assert (first.status_code, first.json()["stored"]) == (201, True)
    assert (second.status_code, second.json()["stored"]) == (200, False)
    [stored] = stored_files(api)
    assert stored.read_bytes() == data
    assert api["http"].head(f"/v1/bundles/{packed.digest}", headers=api["h"]["a"]).status_code \
        == 200
    assert api["http"].head(f"/v1/bundles/{packed.digest}", headers=api["h"]["b"]).status_code \
        == 404


@pytest.mark.parametrize("members, why", [
    ((member("../evil"), b"x"), "escapes"),
    ((member("/etc/evil"), b"x"), "escapes"),
    ((member("a/../../evil"), b"x"), "escapes"),
    ((member("dev", tarfile.CHRTYPE), None), "device"),
    ((member("fifo", tarfile.FIFOTYPE), None), "device"),
    ((member("out", tarfile.SYMTYPE, "../../etc/passwd"), None), "outside the bundle"),
    ((member("abs", tarfile.SYMTYPE, "/etc/passwd"), None), "outside the bundle"),
    ((member("hard", tarfile.LNKTYPE, "x"), None), "hard link"),
])
def test_a_bundle_with_a_bad_member_is_refused_and_nothing_is_stored(api, members, why) -> None:
    data = tar_of(members)
    response = put(api, data)
    assert response.status_code == 422, response.text
    assert response.json()["errors"][0]["field"] == "bundle"
    assert why in response.json()["message"]
    assert stored_files(api) == []


def test_a_body_that_is_not_a_tar_is_refused(api) -> None:
    response = put(api, b"not a tar at all" * 100)
    assert response.status_code == 422 and "not a tar" in response.json()["message"]
    assert stored_files(api) == []


def test_a_bundle_whose_hash_does_not_match_is_refused(api) -> None:
    data = tar_of((member("a.txt"), b"a"))
    response = put(api, data, name=digest(b"something else"))
    assert response.status_code == 409
    assert "sha256" in response.json()["message"] and digest(data) in response.json()["message"]
    assert stored_files(api) == []


def test_a_malformed_hash_is_refused(api) -> None:
    response = put(api, b"x", name="sha256:XYZ")
    assert response.status_code == 422 and response.json()["errors"][0]["field"] == "bundle"


def test_an_oversized_bundle_gets_413_naming_the_limit(api) -> None:
    data = tar_of((member("big.bin"), b"\0" * (LIMIT_BYTES + 1)))
    declared = put(api, data)

    def chunks() -> Any:   # no Content-Length: counted while it streams
        for i in range(0, len(data), 8192):
            yield data[i:i + 8192]

    streamed = api["http"].put(f"/v1/bundles/{digest(data)}", content=chunks(),
                               headers=api["h"]["a"])
    for response in (declared, streamed):
        assert response.status_code == 413
        assert response.json()["limit_bytes"] == LIMIT_BYTES
        assert "bundle_max_bytes" in response.json()["message"]
    assert stored_files(api) == []


def test_a_bundle_is_not_bounded_by_the_request_body_limit(api, tmp_path: Path) -> None:
    # Given a request body limit smaller than the bundle
    settings = Settings(redis_url="redis://unused", home=tmp_path, max_request_bytes=1024)
    service = api["http"].app.state.services
    small = TestClient(create_app(settings, services=service))
    data = tar_of((member("a.bin"), b"\1" * 4096))

    # Then the bundle's own limit applies to the upload, not max_request_bytes
    response = small.put(f"/v1/bundles/{digest(data)}", content=data, headers=api["h"]["a"])
    assert response.status_code == 201, response.text


def test_a_job_naming_a_bundle_its_tenant_never_uploaded_is_refused(api) -> None:
    data = tar_of((member("m.py"), b"def main(ctx): return 1\n"))
    assert put(api, data, who="b").status_code == 201   # team-b holds it, team-a does not
    for body, field in [({"command": ["python", "m.py"], "code": digest(data)}, "code"),
                        ({"command": ["true"], "inputs": {"d": f"bundle:{digest(data)}/m.py"}},
                         "inputs.d")]:
        response = api["http"].post("/v1/jobs", json=body, headers=api["h"]["a"])
        assert response.status_code == 409
        assert [e["field"] for e in response.json()["errors"]] == [field]
        assert "has not uploaded" in response.json()["message"]
    assert api["http"].get("/v1/jobs", headers=api["h"]["a"]).json()["jobs"] == []
    ok = api["http"].post("/v1/jobs", json={"command": ["python", "m.py"], "code": digest(data)},
                          headers=api["h"]["b"])
    assert ok.status_code == 201


@pytest.mark.parametrize("source, why, status", [
    ("ftp://host/data.csv", "unknown scheme 'ftp'", 422),
    ("./data.csv", "not a URL", 422),
    ("file:///etc/passwd", "not beneath a directory that file:// inputs may read", 403),
    ("file://host/share/x", "absolute path on the worker", 403),
    ("bundle:sha256:abc/x", "bundle:sha256:<64 hex>", 422),
])
def test_a_bad_input_is_refused_naming_it(api, source: str, why: str, status: int) -> None:
    response = api["http"].post("/v1/jobs", json={"command": ["true"], "inputs": {"data": source}},
                                headers=api["h"]["a"])
    assert response.status_code == status
    assert response.json()["errors"][0]["field"] == "inputs.data"
    assert why in response.json()["message"]
    assert api["http"].get("/v1/jobs", headers=api["h"]["a"]).json()["jobs"] == []


def test_an_input_name_that_is_no_file_name_is_refused(api) -> None:
    response = api["http"].post("/v1/jobs", json={"command": ["true"],
                                                  "inputs": {"../up": "s3://b/k"}},
                                headers=api["h"]["a"])
    assert response.status_code == 422
    assert response.json()["errors"][0]["field"] == "inputs.../up"


def test_a_file_input_beneath_an_allowed_root_is_taken(api) -> None:
    url = f"file://{api['shared']}/data.csv"
    response = api["http"].post("/v1/jobs", json={"command": ["true"], "inputs": {"d": url}},
                                headers=api["h"]["a"])
    assert response.status_code == 201
    job = api["http"].get(f"/v1/jobs/{response.json()['id']}", headers=api["h"]["a"]).json()
    assert job["state"] == "queued"


def test_a_dry_run_answers_what_would_be_stored_and_stores_nothing(api) -> None:
    data = tar_of((member("m.py"), b"x = 1\n"))
    body = {"entrypoint": "m:main", "code": digest(data), "resources": {"gpu_mem_gb": 40}}
    response = api["http"].post("/v1/jobs", params={"dry_run": "true"}, json=body,
                                headers=api["h"]["a"])
    assert response.status_code == 200
    answer = response.json()
    assert answer["dry_run"] is True
    assert (answer["size_class"], answer["queue"], answer["code"]) == \
        ("gpu48", "e31.gpu48", digest(data))
    assert answer["missing_bundles"] == ["code"]
    assert answer["spec"]["code"] == digest(data)
    assert api["http"].get("/v1/jobs", headers=api["h"]["a"]).json()["jobs"] == []
    bad = api["http"].post("/v1/jobs", params={"dry_run": "true"},
                           json={"command": ["true"], "inputs": {"d": "gopher://x"}},
                           headers=api["h"]["a"])
    assert bad.status_code == 422


def test_the_client_refuses_a_missing_local_input_naming_it(api, tmp_path: Path) -> None:
    client = api_client(api)
    with pytest.raises(SpecError) as refused:
        client.submit(command=["true"], inputs={"data": str(tmp_path / "nope.csv")})
    assert refused.value.errors[0]["field"] == "inputs.data"
    assert "no such file" in refused.value.message
    assert stored_files(api) == []


def test_the_client_uploads_code_and_a_local_input_once(api, tmp_path: Path) -> None:
    # Given a work directory and a local data file
    work = tmp_path / "work"
    work.mkdir()
    (work / "m.py").write_text("def main(ctx):\n    return 1\n")
    (tmp_path / "rows.csv").write_text("a,b\n1,2\n")
    client = api_client(api)

    # When two jobs are submitted with them
    first = client.submit(entrypoint="m:main", workdir=str(work), resources={"gpus": 0},
                          inputs={"rows": str(tmp_path / "rows.csv")})
    sent_first = client.last_bundles
    second = client.submit(entrypoint="m:main", workdir=str(work), resources={"gpus": 0},
                           inputs={"rows": str(tmp_path / "rows.csv")})

    # Then the first uploads both bundles, the second finds both held and sends nothing
    assert [(s.field, s.uploaded) for s in sent_first] == [("workdir", True),
                                                           ("inputs.rows", True)]
    assert [(s.field, s.held, s.uploaded) for s in client.last_bundles] == \
        [("workdir", True, False), ("inputs.rows", True, False)]
    assert len(stored_files(api)) == 2
    spec = api["http"].app.state.services.repo.get_job(None, second.id).spec
    assert first.id != second.id and spec["code"] == sent_first[0].digest
    assert spec["inputs"] == {"rows": f"bundle:{sent_first[1].digest}/rows.csv"}


def test_the_client_reports_the_api_limit_on_an_oversized_bundle(api, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "big.bin").write_bytes(b"\2" * (LIMIT_BYTES + 1))
    with pytest.raises(ClientError) as refused:
        api_client(api).submit(command=["true"], workdir=str(work))
    assert refused.value.status_code == 413
    assert str(LIMIT_BYTES) in refused.value.message
    assert stored_files(api) == []


def test_inputs_count_toward_what_one_request_may_store(api, tmp_path: Path) -> None:
    # Given a pool that lets one request store 1024 bytes of free-form text
    settings = Settings(redis_url="redis://unused", home=tmp_path, max_spec_bytes_per_request=1024)
    service = api["http"].app.state.services
    small = TestClient(create_app(settings, services=Services(
        settings=settings, repo=service.repo, artifacts=service.artifacts,
        redis_client=service.redis)))
    source = "s3://bucket/" + "k" * 400

    # When an array's defaults lay a long input under each of 3 items
    response = small.post("/v1/arrays", json={"items": [{}, {}, {}], "defaults": {
        "command": ["true"], "inputs": {"data": source}}}, headers=api["h"]["a"])

    # Then the request is refused on its items and nothing is stored
    assert response.status_code == 422
    assert response.json()["errors"][0]["field"] == "items"
    assert api["http"].get("/v1/jobs", headers=api["h"]["a"]).json()["jobs"] == []
