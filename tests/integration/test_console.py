"""The console (`/ui`) over the real app, store and Redis: the login form and its cookie, CSRF
on every form, each page answering, and tenant scoping exactly as the JSON API's (another
tenant's job is the same 404 page as a job that does not exist)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from e31.api import create_app
from e31.api.console.session import COOKIE
from e31.api.services import Services
from e31.core.clock import utcnow
from e31.core.records import Outcome
from e31.core.states import AttemptReason
from e31.edge.artifacts import ArtifactStore
from e31.edge.settings import Settings
from e31.ops import gpuseries, heartbeat
from e31.ops.heartbeat import WorkerInfo
from e31.store import Repo
from tests.integration.test_store import publish

SPEC = {"entrypoint": "pkg.mod:main", "resources": {"gpus": 0}}


@pytest.fixture
def app(repo: Repo, redis_url: str, redis_client: redis.Redis, tmp_path: Path):
    settings = Settings(redis_url=redis_url, home=tmp_path)
    artifacts = ArtifactStore(f"file://{tmp_path / 'artifacts'}")
    services = Services(settings=settings, repo=repo, artifacts=artifacts,
                        redis_client=redis_client)
    _, token_a = repo.create_tenant("team-a", now=utcnow())
    _, token_b = repo.create_tenant("team-b", now=utcnow())
    _, token_root = repo.create_tenant("ops", admin=True, now=utcnow())
    return create_app(settings, services=services), {"a": token_a, "b": token_b,
                                                      "root": token_root}


def signed_in(app, token: str) -> TestClient:
    client = TestClient(app, base_url="https://testserver")
    answer = client.post("/ui/login", data={"token": token}, follow_redirects=False)
    assert answer.status_code == 303 and answer.headers["location"] == "/ui/jobs"
    return client


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert found, "no CSRF field on the page"
    return found.group(1)


def submit(token: str, app, **fields: object) -> str:
    client = TestClient(app)
    answer = client.post("/v1/jobs", json={**SPEC, **fields},
                         headers={"Authorization": f"Bearer {token}"})
    assert answer.status_code == 201, answer.text
    return str(answer.json()["id"])


def fail(repo: Repo, job_id: str) -> None:
    claim = repo.claim(job_id, dispatch_token=publish(repo, job_id), worker="gpu9@x", gpus="9",
                       gpu_count=1, now=utcnow(), lease_ttl_s=60)
    assert claim is not None
    repo.record_outcome(job_id, claim.token, Outcome(AttemptReason.ERROR, error="exit code 3"),
                        now=utcnow())


def test_signing_in_sets_an_httponly_strict_secure_cookie_and_never_puts_the_token_in_a_page(
        app) -> None:
    app, tokens = app
    client = TestClient(app, base_url="https://testserver")
    assert "<form" in client.get("/ui/login").text
    answer = client.post("/ui/login", data={"token": tokens["a"]}, follow_redirects=False)
    cookie = answer.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}=")
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Secure" in cookie
    assert "Path=/ui" in cookie and tokens["a"] not in cookie
    page = client.get("/ui/jobs")
    assert page.status_code == 200 and "team-a" in page.text and tokens["a"] not in page.text
    assert tokens["a"] not in str(page.url)


def test_a_cookie_over_plain_http_is_not_marked_secure(app) -> None:
    app, tokens = app
    answer = TestClient(app).post("/ui/login", data={"token": tokens["a"]},
                                  follow_redirects=False)
    assert "Secure" not in answer.headers["set-cookie"]


def test_a_bad_token_gets_the_form_again_and_no_cookie(app) -> None:
    app, _ = app
    client = TestClient(app)
    answer = client.post("/ui/login", data={"token": "e31_nope"}, follow_redirects=False)
    assert answer.status_code == 401 and "not valid" in answer.text
    assert "set-cookie" not in answer.headers


def test_a_page_without_a_session_or_with_a_forged_cookie_sends_to_the_login_form(app) -> None:
    app, _ = app
    client = TestClient(app)
    for path in ("/ui/jobs", "/ui/queue", "/ui/jobs/j-123"):
        answer = client.get(path, follow_redirects=False)
        assert answer.status_code == 303 and answer.headers["location"] == "/ui/login"
    client.cookies.set(COOKIE, "forged", path="/ui")
    assert client.get("/ui/jobs", follow_redirects=False).status_code == 303


def test_a_revoked_token_signs_its_session_out_on_the_next_page(app) -> None:
    app, tokens = app
    client = signed_in(app, tokens["a"])
    assert client.get("/ui/jobs").status_code == 200
    answer = TestClient(app).delete("/v1/tokens/default",
                                    headers={"Authorization": f"Bearer {tokens['a']}"})
    assert answer.status_code == 200, answer.text
    assert client.get("/ui/jobs", follow_redirects=False).status_code == 303


def test_a_post_without_the_sessions_csrf_token_is_refused_and_changes_nothing(
        app, repo: Repo) -> None:
    app, tokens = app
    job_id = submit(tokens["a"], app, name="stays")
    client = signed_in(app, tokens["a"])
    for sent in ({}, {"csrf": "0" * 64}):
        answer = client.post(f"/ui/jobs/{job_id}/cancel", data=sent, follow_redirects=False)
        assert answer.status_code == 403 and "CSRF" in answer.text
    assert repo.get_job(None, job_id).state == "queued"
    other = signed_in(app, tokens["b"])   # a CSRF token is its session's only
    token_b = csrf_of(other.get("/ui/jobs").text)
    assert client.post(f"/ui/jobs/{job_id}/cancel", data={"csrf": token_b},
                       follow_redirects=False).status_code == 403
    assert client.post("/ui/logout", follow_redirects=False).status_code == 403


def test_cancel_from_the_job_page_cancels_the_job(app, repo: Repo) -> None:
    app, tokens = app
    job_id = submit(tokens["a"], app, name="to-cancel")
    client = signed_in(app, tokens["a"])
    page = client.get(f"/ui/jobs/{job_id}").text
    assert 'id="cancel"' in page
    answer = client.post(f"/ui/jobs/{job_id}/cancel", data={"csrf": csrf_of(page)},
                         follow_redirects=False)
    assert answer.status_code == 303
    assert repo.get_job(None, job_id).state == "cancelled"


def test_another_tenants_job_is_the_same_404_page_as_a_job_that_does_not_exist(
        app, repo: Repo) -> None:
    app, tokens = app
    job_id = submit(tokens["a"], app, name="private")
    client = signed_in(app, tokens["b"])
    theirs = client.get(f"/ui/jobs/{job_id}")
    missing = client.get("/ui/jobs/j-00000000000000000000000000")
    assert theirs.status_code == missing.status_code == 404
    assert theirs.text.replace(job_id, "X") == missing.text.replace(
        "j-00000000000000000000000000", "X")
    assert "private" not in client.get("/ui/jobs").text
    for path in (f"/ui/jobs/{job_id}/log", f"/ui/jobs/{job_id}/outputs/x.txt"):
        assert client.get(path).status_code == 404
    answer = client.post(f"/ui/jobs/{job_id}/cancel", data={"csrf": csrf_of(theirs.text)})
    assert answer.status_code == 404
    assert repo.get_job(None, job_id).state == "queued"


def test_the_jobs_page_shows_a_failed_job_in_red_with_its_reason_and_filters_by_state_and_name(
        app, repo: Repo) -> None:
    app, tokens = app
    failed = submit(tokens["a"], app, name="breaks", retries={"max": 0})
    fail(repo, failed)
    queued = submit(tokens["a"], app, name="waits")
    client = signed_in(app, tokens["a"])
    page = client.get("/ui/jobs").text
    row = re.search(rf'<tr class="state-failed" data-job="{failed}">(.*?)</tr>', page, re.S)
    assert row and "error" in row.group(1) and "exit code 3" in row.group(1)
    waiting = re.search(rf'<tr class="state-queued" data-job="{queued}">(.*?)</tr>', page, re.S)
    assert waiting and 'class="why"' in waiting.group(1)   # why it waits, as its status says
    assert TestClient(app).get(f"/v1/jobs/{queued}", headers={
        "Authorization": f"Bearer {tokens['a']}"}).json()["pending"]["text"] in waiting.group(1)
    only_failed = client.get("/ui/jobs", params={"state": "failed"}).text
    assert failed in only_failed and queued not in only_failed
    by_name = client.get("/ui/jobs", params={"name": "wai"}).text
    assert queued in by_name and failed not in by_name


def test_the_jobs_page_pages_newest_first(app) -> None:
    app, tokens = app
    from e31.api.console.pages import PAGE_SIZE
    ids = [submit(tokens["a"], app, name=f"n{i}") for i in range(PAGE_SIZE + 2)]
    client = signed_in(app, tokens["a"])
    first = client.get("/ui/jobs").text
    assert ids[-1] in first and ids[0] not in first
    after = re.search(r'id="next-page" href="([^"]+)"', first)
    assert after
    second = client.get(after.group(1).replace("&amp;", "&")).text
    assert ids[0] in second and ids[1] in second and ids[-1] not in second


def test_every_page_answers_for_a_tenant_and_the_gpus_page_lists_for_an_admin(
        app, repo: Repo) -> None:
    app, tokens = app
    job_id = submit(tokens["a"], app, name="seen")
    array = TestClient(app).post("/v1/arrays", json={"name": "grid", "items": [SPEC] * 3},
                                 headers={"Authorization": f"Bearer {tokens['a']}"}).json()
    client = signed_in(app, tokens["a"])
    for path in ("/ui/jobs", f"/ui/jobs/{job_id}", f"/ui/arrays/{array['id']}", "/ui/queue",
                 "/ui/usage", "/ui/gpus", "/ui/static/console.css", "/ui/static/console.js"):
        assert client.get(path).status_code == 200, path
    grid = client.get(f"/ui/arrays/{array['id']}").text
    assert grid.count('class="cell state-queued"') == 3
    admin = signed_in(app, tokens["root"])
    assert 'href="/ui/gpus"' in admin.get("/ui/jobs").text
    assert 'href="/ui/gpus"' not in client.get("/ui/jobs").text


def test_the_log_stream_sends_the_log_and_ends_once_the_job_is_final(
        app, repo: Repo, tmp_path: Path) -> None:
    app, tokens = app
    job_id = submit(tokens["a"], app, name="logs", retries={"max": 0})
    fail(repo, job_id)
    tenant = repo.tenant_for_token(tokens["a"], now=utcnow())
    assert tenant is not None
    logs = tmp_path / "artifacts" / tenant.id / job_id / "logs"
    logs.mkdir(parents=True)
    (logs / "attempt-1.log").write_text("hello from the job\n")
    client = signed_in(app, tokens["a"])
    with client.stream("GET", f"/ui/jobs/{job_id}/log") as answer:
        assert answer.headers["content-type"].startswith("text/event-stream")
        body = "".join(answer.iter_text())
    assert "hello from the job" in body and body.rstrip().endswith("event: end\ndata: {}")
    resumed = client.get(f"/ui/jobs/{job_id}/log", headers={"Last-Event-ID": "999999"}).text
    assert "hello from the job" not in resumed and "event: end" in resumed


def test_a_jobs_page_draws_its_gpu_series_and_another_tenant_reads_none_of_it(
        app, redis_client: redis.Redis) -> None:
    from tests.integration.test_gpu_series import busy
    app, tokens = app
    job_id = submit(tokens["a"], app, name="on-gpus")
    for util in (10.0, 80.0, 95.0):
        gpuseries.record(redis_client, busy(job_id, util=util))
    client = signed_in(app, tokens["a"])
    page = client.get(f"/ui/jobs/{job_id}").text
    assert 'id="gpu-chart"' in page and 'class="util"' in page and 'class="mem"' in page
    as_json = TestClient(app).get(f"/v1/jobs/{job_id}/gpu",
                                  headers={"Authorization": f"Bearer {tokens['a']}"}).json()
    assert as_json["known"] and [p["util_pct"] for p in as_json["points"]] == [10.0, 80.0, 95.0]
    other = TestClient(app).get(f"/v1/jobs/{job_id}/gpu",
                                headers={"Authorization": f"Bearer {tokens['b']}"})
    assert other.status_code == 404


def test_usage_per_day_counts_todays_ended_jobs_for_their_tenant_only(app, repo: Repo) -> None:
    app, tokens = app
    fail(repo, submit(tokens["a"], app, name="ends-today", retries={"max": 0}))
    today = utcnow().date().isoformat()
    a = TestClient(app).get("/v1/usage/daily", headers={"Authorization": f"Bearer {tokens['a']}"})
    assert [(d["day"], d["tenant"], d["jobs"]) for d in a.json()["days"]] == [
        (today, "team-a", 1)]
    b = TestClient(app).get("/v1/usage/daily", headers={"Authorization": f"Bearer {tokens['b']}"})
    assert b.json()["days"] == []
    assert TestClient(app).get("/v1/usage/daily", params={"all_tenants": "true"}, headers={
        "Authorization": f"Bearer {tokens['b']}"}).status_code == 403
    page = signed_in(app, tokens["a"]).get("/ui/usage", params={"days": 28}).text
    assert 'id="daily-chart"' in page and today in page and "the last 28 days" in page
    admin = signed_in(app, tokens["root"]).get("/ui/usage").text
    assert "team-a" in admin


def test_a_page_asked_with_a_bad_query_answers_the_error_page_and_the_api_keeps_its_json(
        app) -> None:
    app, tokens = app
    page = signed_in(app, tokens["a"]).get("/ui/jobs", params={"state": "nonsense"})
    assert page.status_code == 422 and page.headers["content-type"].startswith("text/html")
    api = TestClient(app).get("/v1/jobs", params={"state": "nonsense"},
                              headers={"Authorization": f"Bearer {tokens['a']}"})
    assert api.status_code == 422 and api.json()["error"] == "spec_invalid"


def test_an_admins_jobs_page_lists_every_tenants_jobs_and_a_tenants_only_its_own(app) -> None:
    # Given a job of each of two tenants
    app, tokens = app
    mine, theirs = submit(tokens["a"], app, name="alpha-job"), submit(tokens["b"], app,
                                                                         name="beta-job")

    # When each tenant and an admin open the jobs page
    seen = {who: signed_in(app, tokens[who]).get("/ui/jobs").text for who in ("a", "b", "root")}

    # Then a tenant sees its own alone; the admin sees both, with whose each is
    assert mine in seen["a"] and theirs not in seen["a"]
    assert theirs in seen["b"] and mine not in seen["b"]
    assert mine in seen["root"] and theirs in seen["root"]
    assert "team-a" in seen["root"] and "team-b" in seen["root"]
    # And the JSON route gives an admin the same, and refuses a tenant
    api = TestClient(app)
    every = api.get("/v1/jobs", params={"all_tenants": "true"},
                    headers={"Authorization": f"Bearer {tokens['root']}"})
    refused = api.get("/v1/jobs", params={"all_tenants": "true"},
                      headers={"Authorization": f"Bearer {tokens['a']}"})
    assert {j["id"] for j in every.json()["jobs"]} == {mine, theirs}
    assert refused.status_code == 403


def test_an_admin_reads_another_tenants_job_page_without_a_cancel_and_a_tenant_cannot(
        app) -> None:
    # Given a running-or-queued job of team-a
    app, tokens = app
    job = submit(tokens["a"], app, name="alpha-job")

    # When the admin, team-b and team-a open its page
    pages = {who: signed_in(app, tokens[who]).get(f"/ui/jobs/{job}") for who in ("root", "b",
                                                                                   "a")}

    # Then the admin reads it, with no cancel (an admin reads others' jobs, writes its own);
    # team-b gets the 404 page; its owner reads it with its cancel
    assert pages["root"].status_code == 200 and "alpha-job" in pages["root"].text
    assert 'id="cancel"' not in pages["root"].text
    assert pages["b"].status_code == 404
    assert pages["a"].status_code == 200 and 'id="cancel"' in pages["a"].text


def test_the_queue_page_counts_a_cpu_class_running_jobs_as_cpu_slots(
        app, repo: Repo, redis_client: redis.Redis) -> None:
    # Given a CPU worker running a CPU job of team-a (issue 32: the page counted GPUs, so a
    # tenant running CPU jobs was not shown at all)
    application, tokens = app
    job_id = submit(tokens["a"], application)
    assert repo.claim(job_id, dispatch_token=publish(repo, job_id), worker="cpu0@h", gpus="",
                      gpu_count=0, now=utcnow(), lease_ttl_s=60)
    heartbeat.write(redis_client, WorkerInfo(node="cpu0@h", queues=("e31.cpu",), gpus="",
                                             gpu_count=0, size_class="cpu", busy_job=job_id),
                    interval_s=5)

    # When team-a opens the queue page
    page = signed_in(application, tokens["a"]).get("/ui/queue").text

    # Then the cpu class's column says CPU slots, and team-a runs 1
    cpu = page[page.index("<h2>cpu"):]
    cpu = cpu[:cpu.index("</section>")]
    assert "<th>Running CPU slots</th>" in cpu and "Running GPUs" not in cpu
    assert re.search(r"<td>team-a</td><td>0</td><td>1</td>", cpu), cpu
