"""The console's isolation matrix: every `/ui` route × every kind of signed-in (or not)
browser, each cell the status it must get, as tests/integration/test_isolation_matrix.py
does for the bearer-token API (which leaves the cookie-signed `/ui` routes to this file).

Browsers: the owner of the objects asked about, another tenant, an admin, the owner signed in
with a token revoked since, a tenant disabled since it signed in, and one never signed in.
The rows are checked against the app's route table: a `/ui` route without a row fails.
A page of another tenant's object is the same 404 as a missing one; a browser whose session
no longer opens (revoked, disabled, none) is sent to the login form (303), whatever it asks.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from unittest.mock import MagicMock

import redis
from fastapi.testclient import TestClient

from e31.api import create_app
from e31.api.services import Services
from e31.core.clock import utcnow
from e31.edge.artifacts import ArtifactStore
from e31.edge.settings import Settings
from e31.store import Repo
from tests.integration.test_isolation_matrix import api_routes

BROWSERS = ("other", "admin", "revoked", "disabled", "none", "owner")   # the owner last
GONE = {"revoked": 303, "disabled": 303, "none": 303}   # to the login form
CPU_JOB = {"entrypoint": "m:f", "resources": {"gpus": 0}}


@dataclass
class Browsers:
    clients: dict[str, TestClient]
    csrf: dict[str, str]
    ids: dict[str, str]


Ask = Callable[[Browsers, str], tuple[str, str, dict[str, object]]]


def get(path: str) -> Ask:
    return lambda b, who: ("GET", path.format(**b.ids), {})


def post(path: str) -> Ask:
    return lambda b, who: ("POST", path.format(**b.ids), {"data": {"csrf": b.csrf.get(who, "")}})


def signed_in(owner: int, other: int, admin: int) -> dict[str, int]:
    return {"owner": owner, "other": other, "admin": admin, **GONE}


OWNED = signed_in(200, 404, 404)
READ = signed_in(200, 404, 200)        # an admin reads any tenant's job and array, as the API
OWNED_POST = signed_in(303, 404, 404)
PAGE = signed_in(200, 200, 200)
ROWS: dict[tuple[str, str], tuple[Ask, dict[str, int]]] = {
    ("GET", "/ui"): (get("/ui"), dict.fromkeys(BROWSERS, 303)),
    ("GET", "/ui/"): (get("/ui/"), dict.fromkeys(BROWSERS, 303)),
    ("GET", "/ui/login"): (get("/ui/login"), dict.fromkeys(BROWSERS, 200)),
    ("POST", "/ui/login"): (lambda b, who: ("POST", "/ui/login", {"data": {
        "token": b.ids.get(f"token-{who}", "")}}), signed_in(303, 303, 303) | {
        "revoked": 401, "disabled": 403, "none": 401}),
    ("POST", "/ui/logout"): (post("/ui/logout"), dict.fromkeys(BROWSERS, 303)),
    ("GET", "/ui/jobs"): (get("/ui/jobs"), PAGE),
    ("GET", "/ui/jobs/{job_id}"): (get("/ui/jobs/{job}"), READ),
    ("GET", "/ui/jobs/{job_id}/log"): (get("/ui/jobs/{ended}/log"), READ),
    ("GET", "/ui/jobs/{job_id}/outputs/{path:path}"): (
        get("/ui/jobs/{job}/outputs/result.txt"), READ),
    ("POST", "/ui/jobs/{job_id}/cancel"): (post("/ui/jobs/{job}/cancel"), OWNED_POST),
    ("GET", "/ui/arrays/{array_id}"): (get("/ui/arrays/{array}"), READ),
    ("POST", "/ui/arrays/{array_id}/retry"): (post("/ui/arrays/{array}/retry"), OWNED_POST),
    ("GET", "/ui/queue"): (get("/ui/queue"), PAGE),
    ("GET", "/ui/usage"): (get("/ui/usage"), PAGE),
    ("GET", "/ui/gpus"): (get("/ui/gpus"), PAGE),
}


def browsers(repo: Repo, redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> Browsers:
    settings = Settings(redis_url=redis_url, home=tmp_path)
    artifacts = ArtifactStore(f"file://{tmp_path / 'artifacts'}")
    app = create_app(settings, services=Services(settings=settings, repo=repo,
                                                 artifacts=artifacts, redis_client=redis_client))
    now = utcnow()
    owner, token = repo.create_tenant("owner", now=now)
    tokens = {"owner": token, "other": repo.create_tenant("other", now=now)[1],
              "admin": repo.create_tenant("ops", admin=True, now=now)[1],
              "revoked": repo.create_token("owner", now=now, name="revoked"),
              "disabled": repo.create_tenant("frozen", now=now)[1]}
    api = TestClient(app, headers={"Authorization": f"Bearer {token}"})
    job = api.post("/v1/jobs", json=CPU_JOB).json()["id"]
    ended = api.post("/v1/jobs", json=CPU_JOB).json()["id"]
    api.post(f"/v1/jobs/{ended}/cancel")
    array = api.post("/v1/arrays", json={"items": [CPU_JOB]}).json()["id"]
    (tmp_path / "result.txt").write_text("42\n")
    artifacts.put_file(tmp_path / "result.txt", owner.id, job, "outputs/result.txt")
    clients = {who: TestClient(app) for who in BROWSERS}
    csrf = {}
    for who, t in tokens.items():
        assert clients[who].post("/ui/login", data={"token": t}).status_code == 200
        csrf[who] = re.findall(r'name="csrf" value="([0-9a-f]+)"',
                               clients[who].get("/ui/jobs").text)[0]
    repo.revoke_token("owner", "revoked", now=now)
    repo.set_tenant_disabled("frozen", disabled=True, now=now)
    return Browsers(clients=clients, csrf=csrf,
                    ids={"job": job, "ended": ended, "array": array,
                         **{f"token-{who}": t for who, t in tokens.items()}})


def test_every_console_route_has_a_row(tmp_path: Path) -> None:
    routes = {r for r in api_routes(create_app(Settings(home=tmp_path), services=MagicMock()))
              if r[1] == "/ui" or r[1].startswith("/ui/")}
    assert routes == set(ROWS), (sorted(routes - set(ROWS)), sorted(set(ROWS) - routes))


def test_every_browser_gets_its_cell_on_every_console_route(
        repo: Repo, redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    b = browsers(repo, redis_url, redis_client, tmp_path)
    # signing in again starts a new session (a new CSRF token) and signing out ends it:
    # those two after the rest, in that order
    last = [("POST", "/ui/login"), ("POST", "/ui/logout")]
    wrong = []
    for who in BROWSERS:
        for route in [r for r in ROWS if r not in last] + last:
            ask, cells = ROWS[route]
            verb, url, kwargs = ask(b, who)
            got = b.clients[who].request(verb, url, follow_redirects=False, **kwargs)
            if got.status_code != cells[who]:
                wrong.append((who, *route, got.status_code, cells[who]))
            if route == last[0] and got.status_code == 303:
                page = b.clients[who].get("/ui/jobs").text
                b.csrf[who] = re.findall(r'name="csrf" value="([0-9a-f]+)"', page)[0]
    assert not wrong, wrong
