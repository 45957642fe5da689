"""Secrets end to end over real parts: the real API (its routes, over a real store and the
private Redis), the real scheduler publishing a real Celery message into Redis, and the real
worker task running the job as a child process.

A secret set by tenant A reaches A's job (the job writes its hash), and its value is nowhere
else: not in any row of any table, not in a log line E31 wrote (API, scheduler, worker: every
record captured), not in the attempt's log, not in any Redis key or Celery message (each one
decoded), not in any API answer, not in the attempt's claim file (the job copies it out). The
same search run on a value given in `env` instead finds it: the search can see. Tenant B,
naming A's secret, is refused at submit.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import logging
import secrets as random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from kombu import Connection
from sqlalchemy import MetaData, select

from e31.api import create_app
from e31.api.services import Services
from e31.core.clock import utcnow
from e31.edge.artifacts import ArtifactStore
from e31.edge.celeryapp import make_celery
from e31.edge.secrets import SecretBox, generate_key
from e31.edge.settings import Settings
from e31.scheduling.leader import Scheduler
from e31.store import Repo
from e31_worker.attempt import task
from tests.integration.test_scheduler import heartbeat
from tests.integration.test_task import services

CPU = {"resources": {"gpus": 0}}
# The job: the hash of its secret into an output, and the worker's claim file beside it (a
# process-isolated child can read its attempt's root), so both are searched too.
HASH_JOB = ('printf %s "$HF_TOKEN" | sha256sum | cut -c1-64 > "$E31_OUTPUT_DIR/hash"; '
            'cp "$E31_OUTPUT_DIR/../claim.json" "$E31_OUTPUT_DIR/claim.json"')


@pytest.fixture
def stack(repo: Repo, redis_url: str, redis_client: redis.Redis,
          tmp_path: Path) -> Iterator[dict[str, Any]]:
    settings = Settings(redis_url=redis_url, home=tmp_path, secrets_key=generate_key(),
                        dispatch_headroom=0)
    artifacts = ArtifactStore(f"file://{tmp_path / 'artifacts'}")
    service = Services(settings=settings, repo=repo, artifacts=artifacts,
                      redis_client=redis_client)
    client = TestClient(create_app(settings, services=service))
    heads = {}
    for name in ("team-a", "team-b"):
        _, token = repo.create_tenant(name, now=utcnow())
        heads[name] = {"Authorization": f"Bearer {token}"}
    worker = dataclasses.replace(
        services(repo, redis_client, tmp_path, artifacts),
        settings=settings.model_copy(update={"work_dir": str(tmp_path / "work")}))
    yield {"settings": settings, "client": client, "heads": heads, "worker": worker,
           "artifacts": artifacts, "redis": redis_client, "repo": repo}
    client.close()


def run_one(stack: dict[str, Any], body: dict[str, Any]) -> tuple[str, list[str]]:
    """Submit `body` as team-a through the API, publish it with the real scheduler, read the
    Celery message back from Redis, and run it with the worker's task. Returns the job id and
    every text Redis held while the message waited (keys' values, messages decoded)."""
    client, head = stack["client"], stack["heads"]["team-a"]
    answer = client.post("/v1/jobs", json=body, headers=head)
    assert answer.status_code == 201, answer.text
    job_id = answer.json()["id"]
    r: redis.Redis = stack["redis"]
    heartbeat(r, "cpu0@test", ["e31.cpu"], gpus="")
    settings = stack["settings"]
    assert Scheduler(settings=settings, repo=stack["repo"], redis_client=r,
                     celery=make_celery(settings)).tick() == 1
    texts = redis_texts(r)
    [(args, message)] = messages(r, "e31.cpu")
    assert args[0] == job_id and len(args) == 2        # a job id and its dispatch token
    texts.append(message)
    r.delete(*r.keys("e31.cpu*"))                      # the worker took it
    task.run_job(stack["worker"], job_id, args[1])
    return job_id, texts


def messages(r: redis.Redis, queue: str) -> list[tuple[list[Any], str]]:
    """Each Celery message waiting in `queue`: its arguments, and its whole body decoded."""
    found = []
    with Connection("memory://") as decoder:
        channel = decoder.default_channel
        for key in r.scan_iter(match=f"{queue}*"):
            if r.type(key) != b"list":
                continue
            for raw in r.lrange(key, 0, -1):
                envelope = json.loads(raw)
                args, _kwargs, _embed = channel.message_to_python(envelope).decode()
                found.append((args, base64.b64decode(envelope["body"]).decode()))
    return found


def redis_texts(r: redis.Redis) -> list[str]:
    """Every key of Redis with its value, as text (lists, hashes, sets, sorted sets whole)."""
    texts = []
    for key in r.scan_iter():
        kind = r.type(key).decode()
        if kind == "string":
            value: Any = r.get(key)
        elif kind == "list":
            value = r.lrange(key, 0, -1)
        elif kind == "hash":
            value = r.hgetall(key)
        elif kind == "set":
            value = r.smembers(key)
        elif kind == "zset":
            value = r.zrange(key, 0, -1, withscores=True)
        else:
            value = r.dump(key)
        texts.append(f"{key!r} {value!r}")
    return texts


def store_texts(repo: Repo) -> list[str]:
    """Every row of every table of the store, as text."""
    meta = MetaData()
    meta.reflect(repo.engine)
    with repo.engine.connect() as conn:
        return [f"{table.name} {tuple(row)!r}" for table in meta.sorted_tables
                for row in conn.execute(select(table))]


def api_texts(stack: dict[str, Any], job_id: str) -> list[str]:
    """What team-a's API answers about the job and its secrets."""
    client, head = stack["client"], stack["heads"]["team-a"]
    paths = [f"/v1/jobs/{job_id}", "/v1/jobs", f"/v1/jobs/{job_id}/logs",
             f"/v1/jobs/{job_id}/outputs", f"/v1/jobs/{job_id}/outputs/claim.json",
             "/v1/secrets", "/v1/queue", "/v1/usage"]
    answers = [client.get(path, headers=head) for path in paths]
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    return [a.text for a in answers]


def found(value: str, texts: list[str]) -> list[str]:
    return [t[:200] for t in texts if value in t]


def test_a_secret_reaches_its_job_and_nothing_else(stack: dict[str, Any],
                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    client, heads = stack["client"], stack["heads"]
    value = "hf_" + random.token_hex(16)
    # Given team-a's secret
    put = client.put("/v1/secrets/HF_TOKEN", json={"value": value}, headers=heads["team-a"])
    assert put.status_code == 201 and value not in put.text

    # When a job of team-a names it, and team-b's job names the same secret
    job_id, redis_seen = run_one(stack, {**CPU, "command": ["sh", "-c", HASH_JOB],
                                         "secrets": ["HF_TOKEN"]})
    refused = client.post("/v1/jobs", json={**CPU, "command": ["true"],
                                            "secrets": ["HF_TOKEN"]}, headers=heads["team-b"])
    dry = client.post("/v1/jobs?dry_run=true", json={**CPU, "command": ["true"],
                                                     "secrets": ["HF_TOKEN"]},
                      headers=heads["team-b"])

    # Then team-a's job saw it, as the environment variable of its name
    status = client.get(f"/v1/jobs/{job_id}", headers=heads["team-a"]).json()
    assert status["state"] == "succeeded", status
    output = client.get(f"/v1/jobs/{job_id}/outputs/hash", headers=heads["team-a"])
    assert output.text.strip() == hashlib.sha256(value.encode()).hexdigest()
    # and team-b's name does not resolve to team-a's secret
    assert refused.status_code == 409
    assert [e["field"] for e in refused.json()["errors"]] == ["secrets[0]"]
    assert "team-b has no secret" in refused.json()["message"]
    assert dry.json()["missing_secrets"] == ["HF_TOKEN"]
    assert len(client.get("/v1/jobs", headers=heads["team-b"]).json()["jobs"]) == 0

    # and the value is nowhere else
    logs = [r.getMessage() for r in caplog.records]
    assert found(value, store_texts(stack["repo"])) == []
    assert found(value, logs) == []
    assert found(value, redis_seen + redis_texts(stack["redis"])) == []
    assert found(value, api_texts(stack, job_id)) == []
    # while the store holds its ciphertext, which the key (and only it) opens
    tenant = stack["repo"].tenant_for_token(heads["team-a"]["Authorization"][7:])
    [cipher] = stack["repo"].secret_ciphertexts(tenant.id, ["HF_TOKEN"]).values()
    box = SecretBox(stack["settings"].secrets_key)
    assert box.decrypt(tenant.id, "HF_TOKEN", cipher) == value
    with pytest.raises(Exception, match="no key"):
        SecretBox(generate_key()).decrypt(tenant.id, "HF_TOKEN", cipher)


def test_the_same_search_finds_a_value_given_in_env(stack: dict[str, Any],
                                                    caplog: pytest.LogCaptureFixture) -> None:
    # The control: what the test above searches would show a value that leaked.
    caplog.set_level(logging.DEBUG)
    value = "hf_" + random.token_hex(16)
    job_id, redis_seen = run_one(stack, {**CPU, "command": ["sh", "-c", HASH_JOB.replace(
        '"$HF_TOKEN"', '"$PLAIN"')], "env": {"PLAIN": value}})
    assert found(value, store_texts(stack["repo"]))              # the stored spec
    assert found(value, api_texts(stack, job_id))                 # the status and claim.json
    # A Celery message carries the job id and its token only, so the control for Redis is
    # that the decoded message is searched at all: it holds the job id.
    assert found(job_id, redis_seen)


def test_without_a_key_the_secrets_routes_answer_503_saying_so(
        repo: Repo, redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    settings = Settings(redis_url=redis_url, home=tmp_path)
    service = Services(settings=settings, repo=repo,
                      artifacts=ArtifactStore(f"file://{tmp_path / 'a'}"),
                      redis_client=redis_client)
    _, token = repo.create_tenant("team-a", now=utcnow())
    head = {"Authorization": f"Bearer {token}"}
    with TestClient(create_app(settings, services=service)) as client:
        answers = [client.put("/v1/secrets/HF_TOKEN", json={"value": "v"}, headers=head),
                   client.get("/v1/secrets", headers=head),
                   client.delete("/v1/secrets/HF_TOKEN", headers=head)]
        unauthenticated = client.get("/v1/secrets")
    assert [a.status_code for a in answers] == [503, 503, 503]
    assert all("E31_SECRETS_KEY" in a.json()["message"] for a in answers)
    assert unauthenticated.status_code == 401
    assert store_texts(repo) and not [t for t in store_texts(repo) if t.startswith("secrets ")]


def test_secret_names_and_values_are_checked_and_listing_shows_no_value(
        stack: dict[str, Any]) -> None:
    client, head = stack["client"], stack["heads"]["team-a"]
    assert client.put("/v1/secrets/E31_TOKEN", json={"value": "v"},
                      headers=head).json()["errors"][0]["field"] == "name"
    assert client.put("/v1/secrets/HF_TOKEN", json={"value": ""}, headers=head).status_code == 422
    assert client.put("/v1/secrets/HF_TOKEN", json={"value": "a\x00b"},
                      headers=head).json()["errors"][0]["field"] == "value"
    # and the document says so, so that no body it allows is refused (schemathesis's ST202)
    body = client.get("/openapi.json").json()["paths"]["/v1/secrets/{name}"]["put"][
        "requestBody"]["content"]["application/json"]["schema"]
    value = client.get("/openapi.json").json()["components"]["schemas"][
        body["$ref"].rsplit("/", 1)[1]]["properties"]["value"]
    assert value["not"] == {"pattern": "\\x00"}
    assert client.put("/v1/secrets/HF_TOKEN", json={"value": "one"},
                      headers=head).status_code == 201
    assert client.put("/v1/secrets/HF_TOKEN", json={"value": "two"},
                      headers=head).status_code == 200
    listed = client.get("/v1/secrets", headers=head).json()["secrets"]
    assert [s["name"] for s in listed] == ["HF_TOKEN"] and "two" not in json.dumps(listed)
    # another tenant sees none of them and cannot delete them
    other = stack["heads"]["team-b"]
    assert client.get("/v1/secrets", headers=other).json() == {"secrets": []}
    assert client.delete("/v1/secrets/HF_TOKEN", headers=other).status_code == 404
    assert client.delete("/v1/secrets/HF_TOKEN", headers=head).status_code == 200
    assert client.get("/v1/secrets", headers=head).json() == {"secrets": []}
