"""Bounded requests, attacked through the real API over a real store and Redis: a body too
big (declared, or streamed in chunks to a real HTTP server), env and argv past their caps, an
array flooding `after`, names that forge log lines, lax numbers in bodies and queries.

Each attack is also run with the limit raised through settings (or the check switched off),
and then gets through: the test would catch the hole it closes.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import TypeAdapter

from e31.api.services import arrays as arrays_service
from e31.core import spec as spec_module
from e31.core.clock import utcnow
from e31.edge.celeryapp import make_celery
from e31.edge.settings import Settings
from e31.ops.heartbeat import WorkerInfo, write
from e31.scheduling import leader as leader_module
from e31.scheduling.leader import Scheduler
from e31.store import Repo
from tests.conftest import wait_for
from tests.integration.conftest import MakeApp

MiB = 1 << 20
DEFAULT_LIMIT_BYTES = Settings().max_request_bytes
CPU = {"entrypoint": "m:f", "resources": {"gpus": 0}}
FORGED = "train\n2026-01-01 00:00:00 e31_worker INFO job_succeeded job=j-FORGED"



@pytest.fixture
def token(repo: Repo) -> dict[str, str]:
    _, secret = repo.create_tenant("team-a", now=utcnow())
    return {"Authorization": f"Bearer {secret}"}


def stored_jobs(repo: Repo, headers: dict[str, str]) -> int:
    tenant = repo.tenant_for_token(headers["Authorization"].removeprefix("Bearer "))
    assert tenant is not None
    return len(repo.list_jobs(tenant.id, limit=100_000))


def fields_of(response: Any) -> list[str]:
    assert response.status_code == 422, response.text[:500]
    payload = response.json()
    assert payload["error"] == "spec_invalid"
    return [e["field"] for e in payload["errors"]]


# -- a real HTTP server, and a client that stops sending once it is answered ---------------

@contextmanager
def serving(app: FastAPI) -> Iterator[int]:
    """`app` behind uvicorn on a free local port, in a thread, for the test's duration."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout_s=20)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=20)


def env_body(value_bytes: int, chunk_bytes: int = 64 * 1024) -> Iterator[bytes]:
    """A job spec whose env holds one variable of `value_bytes`, produced a chunk at a time
    (the same chunk again and again: the test never holds the body either)."""
    yield b'{"entrypoint": "m:f", "resources": {"gpus": 0}, "env": {"BLOB": "'
    block = b"x" * chunk_bytes
    for _ in range(value_bytes // chunk_bytes):
        yield block
    yield b"x" * (value_bytes % chunk_bytes) + b'"}}'


def body_length(value_bytes: int) -> int:
    return sum(len(c) for c in env_body(value_bytes % (64 * 1024))) + \
        value_bytes - value_bytes % (64 * 1024)


def post_streaming(port: int, headers: dict[str, str], body: Iterator[bytes], *,
                   length: int | None, timeout_s: float = 120.0) -> tuple[int, bytes, int]:
    """POST /v1/jobs with `body` sent as long as the server takes it: with a Content-Length of
    `length`, or chunked when None. Stops sending once an answer arrives. Returns the status,
    the answer's body and how many bytes of the request's body were sent."""
    head = ["POST /v1/jobs HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
            *(f"{k}: {v}" for k, v in headers.items()),
            f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"]
    frames = body if length is not None else _chunked(body)
    answer, sent, pending = b"", 0, b""
    deadline = time.monotonic() + timeout_s
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        sock.setblocking(False)
        more = True
        while time.monotonic() < deadline and not _complete(answer):
            want_write = [sock] if more or pending else []
            readable, writable, _ = select.select([sock], want_write, [], 1.0)
            if readable:
                data = sock.recv(1 << 16)
                if not data:
                    break
                answer += data
            elif writable:
                if not pending:
                    pending = next(frames, b"")
                    more = bool(pending)
                try:
                    n = sock.send(pending)
                except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                    continue
                sent, pending = sent + n, pending[n:]
    head_bytes, _, content = answer.partition(b"\r\n\r\n")
    status = int(head_bytes.split(b" ", 2)[1])
    return status, content, sent


def _chunked(body: Iterator[bytes]) -> Iterator[bytes]:
    for block in body:
        if block:
            yield f"{len(block):x}\r\n".encode() + block + b"\r\n"
    yield b"0\r\n\r\n"


def _complete(answer: bytes) -> bool:
    head, sep, content = answer.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(content) >= int(value)
    return False


# -- the body limit -------------------------------------------------------------------------

@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_200_MB_env_is_refused_with_413_and_never_read_into_memory(
        make_app: MakeApp, token: dict[str, str], repo: Repo, chunked: bool) -> None:
    # Given the API at its default limit, behind a real HTTP server
    value_bytes = 200 * 1000 * 1000
    with serving(make_app()) as port:
        # When a client streams a job whose env holds 200 MB, declared or in chunks
        tracemalloc.start()
        try:
            status, answer, sent = post_streaming(
                port, token, env_body(value_bytes),
                length=None if chunked else body_length(value_bytes))
            _, peak_bytes = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()

    # Then it gets 413 naming the limit, the API stopped reading near the limit and never
    # held the body, and nothing was stored
    assert status == 413
    payload = json.loads(answer)
    assert payload["error"] == "request_too_large"
    assert payload["limit_bytes"] == DEFAULT_LIMIT_BYTES
    assert str(DEFAULT_LIMIT_BYTES) in payload["message"]
    assert sent < 64 * MiB, f"the server took {sent} bytes of a body over the limit"
    assert peak_bytes < 64 * MiB, f"the API process peaked at {peak_bytes} bytes"
    assert stored_jobs(repo, token) == 0


@pytest.mark.parametrize("raised", [False, True], ids=["default-limits", "limits-raised"])
def test_a_chunked_body_over_the_limit_is_read_whole_only_when_the_limit_is_raised(
        make_app: MakeApp, token: dict[str, str], repo: Repo, raised: bool) -> None:
    # Given a 20 MB env, over the default body limit of 16 MiB; and the same request against
    # an API whose limits were raised through settings (what the hole looked like)
    value_bytes = 20 * 1000 * 1000
    limits = dict(max_request_bytes=64 * MiB, max_env_bytes=64 * MiB,
                  max_spec_bytes_per_request=64 * MiB) if raised else {}
    with serving(make_app(**limits)) as port:
        status, answer, sent = post_streaming(port, token, env_body(value_bytes), length=None)

    if raised:
        # Then with the limits raised the whole body is read and the job stored with its env
        assert status == 201, answer[:300]
        job = repo.get_job(None, json.loads(answer)["id"])
        assert len(job.spec["env"]["BLOB"]) == value_bytes
        assert sent > value_bytes
    else:
        # and at the defaults it is refused, nothing stored
        assert status == 413 and json.loads(answer)["limit_bytes"] == DEFAULT_LIMIT_BYTES
        assert stored_jobs(repo, token) == 0


def test_a_body_of_exactly_the_limit_is_read_and_one_byte_more_is_413(
        make_app: MakeApp, token: dict[str, str], repo: Repo) -> None:
    client = TestClient(make_app(max_request_bytes=2048))
    spec = json.dumps(CPU).encode()
    at_limit = spec + b" " * (2048 - len(spec))           # JSON may end in spaces
    headers = {**token, "Content-Type": "application/json"}

    assert client.post("/v1/jobs", content=at_limit, headers=headers).status_code == 201
    over = client.post("/v1/jobs", content=at_limit + b" ", headers=headers)
    assert over.status_code == 413
    assert over.json() == {"error": "request_too_large", "limit_bytes": 2048,
                           "message": "the request body is larger than 2048 bytes "
                                      "(max_request_bytes)"}
    assert over.headers["X-E31-Version"]
    assert stored_jobs(repo, token) == 1


# -- env and argv ---------------------------------------------------------------------------

ENV_AND_ARGV = [
    ("env-count", {**CPU, "env": {f"V{i}": "1" for i in range(257)}}, "env",
     {"max_env_vars": 1000}),
    ("env-bytes", {**CPU, "env": {"BLOB": "x" * 70_000}}, "env", {"max_env_bytes": MiB}),
    ("argv-bytes", {"command": ["echo", "x" * 140_000], "resources": {"gpus": 0}}, "command",
     {"max_argv_bytes": MiB}),
]


@pytest.mark.parametrize("spec, field, raised", [c[1:] for c in ENV_AND_ARGV],
                         ids=[c[0] for c in ENV_AND_ARGV])
def test_env_and_argv_past_their_caps_get_422_naming_the_field(
        make_app: MakeApp, token: dict[str, str], repo: Repo, spec: dict[str, Any], field: str,
        raised: dict[str, int]) -> None:
    # Given a job past a default cap on one job: refused, naming the field and the setting
    response = TestClient(make_app()).post("/v1/jobs", json=spec, headers=token)
    assert fields_of(response) == [field]
    assert "max_" in response.json()["errors"][0]["reason"]
    assert stored_jobs(repo, token) == 0

    # and as an item of an array: named by its index
    items = [CPU, spec]
    response = TestClient(make_app()).post("/v1/arrays", json={"items": items}, headers=token)
    assert fields_of(response) == [f"items[1].{field}"]

    # When the cap is raised through settings, the same job is taken
    assert TestClient(make_app(**raised)).post("/v1/jobs", json=spec,
                                               headers=token).status_code == 201


def test_defaults_multiplied_over_an_array_are_capped_for_the_whole_request(
        make_app: MakeApp, token: dict[str, str], repo: Repo) -> None:
    # Given an array whose defaults carry a 20 kB env (within the cap on one job) under 100
    # items: 2 MB for the store from a 20 kB request
    body = {"items": [{"params": {"i": i}} for i in range(100)],
            "defaults": {**CPU, "env": {"BLOB": "x" * 20_000}}}

    # When the request cap is 1 MiB, the whole array is refused naming the items and the cap
    response = TestClient(make_app(max_spec_bytes_per_request=MiB)).post(
        "/v1/arrays", json=body, headers=token)
    assert fields_of(response) == ["items"]
    assert "max_spec_bytes_per_request" in response.json()["errors"][0]["reason"]
    assert stored_jobs(repo, token) == 0

    # and at the default cap (32 MiB) the same array is taken
    taken = TestClient(make_app()).post("/v1/arrays", json=body, headers=token)
    assert taken.status_code == 201 and len(taken.json()["jobs"]) == 100


# -- after ----------------------------------------------------------------------------------

def test_a_17_MB_array_of_random_after_ids_is_refused_quickly(
        make_app: MakeApp, token: dict[str, str], repo: Repo) -> None:
    # Given 10,000 items naming 64 made-up dependencies each (640,000 ids, about 17 MB)
    items = [{**CPU, "after": [f"j-{(i * 64 + k):020x}" for k in range(64)]}
             for i in range(10_000)]
    body = json.dumps({"items": items}).encode()
    assert len(body) > DEFAULT_LIMIT_BYTES
    headers = {**token, "Content-Type": "application/json"}

    # When it is posted at the default limits: 413, at once
    started = time.monotonic()
    response = TestClient(make_app()).post("/v1/arrays", content=body, headers=headers)
    assert response.status_code == 413
    assert response.json()["limit_bytes"] == DEFAULT_LIMIT_BYTES

    # When the body limit is raised, the cap on after over the whole request refuses it
    response = TestClient(make_app(max_request_bytes=64 * MiB)).post(
        "/v1/arrays", content=body, headers=headers)
    elapsed_s = time.monotonic() - started
    assert fields_of(response) == ["items"]
    assert "max_after_per_request" in response.json()["errors"][0]["reason"]

    # Then both answers came quickly and nothing was stored
    assert elapsed_s < 30, f"{elapsed_s:.1f} s to refuse"
    assert stored_jobs(repo, token) == 0


def test_after_is_capped_over_the_whole_request_not_per_job(
        make_app: MakeApp, token: dict[str, str], repo: Repo) -> None:
    # Given 64 real jobs, and an array of 200 items that each wait for all 64 (12,800
    # dependencies, each item within the 64 a job may name)
    client = TestClient(make_app())
    deps = [client.post("/v1/jobs", json=CPU, headers=token).json()["id"] for _ in range(64)]
    body = {"items": [{"params": {"i": i}} for i in range(200)],
            "defaults": {**CPU, "after": deps}}

    # When posted at the default cap of 10,000 per request: 422 naming the cap
    response = client.post("/v1/arrays", json=body, headers=token)
    assert fields_of(response) == ["items"]
    assert "max_after_per_request" in response.json()["errors"][0]["reason"]
    assert stored_jobs(repo, token) == 64

    # When the cap is raised through settings, the same array is taken
    raised = TestClient(make_app(max_after_per_request=20_000))
    response = raised.post("/v1/arrays", json=body, headers=token)
    assert response.status_code == 201, response.text[:300]
    assert stored_jobs(repo, token) == 264


# -- names ----------------------------------------------------------------------------------

NAMED = [
    ("job", "/v1/jobs", {**CPU, "name": FORGED}, "name"),
    ("array", "/v1/arrays", {"name": FORGED, "items": [CPU]}, "name"),
    ("item", "/v1/arrays", {"items": [CPU, {**CPU, "name": FORGED}]}, "items[1].name"),
    ("defaults", "/v1/arrays", {"items": [CPU], "defaults": {"name": FORGED}}, "items[0].name"),
]


@pytest.mark.parametrize("path, body, field", [c[1:] for c in NAMED], ids=[c[0] for c in NAMED])
def test_a_name_with_a_newline_gets_422_naming_the_field(
        make_app: MakeApp, token: dict[str, str], repo: Repo, monkeypatch: pytest.MonkeyPatch,
        path: str, body: dict[str, Any], field: str) -> None:
    client = TestClient(make_app())
    response = client.post(path, json=body, headers=token)
    assert fields_of(response) == [field]
    assert "control character" in response.json()["errors"][0]["reason"]
    assert stored_jobs(repo, token) == 0

    # With the check switched off (the hole), the same request is taken
    monkeypatch.setattr(spec_module, "check_name", lambda value, what="": value)
    monkeypatch.setattr(arrays_service, "check_name", lambda value, what="": value)
    assert client.post(path, json=body, headers=token).status_code == 201


@pytest.mark.parametrize("escaped", [True, False], ids=["printable", "hole"])
def test_a_stored_name_with_a_newline_reaches_the_worker_log_as_one_line(
        repo: Repo, redis_url: str, redis_client: redis.Redis, make_app: MakeApp,
        token: dict[str, str], monkeypatch: pytest.MonkeyPatch, escaped: bool) -> None:
    # Given a job stored with a forged name (as one could before names were checked)
    monkeypatch.setattr(spec_module, "check_name", lambda value, what="": value)
    job = TestClient(make_app()).post("/v1/jobs", json={**CPU, "name": FORGED}, headers=token)
    assert job.status_code == 201
    if not escaped:
        monkeypatch.setattr(leader_module, "printable", lambda text: text)

    # When the scheduler publishes it to an idle worker
    write(redis_client, WorkerInfo(node="cpu0@n", queues=("e31.cpu",), gpus="", gpu_count=0),
          interval_s=10)
    settings = Settings(redis_url=redis_url)
    scheduler = Scheduler(settings=settings, repo=repo, redis_client=redis_client,
                          celery=make_celery(settings))
    assert scheduler.tick() == 1

    # Then the task label a Celery worker logs ("Task <label>[id] received") is one line
    [raw] = [m for key in redis_client.scan_iter(match="e31.cpu*")
             if redis_client.type(key) == b"list" for m in redis_client.lrange(key, 0, -1)]
    label = json.loads(raw)["headers"]["shadow"]
    line = f"INFO Task {label}[{job.json()['id']}] received"
    if escaped:
        assert line.count("\n") == 0 and "job_succeeded job=j-FORGED" in line
    else:
        assert line.splitlines()[1].endswith("job_succeeded job=j-FORGED[" +
                                              job.json()["id"] + "] received")


# -- strict types ---------------------------------------------------------------------------

LAX = [
    ("priority-true", "/v1/jobs", {**CPU, "priority": True}, "priority"),
    ("priority-string", "/v1/jobs", {**CPU, "priority": "9"}, "priority"),
    ("gpus-float", "/v1/jobs", {**CPU, "resources": {"gpus": 0.5}}, "resources.gpus"),
    ("timeout-string", "/v1/jobs", {**CPU, "timeout_s": "60"}, "timeout_s"),
    ("retries-true", "/v1/jobs", {**CPU, "retries": {"max": True}}, "retries.max"),
    ("item-priority", "/v1/arrays", {"items": [{**CPU, "priority": "9"}]}, "items[0].priority"),
    ("defaults-gpus", "/v1/arrays", {"items": [{"entrypoint": "m:f"}],
                                     "defaults": {"resources": {"gpus": False}}},
     "items[0].resources.gpus"),
    ("array-name", "/v1/arrays", {"name": 5, "items": [CPU]}, "name"),
]


@pytest.mark.parametrize("path, body, field", [c[1:] for c in LAX], ids=[c[0] for c in LAX])
def test_a_boolean_or_a_string_for_a_number_gets_422(
        make_app: MakeApp, token: dict[str, str], repo: Repo, path: str, body: dict[str, Any],
        field: str) -> None:
    assert fields_of(TestClient(make_app()).post(path, json=body, headers=token)) == [field]
    assert stored_jobs(repo, token) == 0


def test_valid_specs_are_taken_as_before(make_app: MakeApp, token: dict[str, str]) -> None:
    client = TestClient(make_app())
    job = client.post("/v1/jobs", json={**CPU, "priority": 5, "timeout_s": 60,
                                        "retries": {"max": 2, "backoff_s": 1}}, headers=token)
    assert job.status_code == 201 and job.json()["priority"] == 5
    array = client.post("/v1/arrays", json={"name": "sweep", "items": [{"params": {"i": 1}}],
                                            "defaults": CPU}, headers=token)
    assert array.status_code == 201 and array.json()["name"] == "sweep"


QUERIES = [
    ("/v1/jobs", "limit", ["1_0", "+5", " 5", "5.0", "true", "1e3", "9" * 30], "10"),
    ("/v1/jobs/{job}/logs", "offset", ["1_0", "-0", "0.0", "false"], "0"),
    ("/v1/jobs/{job}/logs", "attempt", ["1_0", "+1", "1.0", "true"], "1"),
    ("/v1/jobs/{job}/logs", "limit", ["1_0", "+1", "1.0", "true"], "1"),
    ("/v1/arrays/{array}", "items", ["1", "yes", "on", "True"], "false"),
    ("/v1/usage", "all_tenants", ["1", "yes", "on", "t"], "false"),
]


@pytest.mark.parametrize("path, name, bad, good", QUERIES,
                         ids=[f"{q[0].rsplit('/', 1)[-1]}-{q[1]}" for q in QUERIES])
def test_query_numbers_are_digits_and_booleans_true_or_false(
        make_app: MakeApp, token: dict[str, str], path: str, name: str, bad: list[str],
        good: str) -> None:
    # Given ids of no job and no array: a query that passes gets as far as 404
    client = TestClient(make_app())
    url = path.format(job="j-" + "0" * 20, array="a-" + "0" * 20)
    for value in bad:
        assert fields_of(client.get(url, params={name: value}, headers=token)) == [name], value
    assert client.get(url, params={name: good}, headers=token).status_code in (200, 404)

    # Lax parsing (the hole) would have taken them
    lax = TypeAdapter(int if good.isdigit() else bool)
    lax.validate_python(bad[0])


def test_the_openapi_schema_keeps_the_bounds_of_strict_query_numbers(make_app: MakeApp) -> None:
    # The digits-only check must not hide a parameter's bounds from the schema
    schema = make_app().openapi()
    limit = next(p for p in schema["paths"]["/v1/jobs"]["get"]["parameters"]
                 if p["name"] == "limit")
    assert (limit["schema"]["type"], limit["schema"]["minimum"], limit["schema"]["maximum"]) \
        == ("integer", 1, 1000)
    logs = {p["name"]: p["schema"] for p in
            schema["paths"]["/v1/jobs/{job_id}/logs"]["get"]["parameters"]}
    assert logs["offset"]["minimum"] == 0 and "ge" not in logs["offset"]
    assert logs["attempt"]["anyOf"][0]["minimum"] == 1
