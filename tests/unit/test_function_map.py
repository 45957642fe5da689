"""`.map` over a fake API (httpx's MockTransport): one array request per 10,000 items, the
next one only once the values before it are taken, and the values in input order. No server
runs: the fake answers every job as succeeded, its value the job's number."""

from __future__ import annotations

import json
from typing import Any

import cloudpickle
import httpx
import pytest

import e31
from e31 import Client
from e31.functions import decorator


class FakeApi:
    """Holds the bundles PUT to it and the arrays POSTed, every job succeeded at once."""

    def __init__(self) -> None:
        self.arrays: list[list[str]] = []
        self.bundles: set[str] = set()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path.startswith("/v1/bundles/"):
            digest = path.rpartition("/")[2]
            if request.method == "PUT":
                self.bundles.add(digest)
                return httpx.Response(201, json={})
            return httpx.Response(200 if digest in self.bundles else 404, json={})
        if path == "/v1/arrays" and request.method == "POST":
            items = json.loads(request.content)["items"]
            start = sum(len(a) for a in self.arrays)
            ids = [f"j-{start + i:020d}" for i in range(len(items))]
            self.arrays.append(ids)
            return httpx.Response(201, json={"id": f"a-{len(self.arrays):020d}", "jobs": ids})
        if path.startswith("/v1/arrays/"):
            ids = self.arrays[int(path.split("/")[3][2:]) - 1]
            body: dict[str, Any] = {"total": len(ids), "done": len(ids)}
            body["items"] = [{"index": i, "id": j, "state": "succeeded"}
                             for i, j in enumerate(ids)]
            return httpx.Response(200, json=body)
        if "/outputs/result.pkl" in path:
            return httpx.Response(200, content=cloudpickle.dumps(int(path.split("/")[3][2:])))
        return httpx.Response(404, json={"message": f"no route {path}"})


def test_a_map_submits_one_array_per_10000_items_each_once_the_values_before_it_are_taken(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given arrays of at most 3 items, and a fake API
    monkeypatch.setattr(decorator, "ARRAY_ITEMS_MAX", 3)
    api = FakeApi()
    client = Client("http://e31.invalid", "token")
    client._http = httpx.Client(base_url="http://e31.invalid", transport=httpx.MockTransport(api))

    @e31.function(client=client)
    def same(x: int) -> int:
        return x

    # When 7 items are mapped
    values = same.map(range(7), progress=False)
    # Then the first array is submitted at the call, the others only as the values are taken
    assert [len(a) for a in api.arrays] == [3]
    assert [next(values) for _ in range(4)] == [0, 1, 2, 3]
    assert [len(a) for a in api.arrays] == [3, 3]
    assert list(values) == [4, 5, 6]
    assert [len(a) for a in api.arrays] == [3, 3, 1]
    # And the calls went up as one bundle, beside the code (this test's module), each once
    assert [(s.field, s.uploaded) for s in same.last_sent] == [("code", True), ("call", True)]
    assert len(api.bundles) == 2
