"""`JobHandle` and `ArrayHandle` over a fake API (httpx's MockTransport): waiting, results,
downloads and the errors they raise. No server runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from e31 import ArrayHandle, Client, JobFailed, JobHandle
from e31.core.errors import ClientError

JOB = "j-00000000000000000000"


def _client(handler: Callable[[httpx.Request], httpx.Response]) -> Client:
    client = Client("http://e31.invalid", "token")
    client._http = httpx.Client(base_url="http://e31.invalid",
                                transport=httpx.MockTransport(handler))
    return client


def test_wait_polls_until_the_job_is_final_and_returns_its_status() -> None:
    # Given a job that is queued, then running, then succeeded
    states = ["queued", "running", "succeeded"]
    client = _client(lambda _: httpx.Response(200, json={"id": JOB, "state": states.pop(0),
                                                         "result": 42}))

    # When its owner waits for it
    status = JobHandle(client, JOB).wait(timeout=5)

    # Then the last status is returned, and no poll was left unread
    assert status["state"] == "succeeded" and states == []


def test_wait_raises_job_failed_for_a_job_that_did_not_succeed() -> None:
    client = _client(lambda _: httpx.Response(200, json={"id": JOB, "state": "failed",
                                                         "reason": "error"}))

    with pytest.raises(JobFailed):
        JobHandle(client, JOB).wait(timeout=5)


def test_download_writes_every_output_under_the_directory(tmp_path: Path) -> None:
    # Given a job with two output files, one in a subdirectory
    files = {"a.txt": b"alpha", "sub/b.bin": b"\x00beta"}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/outputs"):
            return httpx.Response(200, json={"outputs": [{"path": p, "size": len(b)}
                                                         for p, b in files.items()]})
        return httpx.Response(200, content=files[request.url.path.split("/outputs/", 1)[1]])

    # When they are downloaded
    paths = JobHandle(_client(handler), JOB).download(tmp_path)

    # Then each is written at its path with its bytes
    assert {p.relative_to(tmp_path).as_posix(): p.read_bytes() for p in paths} == files


def test_a_download_the_api_refuses_raises_client_error_and_writes_nothing(tmp_path: Path) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/outputs"):
            return httpx.Response(200, json={"outputs": [{"path": "gone.txt", "size": 1}]})
        return httpx.Response(404, json={"error": "not_found", "message": "no output gone.txt"})

    with pytest.raises(ClientError) as refused:
        JobHandle(_client(handler), JOB).download(tmp_path)

    assert refused.value.status_code == 404 and "no output gone.txt" in str(refused.value)
    assert not (tmp_path / "gone.txt").exists()


def test_an_array_handle_gives_a_job_handle_per_item_in_index_order() -> None:
    client = _client(lambda _: httpx.Response(500))
    array = ArrayHandle(client, "a-00000000000000000000", job_ids=["j-1", "j-2"])

    assert [job.id for job in array.jobs()] == ["j-1", "j-2"]
