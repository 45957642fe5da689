"""The isolation matrix: every route of the API × every kind of caller, each cell the status
the caller must get (docs/security.md, "Who may do what").

Callers: the owner of the objects asked about, another tenant, an admin (of a third tenant),
the owner's revoked token, the owner's expired token, the token of a disabled tenant, and no
token. The rows are checked against the app's route table (`app.routes`): a route without a
row fails the test, naming it, so a new endpoint cannot ship without saying who may use it.
The real app runs over a real store (SQLite and PostgreSQL) and Redis.

The owner is asked last, so that what the others are refused is refused while the owner's
objects exist (a job, an array, an output, a bundle, a token, a secret), and the owner's own
answer (200) shows each object was there to find: no refusal here passes for want of a target.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import pytest
import redis
from cryptography.fernet import Fernet
from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from sqlalchemy import update

from e31.api import create_app
from e31.api.services import Services
from e31.core.clock import utcnow
from e31.edge.artifacts import ArtifactStore
from e31.edge.settings import Settings
from e31.store import Repo
from e31.store.batches import ModelRecord
from e31.store.models import ApiKey

# The owner last: see the module's docstring.
CALLERS = ("other", "admin", "revoked", "expired", "disabled", "none", "owner")
REFUSED = {"revoked": 401, "expired": 401, "disabled": 403, "none": 401}
CPU_JOB = {"entrypoint": "m:f", "resources": {"gpus": 0}}
METRICS_TOKEN = "metrics-only"


@dataclass
class World:
    http: TestClient
    repo: Repo
    headers: dict[str, dict[str, str]]   # caller -> its Authorization header (none: {})
    ids: dict[str, str]                  # job, array, digest: the owner's objects


Request = tuple[str, str, dict[str, Any]]      # method, path, httpx keywords
Builder = Callable[[World, str], Request]      # (world, caller) -> the request it sends


def ask(method: str, path: str, **kwargs: Any) -> Builder:
    """A request whose path and JSON may name the owner's objects ({job}, {array}, {digest})
    and the caller ({who}, for names that must differ per caller)."""
    def build(w: World, who: str) -> Request:
        fill = {**w.ids, "who": who}
        out = dict(kwargs)
        if "json" in out:
            out["json"] = {k: v.format(**fill) if isinstance(v, str) else v
                           for k, v in out["json"].items()}
        return method, path.format(**fill), out
    return build


def revoke_a_fresh_owner_token(w: World, who: str) -> Request:
    """DELETE of an owner's token made for this caller's cell (so each cell has one to try)."""
    w.repo.add_token("owner", now=utcnow(), name=f"victim-{who}")
    return "DELETE", f"/v1/tokens/victim-{who}?tenant=owner", {}


def tenants(owner: int, other: int, admin: int) -> dict[str, int]:
    """The cells of a route every valid token reaches, by who asks."""
    return {"owner": owner, "other": other, "admin": admin, **REFUSED}


def everyone(status: int) -> dict[str, int]:
    return dict.fromkeys(CALLERS, status)


def _bundle() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = b"print('hi')\n"
        info = tarfile.TarInfo("main.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


BUNDLE = _bundle()
REQUESTS = (b'{"custom_id": "a", "url": "/v1/chat/completions", "body": {"model": "tiny", '
            b'"messages": [{"role": "user", "content": "hi"}]}}\n')
OWNED = tenants(200, 404, 404)           # the owner's object: another's reads as never existed
READ = tenants(200, 404, 200)            # ... which an admin's token may read (never write)
ADMIN_ONLY = tenants(403, 403, 200)
ROWS: dict[tuple[str, str], tuple[Builder, dict[str, int]]] = {
    ("GET", "/v1/health"): (ask("GET", "/v1/health"), everyone(200)),
    ("POST", "/v1/jobs"): (ask("POST", "/v1/jobs", json=CPU_JOB), tenants(201, 201, 201)),
    ("GET", "/v1/jobs"): (ask("GET", "/v1/jobs"), tenants(200, 200, 200)),
    ("GET", "/v1/jobs/{job_id}"): (ask("GET", "/v1/jobs/{job}"), READ),
    ("POST", "/v1/jobs/{job_id}/cancel"): (ask("POST", "/v1/jobs/{job}/cancel"), OWNED),
    ("GET", "/v1/jobs/{job_id}/logs"): (ask("GET", "/v1/jobs/{job}/logs"), READ),
    ("GET", "/v1/jobs/{job_id}/gpu"): (ask("GET", "/v1/jobs/{job}/gpu"), READ),
    ("GET", "/v1/jobs/{job_id}/outputs"): (ask("GET", "/v1/jobs/{job}/outputs"), READ),
    ("GET", "/v1/jobs/{job_id}/outputs/{path:path}"): (
        ask("GET", "/v1/jobs/{job}/outputs/result.txt"), READ),
    ("POST", "/v1/arrays"): (ask("POST", "/v1/arrays", json={"items": [CPU_JOB]}),
                             tenants(201, 201, 201)),
    ("GET", "/v1/arrays/{array_id}"): (ask("GET", "/v1/arrays/{array}"), READ),
    ("POST", "/v1/arrays/{array_id}/cancel"): (ask("POST", "/v1/arrays/{array}/cancel"), OWNED),
    ("POST", "/v1/arrays/{array_id}/retry"): (ask("POST", "/v1/arrays/{array}/retry"), OWNED),
    ("GET", "/v1/arrays/{array_id}/manifest"): (ask("GET", "/v1/arrays/{array}/manifest"),
                                                 READ),
    ("GET", "/v1/queue"): (ask("GET", "/v1/queue"), tenants(200, 200, 200)),
    ("GET", "/v1/pool/environments"): (ask("GET", "/v1/pool/environments"),
                                       tenants(200, 200, 200)),   # the pool's, no tenant's
    ("GET", "/v1/usage"): (ask("GET", "/v1/usage?all_tenants=true"), ADMIN_ONLY),
    ("GET", "/v1/usage/daily"): (ask("GET", "/v1/usage/daily?all_tenants=true"), ADMIN_ONLY),
    ("GET", "/v1/top"): (ask("GET", "/v1/top"), tenants(200, 200, 200)),
    ("HEAD", "/v1/bundles/{digest}"): (ask("HEAD", "/v1/bundles/{digest}"), OWNED),
    ("PUT", "/v1/bundles/{digest}"): (ask("PUT", "/v1/bundles/{digest}", content=BUNDLE),
                                      tenants(200, 201, 201)),   # each tenant's own copy
    ("GET", "/v1/tokens"): (ask("GET", "/v1/tokens?tenant=owner"), tenants(200, 403, 200)),
    ("POST", "/v1/tokens"): (ask("POST", "/v1/tokens?tenant=owner", json={"name": "by-{who}"}),
                             tenants(201, 403, 201)),
    ("DELETE", "/v1/tokens/{name}"): (revoke_a_fresh_owner_token, tenants(200, 403, 200)),
    ("GET", "/v1/admin/tenants"): (ask("GET", "/v1/admin/tenants"), ADMIN_ONLY),
    ("POST", "/v1/admin/tenants"): (ask("POST", "/v1/admin/tenants", json={"name": "new-{who}"}),
                                    tenants(403, 403, 201)),
    ("GET", "/v1/admin/tenants/{name}"): (ask("GET", "/v1/admin/tenants/other"), ADMIN_ONLY),
    ("PATCH", "/v1/admin/tenants/{name}"): (
        ask("PATCH", "/v1/admin/tenants/other", json={"weight": 2.0}), ADMIN_ONLY),
    ("POST", "/v1/admin/tenants/{name}/disable"): (
        ask("POST", "/v1/admin/tenants/bystander/disable"), ADMIN_ONLY),
    ("POST", "/v1/admin/tenants/{name}/enable"): (
        ask("POST", "/v1/admin/tenants/bystander/enable"), ADMIN_ONLY),
    ("GET", "/v1/admin/audit"): (ask("GET", "/v1/admin/audit"), ADMIN_ONLY),
    # Secrets: each tenant's own; none answers another's (there is no admin view).
    ("PUT", "/v1/secrets/{name}"): (ask("PUT", "/v1/secrets/HF_TOKEN", json={"value": "v-{who}"}),
                                    tenants(200, 201, 201)),   # the owner's exists: replaced
    ("GET", "/v1/secrets"): (ask("GET", "/v1/secrets"), tenants(200, 200, 200)),
    ("DELETE", "/v1/secrets/{name}"): (ask("DELETE", "/v1/secrets/OWNERS_ONLY"), OWNED),
    # Guarded by its own token, which no tenant's opens.
    ("GET", "/metrics"): (ask("GET", "/metrics"), everyone(401)),
    # OpenAI's Files and Batches: each tenant's own, as jobs are; models registered by admins.
    ("POST", "/v1/files"): (ask("POST", "/v1/files", data={"purpose": "batch"},
                                files={"file": ("r.jsonl", REQUESTS)}), tenants(200, 200, 200)),
    ("GET", "/v1/files"): (ask("GET", "/v1/files"), tenants(200, 200, 200)),
    ("GET", "/v1/files/{file_id}"): (ask("GET", "/v1/files/{file}"), OWNED),
    ("GET", "/v1/files/{file_id}/content"): (ask("GET", "/v1/files/{file}/content"), OWNED),
    ("DELETE", "/v1/files/{file_id}"): (ask("DELETE", "/v1/files/{spare_file}"), OWNED),
    ("POST", "/v1/batches"): (ask("POST", "/v1/batches", json={
        "input_file_id": "{file}", "endpoint": "/v1/chat/completions",
        "completion_window": "24h"}), OWNED),   # another's file reads as never existed
    ("GET", "/v1/batches"): (ask("GET", "/v1/batches"), tenants(200, 200, 200)),
    ("GET", "/v1/batches/{batch_id}"): (ask("GET", "/v1/batches/{batch}"), OWNED),
    ("POST", "/v1/batches/{batch_id}/cancel"): (ask("POST", "/v1/batches/{batch}/cancel"),
                                                OWNED),
    ("GET", "/v1/models"): (ask("GET", "/v1/models"), tenants(200, 200, 200)),
    ("POST", "/v1/admin/models"): (ask("POST", "/v1/admin/models", json={
        "name": "m-{who}", "path": "{model_dir}"}), tenants(403, 403, 201)),
    ("DELETE", "/v1/admin/models/{name}"): (ask("DELETE", "/v1/admin/models/doomed"),
                                            tenants(403, 403, 204)),
}


def api_routes(app: FastAPI) -> Iterator[tuple[str, str]]:
    """(method, path) of every API route of the app, in included routers too."""
    def walk(routes: list[Any]) -> Iterator[APIRoute]:
        for r in routes:
            if isinstance(r, APIRoute):
                yield r
            elif hasattr(r, "original_router"):   # an included router
                yield from walk(r.original_router.routes)
    for route in walk(list(app.routes)):
        for method in sorted(route.methods):
            yield method, route.path


def bearer_routes(app: FastAPI) -> set[tuple[str, str]]:
    """The routes a bearer token opens: all but the console's (`/ui`, signed in by a cookie;
    its own matrix is tests/integration/test_console_matrix.py)."""
    return {(m, p) for m, p in api_routes(app) if p != "/ui" and not p.startswith("/ui/")}


@pytest.fixture
def world(repo: Repo, redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> World:
    settings = Settings(redis_url=redis_url, home=tmp_path, metrics_token=METRICS_TOKEN,
                        secrets_key=Fernet.generate_key().decode())
    artifacts = ArtifactStore(f"file://{tmp_path / 'artifacts'}")
    service = Services(settings=settings, repo=repo, redis_client=redis_client,
                      artifacts=artifacts)
    http = TestClient(create_app(settings, services=service))
    now = utcnow()
    owner, owner_token = repo.create_tenant("owner", now=now)
    _, other_token = repo.create_tenant("other", now=now)
    _, admin_token = repo.create_tenant("ops", admin=True, now=now)
    _, frozen_token = repo.create_tenant("frozen", now=now)
    repo.create_tenant("bystander", now=now)
    repo.set_tenant_disabled("frozen", disabled=True, now=now)
    revoked = repo.create_token("owner", now=now, name="revoked")
    repo.revoke_token("owner", "revoked", now=now)
    expired = repo.create_token("owner", now=now, name="expired",
                                expires_at=now + timedelta(hours=1))
    with repo.engine.begin() as c:   # its hour has passed
        c.execute(update(ApiKey).where(ApiKey.name == "expired")
                  .values(expires_at=now - timedelta(seconds=1)))
    mine = {"Authorization": f"Bearer {owner_token}"}
    job = http.post("/v1/jobs", json=CPU_JOB, headers=mine).json()["id"]
    array = http.post("/v1/arrays", json={"items": [CPU_JOB]}, headers=mine).json()["id"]
    result = tmp_path / "result.txt"
    result.write_text("42\n")
    artifacts.put_file(result, owner.id, job, "outputs/result.txt")
    digest = "sha256:" + hashlib.sha256(BUNDLE).hexdigest()
    assert http.put(f"/v1/bundles/{digest}", content=BUNDLE, headers=mine).status_code == 201
    for name in ("HF_TOKEN", "OWNERS_ONLY"):
        assert http.put(f"/v1/secrets/{name}", json={"value": "s3cret"},
                        headers=mine).status_code == 201
    file, spare = (http.post("/v1/files", data={"purpose": "batch"}, headers=mine,
                             files={"file": ("r.jsonl", REQUESTS)}).json()["id"]
                   for _ in range(2))
    model_dir = tmp_path / "models" / "tiny"
    model_dir.mkdir(parents=True)
    (model_dir / "e31_model.json").write_text('{"kind": "chat"}')
    for name in ("tiny", "doomed"):
        repo.add_model(ModelRecord(name, "chat", f"file://{model_dir}", None, now))
    batch = http.post("/v1/batches", headers=mine, json={
        "input_file_id": file, "endpoint": "/v1/chat/completions",
        "completion_window": "24h"}).json()["id"]
    tokens = {"owner": owner_token, "other": other_token, "admin": admin_token,
              "revoked": revoked, "expired": expired, "disabled": frozen_token}
    headers = {who: {"Authorization": f"Bearer {t}"} for who, t in tokens.items()}
    return World(http=http, repo=repo, headers={**headers, "none": {}},
                 ids={"job": job, "array": array, "digest": digest, "file": file,
                      "spare_file": spare, "batch": batch, "model_dir": str(model_dir)})


def test_every_route_has_a_row_of_expected_statuses(tmp_path: Path) -> None:
    # Given the app's route table (no store is asked: the service is a stand-in)
    routes = bearer_routes(create_app(Settings(home=tmp_path), services=MagicMock()))

    # Then every route has a row, and every row a route (no stale row hides a renamed one)
    missing = sorted(routes - set(ROWS))
    assert not missing, (
        f"routes without a row in the isolation matrix: {missing}; add each to ROWS in "
        "tests/integration/test_isolation_matrix.py with the status every caller must get")
    assert not set(ROWS) - routes, sorted(set(ROWS) - routes)


def test_every_caller_gets_the_status_of_its_cell(world: World) -> None:
    # When every caller asks every route
    wrong = []
    for (method, path), (build, cells) in sorted(ROWS.items()):
        for who in CALLERS:
            verb, url, kwargs = build(world, who)
            got = world.http.request(verb, url, headers=world.headers[who], **kwargs)
            if got.status_code != cells[who]:
                wrong.append(f"{method} {path} as {who}: {got.status_code}, expected "
                             f"{cells[who]} ({got.text[:120]})")

    # Then each got exactly its cell's status
    assert not wrong, "\n".join(wrong)
