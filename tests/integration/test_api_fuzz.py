"""The OpenAPI document against the API it describes: schemathesis with every check.

A real `e31 api` process (uvicorn) over a temporary SQLite store and the suite's private Redis,
asked by `schemathesis run --checks all` as each kind of caller in turn (`CALLERS`): a tenant,
another tenant, an admin, a revoked token and no token. No check left out, no operation left
out, no status code waved through: never a 5xx, every status the API answers is documented,
every answer fits its documented schema, a body the schema allows is taken (or refused for what
only the store or the token knows: 401, 403, 404, 409) and a body it refuses is refused; the
verdicts the document cannot decide alone are dropped by fuzz_hooks.py, narrowly.
Bounded for CI by each caller's examples per operation (`CALLERS`: about 60 s in all on an
idle machine), each run capped in time only against a hang; the seed is random, and a failure
prints it with the command that replays the run (docs/development.md, "The API fuzz test").
bench/fuzz_api.py runs the same for longer.
"""

from __future__ import annotations

import contextlib
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
from cryptography.fernet import Fernet

from e31.api import create_app
from e31.api.errors import STATUS, openai_path
from e31.api.services import Services
from e31.core.clock import utcnow
from e31.core.resources import MAX_DISK_GB
from e31.edge.artifacts import ArtifactStore
from e31.edge.settings import Settings
from e31.store import Repo
from tests.conftest import wait_for

# Each caller's examples per operation and a cap on its seconds. Every phase but fuzzing is
# bounded by the examples; the fuzzing phase generates until the cap, whatever its examples
# (measured: 11,963 cases in 150 s with one example per operation, 4,244 in 60 s; every one of
# the 31 operations tested either way). The tenant and the admin reach the most code and run
# every phase (examples, coverage, fuzzing, stateful); the others are refused (or served)
# before most of it runs, so a few fuzzed requests per operation say whether anything answers
# them with a 5xx or outside its schema. CI runs the fuzzing phase alone (every phase with 10
# examples took 6.6 CPU-minutes, 5 still about 10 minutes on 2 cores); `bench/fuzz_api.py`
# runs every phase as every caller for minutes.
CALLERS = {"tenant": (3, 150), "other tenant": (1, 90), "revoked": (1, 90), "none": (1, 90),
           "admin": (2, 150)}
# CI fuzzes as an admin alone, for CI_FUZZ_S: an admin is a tenant too (`fuzz-admin`), so its
# run reaches every operation's handler, the tenants' and the admin API's; the other callers
# are refused before a handler runs (a tenant's 403 on the admin API included), which the
# isolation matrix checks for every route (tests/integration/test_isolation_matrix.py).
# E31_FUZZ_EVERY_CALLER=1 (and bench/fuzz_api.py) runs all five, each for its cap above.
EVERY_CALLER = os.environ.get("E31_FUZZ_EVERY_CALLER") == "1"
FUZZED = tuple(CALLERS) if EVERY_CALLER else ("admin",)
CI_FUZZ_S = 60   # thousands of cases; a failure's report names the seed that replays it
FUZZ_TIME_S = sum(CALLERS[who][1] for who in FUZZED) if EVERY_CALLER else CI_FUZZ_S
EXAMPLES_PER_OPERATION = 3
FULL_EXAMPLES = 10   # fewer: the fuzzing phase alone (CI); bench/fuzz_api.py runs every phase
NOT_BEARER = "Authorization: Bearer"   # no token: the scheme alone, which the API reads as none
WORKERS = 1   # one thread: hypothesis describes lambdas with `ast.parse`, which under CPython 3.11
# failed twice with 2 threads ("SystemError: AST constructor recursion depth mismatch")
START_TIMEOUT_S = 30.0
# The verdicts the document cannot decide alone (a rule JSON Schema cannot state, a retyped
# file part), each dropped narrowly: fuzz_hooks.py says which and why
HOOKS = Path(__file__).with_name("fuzz_hooks.py")
OUTPUT_SHOWN_CHARS = 12_000    # the end of schemathesis's report, in a failure's message
# Keywords pydantic writes when it cannot say a bound in JSON Schema; a validator would
# ignore them, so the document would allow what the API refuses.
NOT_JSON_SCHEMA = {"gt", "ge", "lt", "le"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def caller_tokens(repo: Repo) -> dict[str, str | None]:
    """A token of each kind of caller in `CALLERS` (None: no token). The tenants may use every
    priority the document allows (`max_priority` 9): a tenant's own limit is the one rule a
    document shared by all tenants cannot state, refused 422 by design and tested on its own
    (tests/integration/test_tenant_limits.py)."""
    now = utcnow()
    every_priority = {"max_priority": 9}
    _, tenant = repo.create_tenant("fuzz", now=now, limits=every_priority)
    _, other = repo.create_tenant("bystander", now=now, limits=every_priority)
    _, admin = repo.create_tenant("fuzz-admin", admin=True, now=now, limits=every_priority)
    revoked = repo.create_token("fuzz", now=now, name="revoked")
    repo.revoke_token("fuzz", "revoked", now=now)
    return {"tenant": tenant, "other tenant": other, "admin": admin, "revoked": revoked,
            "none": None}


@contextlib.contextmanager
def running_api(repo: Repo, redis_url: str, tmp_path: Path) -> Iterator[str]:
    """The base URL of `e31 api` running over `repo` and `redis_url` (bench/fuzz_api.py uses
    it too)."""
    port = _free_port()
    env = {**os.environ, "E31_HOME": str(tmp_path), "E31_REDIS_URL": redis_url,
           "E31_DATABASE_URL": str(repo.engine.url),
           "E31_ARTIFACTS_URL": f"file://{tmp_path / 'artifacts'}",
           "E31_SECRETS_KEY": Fernet.generate_key().decode(),   # secrets on, as `e31 up` has
           # the pool's cap on resources.disk_gb at the document's own: like a tenant's
           # max_priority, a pool's cap is a rule a document shared by every pool cannot
           # state, refused 422 by design (tests/integration/test_limits.py)
           "E31_ATTEMPT_DISK_MAX_GB": str(MAX_DISK_GB)}
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
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def schemathesis_run(base: str, token: str | None, *, max_time_s: int, cwd: Path,
                     examples: int = EXAMPLES_PER_OPERATION) -> subprocess.CompletedProcess[str]:
    """`schemathesis run --checks all` against the API's live document, as `token`'s caller:
    every phase with `examples` of at least FULL_EXAMPLES, else the fuzzing phase alone."""
    # No token: the bearer scheme without credentials, which the API reads as no token
    # (schemathesis left to its own devices fills in the bearer scheme, and slowly).
    auth = ["--header", f"Authorization: Bearer {token}" if token else NOT_BEARER]
    phases = [] if examples >= FULL_EXAMPLES else ["--phases", "fuzzing"]
    hooks = {"SCHEMATHESIS_HOOKS": str(HOOKS)}
    return subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", f"{base}/openapi.json",
         "--checks", "all", *auth, *phases, "--max-examples", str(examples),
         "--max-time", str(max_time_s), "--workers", str(WORKERS), "--no-color"],
        cwd=cwd, env={**os.environ, **hooks}, capture_output=True, text=True,
        timeout=max_time_s + 90, check=False)


@pytest.fixture
def api_process(sqlite_repo: Repo, redis_url: str,
                tmp_path: Path) -> Iterator[tuple[str, dict[str, str | None]]]:
    """(base URL, a token of each kind of caller) of `e31 api` running over `sqlite_repo`."""
    tokens = caller_tokens(sqlite_repo)
    with running_api(sqlite_repo, redis_url, tmp_path) as base:
        yield base, tokens


@pytest.mark.timeout(FUZZ_TIME_S + 30 * len(FUZZED))
def test_schemathesis_finds_nothing_with_every_check_as_every_caller(
        api_process: tuple[str, dict[str, str | None]], tmp_path: Path) -> None:
    # Given the API and a token of each kind of caller
    base, tokens = api_process
    operations = sum(len(m) for m in httpx.get(f"{base}/openapi.json").json()["paths"].values())

    # When schemathesis runs every check on every operation as each caller, within its budget
    # (the admin last: its changes to tenants and tokens touch no other caller's run)
    failures = []
    for who in FUZZED:
        examples, cap_s = CALLERS[who]
        if not EVERY_CALLER:    # the admin's run stands for the tenant's too
            examples, cap_s = max(examples, CALLERS["tenant"][0]), CI_FUZZ_S
        run = schemathesis_run(base, tokens[who], max_time_s=cap_s, cwd=tmp_path,
                               examples=examples)
        report = run.stdout + run.stderr

        # Then it tested every operation and found nothing (a failure's report names the seed
        # that replays it)
        if run.returncode != 0 or f"Tested: {operations}" not in report:
            failures.append(f"--- as {who}:\n{report[-OUTPUT_SHOWN_CHARS:]}")
    assert not failures, "\n".join(failures)


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
    service = Services(settings=settings, repo=sqlite_repo, redis_client=redis_client,
                      artifacts=ArtifactStore(f"file://{tmp_path / 'artifacts'}"))
    doc = create_app(settings, services=service).openapi()

    # Then every operation but health documents 401 and 503, each error answer is ErrorBody
    # (OpenAIErrorBody on the OpenAI-compatible routes, whose client reads OpenAI's shape),
    for path, methods in doc["paths"].items():
        error_ref = ("#/components/schemas/OpenAIErrorBody" if openai_path(path)
                     else "#/components/schemas/ErrorBody")
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
