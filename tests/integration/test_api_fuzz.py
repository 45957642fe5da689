"""The OpenAPI document against the API it describes: schemathesis with every check.

A real `e31 api` process (uvicorn) over a temporary SQLite store and the suite's private Redis,
asked by `schemathesis run --checks all` with a tenant's token: no check left out, no operation
left out, no status code waved through. Every status the API answers is documented, every
answer fits its documented schema, a body the schema allows is taken (or refused for what only
the store knows: 404, 409, 403) and a body it refuses is refused. Bounded for CI by
`FUZZ_TIME_S` and `EXAMPLES_PER_OPERATION`; the seed is random, and a failure prints it with
the command that replays the run (docs/development.md, "The API fuzz test").
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from e31.api import create_app
from e31.api.errors import STATUS
from e31.api.service import Service
from e31.artifacts import ArtifactStore
from e31.clock import utcnow
from e31.settings import Settings
from e31.store import Repo
from tests.conftest import wait_for

FUZZ_TIME_S = 75               # schemathesis's budget: its phases repeat until it is spent
EXAMPLES_PER_OPERATION = 20
WORKERS = 2                    # CI has two cores; the API process takes the other half
START_TIMEOUT_S = 30.0
OUTPUT_SHOWN_CHARS = 12_000    # the end of schemathesis's report, in a failure's message
# Keywords pydantic writes when it cannot say a bound in JSON Schema; a validator would
# ignore them, so the document would allow what the API refuses.
NOT_JSON_SCHEMA = {"gt", "ge", "lt", "le"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def api_process(sqlite_repo: Repo, redis_url: str, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(base URL, a tenant's token) of `e31 api` running over `sqlite_repo`."""
    _, token = sqlite_repo.create_tenant("fuzz", now=utcnow())
    sqlite_repo.create_tenant("bystander", now=utcnow())   # another tenant, never asked about
    port = _free_port()
    env = {**os.environ, "E31_HOME": str(tmp_path), "E31_REDIS_URL": redis_url,
           "E31_DATABASE_URL": str(sqlite_repo.engine.url),
           "E31_ARTIFACTS_URL": f"file://{tmp_path / 'artifacts'}"}
    log = (tmp_path / "api.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "e31.cli", "api", "--host", "127.0.0.1",
                             "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"e31 api exited: {(tmp_path / 'api.log').read_text()}")
        try:
            return httpx.get(f"{base}/v1/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, timeout_s=START_TIMEOUT_S, what="e31 api to answer")
        yield base, token
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.timeout(FUZZ_TIME_S + 120)
def test_schemathesis_finds_nothing_with_every_check(api_process: tuple[str, str],
                                                     tmp_path: Path) -> None:
    # Given the API and a tenant's token
    base, token = api_process
    operations = sum(len(m) for m in httpx.get(f"{base}/openapi.json").json()["paths"].values())

    # When schemathesis runs every check on every operation, within its budget
    run = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", f"{base}/openapi.json",
         "--checks", "all", "--header", f"Authorization: Bearer {token}",
         "--max-examples", str(EXAMPLES_PER_OPERATION), "--max-time", str(FUZZ_TIME_S),
         "--workers", str(WORKERS), "--no-color"],
        cwd=tmp_path, capture_output=True, text=True, timeout=FUZZ_TIME_S + 90, check=False)

    # Then it tested every operation and found nothing (a failure's report names the seed
    # that replays it)
    report = run.stdout + run.stderr
    assert run.returncode == 0, report[-OUTPUT_SHOWN_CHARS:]
    assert f"Tested: {operations}" in report, report[-OUTPUT_SHOWN_CHARS:]


def _walk(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def test_the_document_says_every_refusal_with_one_body_and_only_json_schema(
        sqlite_repo: Repo, redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    # Given the OpenAPI document of the app
    settings = Settings(redis_url=redis_url, home=tmp_path)
    service = Service(settings=settings, repo=sqlite_repo, redis_client=redis_client,
                      artifacts=ArtifactStore(f"file://{tmp_path / 'artifacts'}"))
    doc = create_app(settings, service=service).openapi()

    # Then every operation but health documents 401 and 503, each error answer is ErrorBody,
    error_ref = "#/components/schemas/ErrorBody"
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            codes = set(op["responses"])
            if path != "/v1/health":
                assert {"401", "503"} <= codes, (method, path, codes)
            for code, response in op["responses"].items():
                if int(code) >= 400:
                    schema = response["content"]["application/json"]["schema"]
                    assert schema == {"$ref": error_ref}, (method, path, code)
    # every status the API maps an error to is documented somewhere,
    documented = {int(c) for ms in doc["paths"].values() for op in ms.values()
                  for c in op["responses"]}
    assert {status for _, status, _ in STATUS} <= documented
    # and no schema holds a keyword that JSON Schema does not know (a bound lost to pydantic)
    for node in _walk(doc["components"]["schemas"]):
        if "type" in node:
            assert not NOT_JSON_SCHEMA & set(node), node
