"""What one tenant can see of another, through every answer of the API (docs/security.md).

Tenant bravo runs a job, holds a GPU reservation for its waiting multi-GPU job, has an array,
logs, outputs and a bundle. Tenant alpha waits behind that reservation. Then everything alpha
can ask is asked: its jobs' statuses with their pending reasons, the queue and top views, its
usage, and every question about bravo's ids (a job, its logs and outputs, a cancel, an array,
a bundle, a dependency on them). No answer may name bravo's jobs, arrays, names or tenant, and
every answer about one of bravo's ids must read exactly as the answer about an id that never
existed. The same test with the redaction switched off (a fixture) finds the leak.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from e31.api import create_app
from e31.api.services import Services
from e31.core.clock import utcnow
from e31.core.sizeclasses import route
from e31.core.spec import JobSpec
from e31.edge.artifacts import ArtifactStore
from e31.edge.settings import Settings
from e31.scheduling import explain
from e31.store import Repo
from tests.integration.test_scheduler import a_scheduler_leads, heartbeat, make
from tests.integration.test_store import publish

GPU24, X4 = "e31.gpu24", "e31.gpu24.x4"
RESERVE_AFTER_S = 600
HOLES = ["redacted", "reservation-named", "queue-named"]


@dataclass
class World:
    """The two tenants' state, and what alpha must never read of bravo's."""

    http: TestClient
    alpha: dict[str, str]          # alpha's Authorization header
    alpha_waiting: str             # alpha's job waiting behind bravo's reservation
    bravo_ids: dict[str, str]      # what each id of bravo's is: "job", "array", "bundle"
    secrets: set[str]              # bravo's ids, names and tenant name and id


def _tar(name: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _one(repo: Repo, tenant_id: str, *, now: datetime, **fields: Any) -> str:
    spec = JobSpec.parse({"entrypoint": "pkg.mod:main", **fields})
    return repo.insert_job(tenant_id, spec, route(spec, Settings().size_classes), now=now).id


@pytest.fixture(params=HOLES)
def hole(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """`redacted`: the API as it is. The others switch one redaction off, to show the test
    finds what it would leak: a reservation's pending reason naming bravo's job, or the queue
    view naming every tenant to a tenant's token."""
    if request.param == "reservation-named":
        monkeypatch.setattr(explain, "as_seen_by_owner",
                            lambda p, owns: (p.reason.value, p.detail, p.text()))
    if request.param == "queue-named":
        overview = explain.queue_overview
        monkeypatch.setattr(explain, "queue_overview",
                            lambda **kw: overview(**{**kw, "viewer": None}))
    return str(request.param)


@pytest.fixture
def world(repo: Repo, redis_url: str, redis_client: redis.Redis, tmp_path: Path,
          hole: str) -> Iterator[World]:
    # Given tenant bravo with a running job and a multi-GPU job waiting past reserve_after_s,
    # and tenant alpha's long one-GPU job submitted after them, on a host of four GPUs
    alpha, alpha_token = repo.create_tenant("team-alpha", now=utcnow())
    bravo, bravo_token = repo.create_tenant("team-bravo", now=utcnow())
    t0 = utcnow() - timedelta(seconds=RESERVE_AFTER_S + 60)
    running = _one(repo, bravo.id, now=t0 - timedelta(seconds=1), timeout_s=700,
                   name="bravo-secret-running")
    claim = repo.claim(running, dispatch_token=publish(repo, running), worker="gpu0@h", gpus="0",
                       gpu_count=1, now=t0, lease_ttl_s=3600)
    assert claim is not None
    big = _one(repo, bravo.id, now=t0, resources={"gpus": 4}, timeout_s=3600,
               name="bravo-secret-big")
    waiting = _one(repo, alpha.id, now=t0 + timedelta(seconds=1), timeout_s=3600,
                   name="alpha-long")
    heartbeat(redis_client, "gpu0@h", [GPU24], busy_job=running)
    for i in (1, 2, 3):
        heartbeat(redis_client, f"gpu{i}@h", [GPU24])
    heartbeat(redis_client, "gpu0-1-2-3@h", [X4])
    make(repo, redis_url, dispatch_headroom=0, reserve_after_s=RESERVE_AFTER_S).tick(utcnow())
    a_scheduler_leads(redis_client)

    # And bravo's array, logs, outputs and bundle, through the same API alpha uses
    settings = Settings(redis_url=redis_url, home=tmp_path)
    artifacts = ArtifactStore(f"file://{tmp_path / 'artifacts'}")
    service = Services(settings=settings, repo=repo, artifacts=artifacts, redis_client=redis_client)
    http = TestClient(create_app(settings, services=service))
    as_bravo = {"Authorization": f"Bearer {bravo_token}"}
    array = http.post("/v1/arrays", json={"name": "bravo-secret-array", "items": [
        {"entrypoint": "pkg.mod:main"}, {"entrypoint": "pkg.mod:main"}]}, headers=as_bravo)
    assert array.status_code == 201, array.text
    bundle = _tar("m.py", b"SECRET = 'bravo'\n")
    digest = "sha256:" + hashlib.sha256(bundle).hexdigest()
    assert http.put(f"/v1/bundles/{digest}", content=bundle, headers=as_bravo).status_code == 201
    out = tmp_path / "bravo-out"
    out.mkdir()
    (out / "result.txt").write_text("bravo's result")
    artifacts.put_tree(out, bravo.id, running, "outputs")

    ids = {running: "job", big: "job", array.json()["id"]: "array", digest: "bundle",
           **{job_id: "job" for job_id in array.json()["jobs"]}}
    yield World(http=http, alpha={"Authorization": f"Bearer {alpha_token}"},
                alpha_waiting=waiting, bravo_ids=ids,
                secrets={*ids, "bravo-secret", "team-bravo", bravo.id})
    http.close()


def leaks(answers: dict[str, str], secrets: set[str]) -> list[tuple[str, str]]:
    """(what was asked, the secret its answer holds) for every answer that names one."""
    return [(asked, s) for asked, text in answers.items() for s in secrets if s in text]


def alpha_sees(w: World) -> dict[str, str]:
    """Every answer alpha gets without naming anything of bravo's."""
    h = w.alpha
    mine = w.http.post("/v1/jobs", json={"entrypoint": "pkg.mod:main", "name": "alpha-after",
                                         "after": [w.alpha_waiting]}, headers=h)
    assert mine.status_code == 201
    asked = {
        "status of the job waiting behind the reservation": f"/v1/jobs/{w.alpha_waiting}",
        "status of a job waiting for a dependency": f"/v1/jobs/{mine.json()['id']}",
        "list": "/v1/jobs", "list queued": "/v1/jobs?state=queued", "queue": "/v1/queue",
        "top": "/v1/top", "usage": "/v1/usage",
        "usage of all tenants": "/v1/usage?all_tenants=true",
    }
    answers = {what: w.http.get(path, headers=h).text for what, path in asked.items()}
    answers["submit"] = mine.text
    return answers


def alpha_asks_about(w: World, some_id: str, kind: str) -> dict[str, tuple[int, str]]:
    """Every question alpha can ask naming `some_id` (a job, array or bundle id): each
    answer's status and body."""
    h = w.alpha
    if kind == "job":
        calls = [("GET", f"/v1/jobs/{some_id}{tail}", None)
                 for tail in ("", "/logs", "/outputs", "/outputs/result.txt")]
        calls.append(("POST", f"/v1/jobs/{some_id}/cancel", None))
    elif kind == "array":
        calls = [("GET", f"/v1/arrays/{some_id}{tail}", None) for tail in ("", "/manifest")]
        calls.append(("POST", f"/v1/arrays/{some_id}/cancel", None))
    else:
        calls = [("HEAD", f"/v1/bundles/{some_id}", None),
                 ("POST", "/v1/jobs", {"command": ["true"], "code": some_id}),
                 ("POST", "/v1/jobs", {"command": ["true"],
                                       "inputs": {"d": f"bundle:{some_id}/m.py"}})]
    if kind in ("job", "array"):
        calls += [("POST", "/v1/jobs", {"entrypoint": "pkg.mod:main", "after": [some_id]}),
                  ("POST", "/v1/arrays", {"items": [{"entrypoint": "pkg.mod:main"}],
                                          "defaults": {"after": [some_id]}})]
    answers = {}
    for method, path, body in calls:
        r = w.http.request(method, path, headers=h, json=body)
        answers[f"{method} {path} {json.dumps(body)}"] = (r.status_code, r.text)
    return answers


def never_existed(kind: str) -> str:
    if kind == "job":
        return "j-" + uuid.uuid4().hex[:20]
    if kind == "array":
        return "a-" + uuid.uuid4().hex[:20]
    return "sha256:" + hashlib.sha256(uuid.uuid4().bytes).hexdigest()


def test_no_answer_to_one_tenant_names_another_tenants_jobs(world: World, hole: str) -> None:
    # When alpha asks everything it can without naming bravo's ids
    answers = alpha_sees(world)
    found = leaks(answers, world.secrets)

    if hole == "reservation-named":
        # Then (the hole) alpha's pending reason names bravo's multi-GPU job
        assert any(asked.startswith("status of the job waiting") for asked, _ in found), found
        return
    if hole == "queue-named":
        # Then (the hole) the queue view names bravo to alpha
        assert ("queue", "team-bravo") in found, found
        return

    # Then no answer names bravo's jobs, arrays, names or tenant
    assert found == []
    # and alpha's job reads why it waits without naming the job it waits for
    pending = json.loads(answers["status of the job waiting behind the reservation"])["pending"]
    assert (pending["reason"], pending["detail"]) == ("reserved_for", explain.OTHERS)
    assert pending["text"] == explain.FOREIGN_RESERVATION
    # and the admin's view is refused (403), not answered without names
    assert json.loads(answers["usage of all tenants"])["error"] == "forbidden"


def test_an_answer_about_another_tenants_id_reads_as_one_about_an_id_that_never_existed(
        world: World, hole: str) -> None:
    if hole != "redacted":
        pytest.skip("the redactions of reasons and views do not answer questions about ids")
    for some_id, kind in world.bravo_ids.items():
        # When alpha asks about one of bravo's ids, and about an id that never existed
        theirs = alpha_asks_about(world, some_id, kind)
        missing_id = never_existed(kind)
        missing = alpha_asks_about(world, missing_id, kind)

        # Then each answer is a refusal (404, or 409 for a dependency or bundle alpha lacks)
        # that reads the same, but for the id it was asked about
        for (asked, (status, text)), (status_m, text_m) in zip(theirs.items(), missing.values(),
                                                               strict=True):
            assert status in (404, 409), (asked, status, text)
            assert (status, text.replace(some_id, "ID")) == \
                (status_m, text_m.replace(missing_id, "ID")), asked
            assert not leaks({asked: text.replace(some_id, "ID")}, world.secrets), asked
