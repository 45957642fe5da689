"""The HTTP API over a real store and Redis: auth, validation, tenant isolation, outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from e31.api import create_app
from e31.api.errors import openai_path
from e31.api.services import Services
from e31.core.clock import utcnow
from e31.core.retries import RetryPolicy
from e31.core.spec import JobSpec
from e31.edge.artifacts import ArtifactStore
from e31.edge.settings import Settings
from e31.store import Repo


@pytest.fixture
def api(repo: Repo, redis_url: str, redis_client: redis.Redis, tmp_path: Path):
    settings = Settings(redis_url=redis_url, home=tmp_path)
    artifacts = ArtifactStore(f"file://{tmp_path / 'artifacts'}")
    service = Services(settings=settings, repo=repo, artifacts=artifacts, redis_client=redis_client)
    _, token_a = repo.create_tenant("team-a", now=utcnow())
    _, token_b = repo.create_tenant("team-b", now=utcnow())
    client = TestClient(create_app(settings, services=service))
    return client, artifacts, {"a": {"Authorization": f"Bearer {token_a}"},
                               "b": {"Authorization": f"Bearer {token_b}"}}


def test_a_request_without_a_valid_token_is_refused(api) -> None:
    client, _, _ = api
    assert client.get("/v1/jobs").status_code == 401
    assert client.get("/v1/jobs", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.get("/v1/health").status_code == 200


def test_every_route_but_health_answers_401_to_a_missing_or_invalid_token(api) -> None:
    # Given every operation of the OpenAPI document
    client, _, _ = api
    paths = client.get("/openapi.json").json()["paths"]
    operations = [(m.upper(), p.replace("{job_id}", "j-" + "0" * 20).replace(
                      "{array_id}", "a-" + "0" * 20).replace("{digest}", "sha256:" + "0" * 64)
                   .replace("{path}", "x")) for p, ms in paths.items() for m in ms]
    assert len(operations) > 10

    # Then each answers 401 with the error body to no token and to a wrong one, health aside
    for method, path in operations:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic eDp5"}):
            response = client.request(method, path, headers=headers)
            if path == "/v1/health":
                assert response.status_code == 200
                continue
            assert response.status_code == 401, (method, path, headers)
            assert response.headers["WWW-Authenticate"] == "Bearer"
            if method != "HEAD":   # OpenAI's shape on its routes (e31.api.errors.OPENAI_PATHS)
                error = response.json()["error"]
                assert (error["code"] if openai_path(path) else error) == "unauthorized"


def test_a_tenant_asking_for_an_admins_view_gets_403_and_an_admin_gets_it(api, repo) -> None:
    # Given a tenant's token and an admin's
    client, _, h = api
    _, admin_token = repo.create_tenant("ops", admin=True, now=utcnow())
    admin = {"Authorization": f"Bearer {admin_token}"}
    client.post("/v1/jobs", json={"entrypoint": "m:f"}, headers=h["a"])

    # When each asks for every tenant's usage
    refused = client.get("/v1/usage", params={"all_tenants": "true"}, headers=h["b"])
    answered = client.get("/v1/usage", params={"all_tenants": "true"}, headers=admin)

    # Then the tenant is refused as forbidden (its token is valid: not 401), the admin answered
    assert refused.status_code == 403
    assert refused.json() == {"error": "forbidden",
                              "message": "usage of all tenants needs an admin token"}
    assert answered.status_code == 200
    assert [row["tenant"] for row in answered.json()["usage"]] == ["team-a"]


def test_a_body_that_is_not_utf8_is_refused_with_422_like_any_body_that_is_not_json(api) -> None:
    client, _, h = api
    for path in ("/v1/jobs", "/v1/arrays"):
        response = client.post(path, content=b"\xff\xfe{", headers={
            **h["a"], "Content-Type": "application/json"})
        assert response.status_code == 422, (path, response.text)
        assert response.json()["errors"] == [{"field": "body",
                                              "reason": "must be JSON text in UTF-8"}]


def test_a_method_a_path_does_not_take_gets_405_naming_every_method_it_takes(api) -> None:
    client, _, h = api
    response = client.request("DELETE", "/v1/jobs", headers=h["a"])
    assert response.status_code == 405
    assert response.headers["Allow"] == "GET, POST"
    assert response.json()["error"] == "method_not_allowed"
    assert client.get("/v1/nowhere", headers=h["a"]).json()["error"] == "not_found"


@pytest.mark.parametrize("method, path, allowed", [
    ("DELETE", "/v1/tokens", "GET, POST"),
    ("PUT", "/v1/secrets", "GET"),
    ("POST", "/v1/top", "GET"),
])
def test_a_405_on_any_route_group_names_the_methods_of_its_path(api, method, path,
                                                                 allowed) -> None:
    # Given routes registered by a router of their own (tokens, secrets, top)
    client, _, h = api

    # When a method the path does not take is asked
    response = client.request(method, path, headers=h["a"])

    # Then the 405 names every method the path takes (before Rooms II these answered an
    # empty Allow header: FastAPI keeps an included router as one entry without methods)
    assert response.status_code == 405, response.text
    assert response.headers["Allow"] == allowed


@pytest.mark.parametrize("body, field", [
    ({"entrypoint": "m:f", "colour": "red"}, "colour"),
    ({"entrypoint": "m:f", "command": ["ls"]}, "entrypoint"),
    ({}, "entrypoint"),
    ({"entrypoint": "m:f", "timeout_s": -1}, "timeout_s"),
    ({"entrypoint": "m:f", "priority": 12}, "priority"),
    ({"entrypoint": "m:f", "resources": {"gpu_mem_gb": 500}}, "resources.gpu_mem_gb"),
    ({"entrypoint": "m:f", "resources": {"gpus": 64}}, "resources.gpus"),
    ({"entrypoint": "m:f", "resources": {"size_class": "gpu9000"}}, "resources.size_class"),
    ({"entrypoint": "not a callable"}, "entrypoint"),
    ({"entrypoint": "m:f", "env": {"A=B": "1"}}, "env"),
    ({"entrypoint": "m:f", "env": {"A": "x\u0000y"}}, "env"),
    ({"entrypoint": "m:f", "name": "a\u0000b"}, "name"),
    ({"command": ["sh", "-c", "nul\u0000here"]}, "command"),
])
def test_a_bad_spec_gets_422_naming_the_field_and_nothing_is_stored(api, body, field) -> None:
    client, _, h = api
    response = client.post("/v1/jobs", json=body, headers=h["a"])
    assert response.status_code == 422
    payload = response.json()
    assert payload["error"] == "spec_invalid"
    assert field in [e["field"] for e in payload["errors"]], payload
    assert all(e["reason"] for e in payload["errors"])
    assert client.get("/v1/jobs", headers=h["a"]).json()["jobs"] == []


def test_odd_but_valid_input_never_gets_a_500(api) -> None:
    client, _, h = api
    long_program = client.post("/v1/jobs", json={"command": ["/bin/" + "x" * 250]}, headers=h["a"])
    assert long_program.status_code == 201 and len(long_program.json()["name"]) == 200
    assert client.get("/v1/jobs/j-%00", headers=h["a"]).status_code == 404
    assert client.get("/v1/jobs/" + "j" * 500, headers=h["a"]).status_code == 404
    job_id = long_program.json()["id"]
    assert client.get(f"/v1/jobs/{job_id}/logs", params={"attempt": 1, "offset": 10**20},
                      headers=h["a"]).status_code == 422


def test_a_body_that_is_not_json_is_refused_with_422(api) -> None:
    client, _, h = api
    response = client.post("/v1/jobs", content=b"{not json",
                           headers={**h["a"], "Content-Type": "application/json"})
    assert response.status_code == 422


def test_a_submitted_job_is_queued_in_its_class_and_listed(api) -> None:
    client, _, h = api
    response = client.post("/v1/jobs", json={"entrypoint": "m:f", "name": "train",
                                             "resources": {"gpu_mem_gb": 40}}, headers=h["a"])
    assert response.status_code == 201
    job = response.json()
    assert (job["state"], job["size_class"], job["queue"], job["name"]) == \
        ("queued", "gpu48", "e31.gpu48", "train")
    listed = client.get("/v1/jobs", params={"state": "queued"}, headers=h["a"]).json()["jobs"]
    assert [j["id"] for j in listed] == [job["id"]]


def test_another_tenant_gets_404_for_the_job_its_logs_outputs_and_cancel(api) -> None:
    client, _, h = api
    job = client.post("/v1/jobs", json={"entrypoint": "m:f"}, headers=h["a"]).json()
    for method, path in [("GET", ""), ("GET", "/logs"), ("GET", "/outputs"),
                         ("GET", "/outputs/x.txt"), ("POST", "/cancel")]:
        response = client.request(method, f"/v1/jobs/{job['id']}{path}", headers=h["b"])
        assert response.status_code == 404, (method, path)
    assert client.get(f"/v1/jobs/{job['id']}", headers=h["a"]).json()["state"] == "queued"
    assert client.get("/v1/usage", headers=h["b"]).json()["usage"] == []
    everyone = client.get("/v1/usage", params={"all_tenants": "true"}, headers=h["b"])
    assert everyone.status_code == 403 and everyone.json()["error"] == "forbidden"


def test_outputs_are_listed_and_downloaded_and_paths_cannot_escape(api, tmp_path: Path) -> None:
    client, artifacts, h = api
    job = client.post("/v1/jobs", json={"entrypoint": "m:f"}, headers=h["a"]).json()
    src = tmp_path / "out"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "r.txt").write_text("result")
    tid = _tenant_id(client, h["a"])
    artifacts.put_tree(src, tid, job["id"], "outputs")

    listed = client.get(f"/v1/jobs/{job['id']}/outputs", headers=h["a"]).json()["outputs"]
    assert listed == [{"path": "sub/r.txt", "size": 6}]
    fetched = client.get(f"/v1/jobs/{job['id']}/outputs/sub/r.txt", headers=h["a"])
    assert fetched.content == b"result"
    assert client.get(f"/v1/jobs/{job['id']}/outputs/../../x", headers=h["a"]).status_code == 404


def _tenant_id(client: TestClient, headers: dict[str, str]) -> str:
    """The tenant id behind a token, as the artifact store keys it."""
    token = headers["Authorization"].split()[1]
    service = client.app.state.services.tokens
    return service.authenticate(token).id


def test_the_openapi_document_describes_the_job_routes(api) -> None:
    client, _, _ = api
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/cancel", "/v1/usage"} <= set(paths)


def test_the_pools_retry_policy_fills_what_a_spec_leaves_out(
        repo: Repo, redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    settings = Settings(redis_url=redis_url, retries=RetryPolicy(max=2, backoff_s=3))
    service = Services(settings=settings, repo=repo, artifacts=ArtifactStore(f"file://{tmp_path}"),
                       redis_client=redis_client).jobs
    tenant, _ = repo.create_tenant("pool", now=utcnow())

    plain = service.submit(tenant, JobSpec.parse({"entrypoint": "m:f"}))
    partial = service.submit(tenant, JobSpec.parse({"entrypoint": "m:f", "retries": {"max": 5}}))

    assert plain.spec["retries"] == {"max": 2, "backoff_s": 3.0, "backoff_max_s": 600.0,
                                     "max_lost": 3}
    assert partial.spec["retries"] == {"max": 5, "backoff_s": 3.0, "backoff_max_s": 600.0,
                                       "max_lost": 3}


def test_after_another_tenants_job_is_refused_with_409_naming_the_entry(api) -> None:
    # Given a job of team b
    client, _, h = api
    theirs = client.post("/v1/jobs", json={"entrypoint": "m:f"}, headers=h["b"]).json()["id"]
    mine = client.post("/v1/jobs", json={"entrypoint": "m:f"}, headers=h["a"]).json()["id"]

    # When team a submits a job, and an array item, after it
    refused = client.post("/v1/jobs", json={"entrypoint": "m:f", "after": [mine, theirs]},
                          headers=h["a"])
    array = client.post("/v1/arrays", json={"items": [{"entrypoint": "m:f"}],
                                            "defaults": {"after": [theirs]}}, headers=h["a"])

    # Then both conflict with what the store holds for team a (409), naming the entry as a
    # missing job, and a job after its own job is queued with it
    assert refused.status_code == 409 and refused.json()["error"] == "spec_conflict"
    assert refused.json()["errors"] == [{"field": "after[1]",
                                         "reason": f"no job {theirs} of this tenant"}]
    assert array.status_code == 409 and array.json()["errors"][0]["field"] == "items[0].after[0]"
    ok = client.post("/v1/jobs", json={"entrypoint": "m:f", "after": [mine]}, headers=h["a"]).json()
    assert ok["after"] == [mine]
    pending = client.get(f"/v1/jobs/{ok['id']}", headers=h["a"]).json()["pending"]
    assert pending["reason"] == "dependency" and pending["detail"] == mine


def test_the_queue_route_shows_each_class_and_merges_other_tenants_for_non_admins(api) -> None:
    client, _, h = api
    client.post("/v1/jobs", json={"entrypoint": "m:f"}, headers=h["a"])
    client.post("/v1/jobs", json={"entrypoint": "m:f"}, headers=h["b"])

    view = client.get("/v1/queue", headers=h["a"]).json()

    gpu24 = next(c for c in view["classes"] if c["size_class"] == "gpu24")
    assert gpu24["queued"] == 2
    assert sorted(t["tenant"] for t in gpu24["tenants"]) == ["others", "team-a"]
