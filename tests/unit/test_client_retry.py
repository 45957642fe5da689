"""The client's reads ride out a 503 (the store briefly unreachable); writes do not retry."""

from __future__ import annotations

import httpx
import pytest

from e31.client import Client
from e31.core.errors import ClientError


def _client(answers: list[int]) -> tuple[Client, list[str]]:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.method)
        status = answers.pop(0) if answers else 200
        if status == 503:
            return httpx.Response(503, headers={"Retry-After": "0.1"}, json={
                "error": "store_unavailable", "message": "results store unavailable"})
        return httpx.Response(status, json={"id": "j-00000000000000000000", "state": "queued"})

    client = Client("http://e31.invalid", "token")
    client._http = httpx.Client(base_url="http://e31.invalid",
                                transport=httpx.MockTransport(handler))
    return client, seen


def test_a_read_that_meets_503_is_retried_until_the_store_is_back() -> None:
    client, seen = _client([503, 503])

    status = client.request("GET", "/v1/jobs/j-00000000000000000000").json()

    assert status["state"] == "queued"
    assert seen == ["GET", "GET", "GET"]


def test_a_write_that_meets_503_fails_at_once_with_the_servers_message() -> None:
    client, seen = _client([503])

    with pytest.raises(ClientError) as failed:
        client.request("POST", "/v1/jobs", json={})

    assert "results store unavailable" in str(failed.value)
    assert seen == ["POST"]
