"""Malformed and sparse archives through the real API over a real store: whatever bytes a
tenant uploads as a bundle, the answer is 201, 200, 409 or 422 naming the member, never a 500,
and a refused bundle leaves nothing stored (issue 25)."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from e31.core.clock import utcnow
from e31.store import Repo
from tests.integration.conftest import MakeApp, bearer

# A GNU sparse member written as PAX records (format 1.0) whose map is missing: the data
# after the header is empty. tarfile 3.11 raises a plain ValueError reading its header.
MALFORMED_SPARSE = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0",
                    "GNU.sparse.name": "data.bin", "GNU.sparse.realsize": "1048576"}
# A well-formed sparse member (PAX format 0.1: its map in a record), which tarfile reads.
WELL_FORMED_SPARSE = {"GNU.sparse.map": "0,4", "GNU.sparse.size": "1048576"}
EXAMPLES = 150


def archive(*members: tuple[str, bytes, dict[str, str]]) -> bytes:
    """A PAX tar of (name, data, PAX records) members."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, records in members:
            info = tarfile.TarInfo(name)
            info.size, info.pax_headers = len(data), records
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


# A valid bundle with what mutations can break: PAX records, a long UTF-8 name, a directory.
VALID = archive(("main.py", b"print('hi')\n", {"comment": "x" * 40}),
                ("data/" + "é" * 60 + ".txt", b"0123456789" * 30, {}),
                ("data/small.txt", b"ok", {"mtime": "1700000000.5"}))


def digest(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def stored(tmp_path: Path) -> list[Path]:
    root = tmp_path / "artifacts" / "bundles"
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def put(http: TestClient, token: str, data: bytes):  # type: ignore[no-untyped-def]
    return http.put(f"/v1/bundles/{digest(data)}", content=data, headers=bearer(token))


def test_a_malformed_gnu_sparse_member_is_a_422_naming_it_and_nothing_is_stored(
        repo: Repo, make_app: MakeApp, tmp_path: Path) -> None:
    # Given a tenant, and a bundle whose second member is a GNU sparse file with no map
    _, token = repo.create_tenant("team-a", now=utcnow())
    http = TestClient(make_app())
    bad = archive(("ok.txt", b"hi", {}), ("data.bin", b"", MALFORMED_SPARSE))
    with tarfile.open(fileobj=io.BytesIO(bad)) as tar:   # the error the check used to let out
        try:
            tar.getmembers()
        except ValueError:
            pass
        else:
            raise AssertionError("tarfile reads this header now: the case tests nothing")

    # When it is uploaded
    answer = put(http, token, bad)

    # Then it is refused as the member it is, never a server error, and nothing is kept
    assert answer.status_code == 422, answer.text
    reason = answer.json()["errors"][0]["reason"]
    assert "data.bin" in reason and "malformed header" in reason, reason
    assert stored(tmp_path) == []
    # while the same bundle without the bad member is taken
    assert put(http, token, archive(("ok.txt", b"hi", {}))).status_code == 201


def test_a_well_formed_sparse_member_is_refused_naming_it(repo: Repo, make_app: MakeApp,
                                                          tmp_path: Path) -> None:
    # Given a bundle with a sparse file tarfile reads well
    _, token = repo.create_tenant("team-a", now=utcnow())
    http = TestClient(make_app())
    sparse = archive(("main.py", b"x = 1\n", {}), ("holes.bin", b"abcd", WELL_FORMED_SPARSE))
    with tarfile.open(fileobj=io.BytesIO(sparse)) as tar:
        assert tar.getmember("holes.bin").issparse()

    # When it is uploaded, then it is refused naming the member, and nothing is stored
    answer = put(http, token, sparse)
    assert answer.status_code == 422, answer.text
    assert answer.json()["errors"] == [{"field": "bundle", "reason": "holes.bin: a sparse file; "
                                        "a bundle holds plain files, directories and links "
                                        "inside it"}]
    assert stored(tmp_path) == []


def test_the_valid_bundle_the_mutations_start_from_is_taken(repo: Repo,
                                                            make_app: MakeApp) -> None:
    _, token = repo.create_tenant("team-a", now=utcnow())
    assert put(TestClient(make_app()), token, VALID).status_code == 201


@pytest.fixture
def uploader(repo: Repo, make_app: MakeApp) -> tuple[TestClient, str]:
    """One API app and a tenant's token, shared by every example of a property."""
    _, token = repo.create_tenant("team-a", now=utcnow())
    return TestClient(make_app()), token


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)),
                      min_size=1, max_size=12),
       cut=st.one_of(st.none(), st.integers(0, len(VALID))))
def test_no_byte_mutation_of_a_valid_bundle_gets_a_server_error(
        uploader: tuple[TestClient, str], edits: list[tuple[int, int]], cut: int | None) -> None:
    # Given a valid bundle with some bytes overwritten, and perhaps cut short
    http, token = uploader
    data = bytearray(VALID)
    for at, value in edits:
        data[at] = value
    body = bytes(data[:cut] if cut is not None else data)

    # When it is uploaded under its own hash
    answer = put(http, token, body)

    # Then it is stored, held already, or refused naming why; never a 500
    assert answer.status_code in (200, 201, 422), (answer.status_code, answer.text)
    if answer.status_code == 422:
        assert answer.json()["errors"][0]["field"] == "bundle"


# (GNU.sparse.name renames the member: the concrete case above has it.)
SPARSE_KEYS = ("GNU.sparse.major", "GNU.sparse.minor", "GNU.sparse.realsize",
               "GNU.sparse.size", "GNU.sparse.map", "GNU.sparse.offset", "GNU.sparse.numbytes")


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=st.dictionaries(st.sampled_from(SPARSE_KEYS),
                               st.text(alphabet="0123456789,-x. \n", max_size=12), min_size=1),
       data=st.binary(max_size=1100))
def test_no_sparse_header_gets_a_server_error(uploader: tuple[TestClient, str],
                                              records: dict[str, str], data: bytes) -> None:
    # Given a member with any GNU sparse records and any data (the map of format 1.0 is read
    # from the data), behind a plain file
    http, token = uploader
    body = archive(("ok.txt", b"hi", {}), ("data.bin", data, records))

    # When it is uploaded, then it is refused naming the member, never a 500
    answer = put(http, token, body)
    assert answer.status_code == 422, (answer.status_code, answer.text)
    assert "data.bin" in answer.json()["message"], answer.text
