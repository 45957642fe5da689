"""The OpenAI-compatible Files and Batches API, driven by the official `openai` client against
the real app over a real store and Redis (in process: the client's HTTP goes through the
app's test transport). No worker runs here: the shards stay queued, so what is checked is
validation, sharding, the batch object, cancel and expiry; tests/e2e/test_llm_batches.py runs
them to the end on a real stack."""

from __future__ import annotations

import io
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from e31.core.clock import utcnow
from e31.store import Repo
from tests.integration.conftest import MakeApp

CHAT = "/v1/chat/completions"


@pytest.fixture
def tenant_token(repo: Repo) -> str:
    _, secret = repo.create_tenant("team-a", now=utcnow())
    return secret


def register_model(repo: Repo, home: Path, name: str = "tiny", kind: str = "chat") -> None:
    """A model directory beneath the pool's models_dir, registered as an admin would."""
    from e31.store.batches import ModelRecord
    directory = home / "models" / name
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "e31_model.json").write_text(json.dumps({"kind": kind}))
    repo.add_model(ModelRecord(name, kind, f"file://{directory}", None, utcnow()))


def make_client(app: Any, token: str) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=token,
                         http_client=TestClient(app), max_retries=0)


def request_line(i: int, model: str = "tiny", url: str = CHAT, **body: Any) -> dict[str, Any]:
    return {"custom_id": f"r-{i}", "method": "POST", "url": url,
            "body": {"model": model, "messages": [{"role": "user", "content": f"hi {i}"}],
                     **body}}


def jsonl(lines: list[Any]) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def tenant_id(repo: Repo, token: str) -> str:
    tenant = repo.tenant_for_token(token)
    assert tenant is not None
    return tenant.id


def first_shard(repo: Repo, token: str, batch: Any) -> str:
    """The job id of a batch's first shard."""
    array = repo.get_array(tenant_id(repo, token), (batch.model_extra or {})["e31"]["array_id"])
    assert array.items
    return array.items[0].id


def upload(client: openai.OpenAI, data: bytes) -> str:
    return client.files.create(file=("requests.jsonl", io.BytesIO(data)), purpose="batch").id


def test_a_file_uploaded_with_the_openai_client_is_listed_read_back_and_deleted(
        make_app: MakeApp, tenant_token: str) -> None:
    client = make_client(make_app(), tenant_token)
    data = jsonl([request_line(i) for i in range(3)])

    created = client.files.create(file=("requests.jsonl", io.BytesIO(data)), purpose="batch")

    assert (created.bytes, created.purpose, created.filename) == (len(data), "batch",
                                                                  "requests.jsonl")
    assert client.files.retrieve(created.id).id == created.id
    assert [f.id for f in client.files.list().data] == [created.id]
    assert client.files.content(created.id).read() == data
    assert client.files.delete(created.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(created.id)


def test_another_tenants_file_answers_as_a_missing_one(make_app: MakeApp, repo: Repo,
                                                       tenant_token: str) -> None:
    app = make_app()
    _, other = repo.create_tenant("team-b", now=utcnow())
    file_id = upload(make_client(app, tenant_token), jsonl([request_line(0)]))

    with pytest.raises(openai.NotFoundError):
        make_client(app, other).files.content(file_id)
    with pytest.raises(openai.NotFoundError):
        make_client(app, other).batches.create(input_file_id=file_id, endpoint=CHAT,
                                               completion_window="24h")


def test_an_upload_over_the_file_limit_is_refused_413_and_nothing_is_kept(
        make_app: MakeApp, tenant_token: str) -> None:
    client = make_client(make_app(batch_file_max_bytes=4096), tenant_token)

    with pytest.raises(openai.APIStatusError) as refused:
        upload(client, jsonl([request_line(i) for i in range(100)]))

    assert refused.value.status_code == 413
    assert "batch_file_max_bytes" in refused.value.response.text
    assert client.files.list().data == []


def test_a_malformed_file_fails_at_validation_naming_each_bad_line_and_runs_nothing(
        make_app: MakeApp, repo: Repo, tenant_token: str, tmp_path: Path) -> None:
    register_model(repo, tmp_path)
    client = make_client(make_app(), tenant_token)
    lines: list[Any] = [request_line(0), "not json", {"method": "POST", "url": CHAT},
                        request_line(0), request_line(4, url="/v1/embeddings"),
                        {"custom_id": "r-5", "url": CHAT, "body": {"messages": []}}]
    file_id = upload(client, jsonl(lines))

    batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")

    assert batch.status == "failed"
    assert batch.errors is not None
    named = {(e.line, e.code) for e in batch.errors.data or []}
    assert named == {(2, "invalid_json_line"), (3, "missing_required_parameter"),
                     (4, "duplicate_custom_id"), (5, "mismatched_endpoint"),
                     (6, "missing_required_parameter")}
    assert batch.failed_at is not None
    assert repo.list_jobs(tenant_id(repo, tenant_token), limit=10) == []


def test_a_batch_becomes_an_array_of_llm_shards_due_at_the_end_of_its_window(
        make_app: MakeApp, repo: Repo, tenant_token: str, tmp_path: Path) -> None:
    register_model(repo, tmp_path)
    client = make_client(make_app(batch_shard_max_requests=100), tenant_token)
    file_id = upload(client, jsonl([request_line(i) for i in range(250)]
                                   + [request_line(999, model="no-such-model")]))

    batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="1h",
                                  metadata={"team": "search"})

    assert batch.status == "in_progress"
    assert (batch.request_counts.total, batch.request_counts.failed) == (251, 1)  # type: ignore[union-attr]
    assert batch.metadata == {"team": "search"}
    assert batch.expires_at - batch.created_at == 3600
    extra = batch.model_extra or {}
    array = repo.get_array(tenant_id(repo, tenant_token), extra["e31"]["array_id"])
    assert array.size == 3       # 250 requests, 100 at most per shard
    assert [s["requests"] for s in extra["e31"]["shards"]] == [84, 83, 83]
    job = repo.get_job(None, array.items[0].id)  # type: ignore[index]
    assert job.spec["entrypoint"] == "e31_worker.workloads.llm:run"
    assert job.size_class == "cpu"     # no node has a GPU: a model of no stated size runs there
    assert job.spec["inputs"]["model"] == f"file://{tmp_path / 'models' / 'tiny'}"
    assert client.batches.retrieve(batch.id).status == "in_progress"
    assert [b.id for b in client.batches.list().data] == [batch.id]


def test_a_window_the_pool_does_not_allow_is_refused_naming_it(
        make_app: MakeApp, repo: Repo, tenant_token: str, tmp_path: Path) -> None:
    register_model(repo, tmp_path)
    client = make_client(make_app(), tenant_token)
    file_id = upload(client, jsonl([request_line(0)]))

    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="5h")

    assert "completion_window" in refused.value.response.text


def test_a_cancelled_batch_ends_cancelled_with_each_request_in_its_error_file(
        make_app: MakeApp, repo: Repo, tenant_token: str, tmp_path: Path) -> None:
    register_model(repo, tmp_path)
    client = make_client(make_app(), tenant_token)
    file_id = upload(client, jsonl([request_line(i) for i in range(5)]))
    batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")

    cancelled = client.batches.cancel(batch.id)
    settled = client.batches.retrieve(batch.id)

    assert cancelled.status in ("cancelling", "cancelled")
    assert settled.status == "cancelled" and settled.cancelled_at is not None
    assert settled.output_file_id is None
    rows = [json.loads(x) for x in client.files.content(settled.error_file_id or "").iter_lines()]
    assert sorted(r["custom_id"] for r in rows) == [f"r-{i}" for i in range(5)]
    assert {r["error"]["code"] for r in rows} == {"batch_cancelled"}


def test_a_batch_past_its_window_is_expired_and_its_requests_are_batch_expired(
        make_app: MakeApp, repo: Repo, tenant_token: str, tmp_path: Path) -> None:
    register_model(repo, tmp_path)
    client = make_client(make_app(), tenant_token)
    file_id = upload(client, jsonl([request_line(i) for i in range(3)]))
    batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="1h")
    repo.move_batch(batch.id, ["in_progress"], expires_at=utcnow() - timedelta(seconds=1))

    client.batches.retrieve(batch.id)    # the window's end noticed: shards cancelled
    expired = client.batches.retrieve(batch.id)

    assert expired.status == "expired" and expired.expired_at is not None
    rows = [json.loads(x) for x in client.files.content(expired.error_file_id or "").iter_lines()]
    assert {r["error"]["code"] for r in rows} == {"batch_expired"}
    assert expired.request_counts.failed == 3  # type: ignore[union-attr]


def test_earlier_deadlines_come_first_among_a_tenants_queued_work(
        make_app: MakeApp, repo: Repo, tenant_token: str, tmp_path: Path) -> None:
    from e31.store.scheduling import heads
    register_model(repo, tmp_path)
    client = make_client(make_app(), tenant_token)
    late = client.batches.create(input_file_id=upload(client, jsonl([request_line(0)])),
                                 endpoint=CHAT, completion_window="72h")
    soon = client.batches.create(input_file_id=upload(client, jsonl([request_line(0)])),
                                 endpoint=CHAT, completion_window="1h")
    from sqlalchemy.orm import Session
    queue = repo.get_job(None, first_shard(repo, tenant_token, late)).queue  # no GPU: cpu
    with Session(repo.engine) as s:
        found = heads(s.connection(), {queue: 10}, now=utcnow())

    ids = [c.id for c in found]
    first = {b.id: first_shard(repo, tenant_token, b) for b in (late, soon)}
    assert ids.index(first[soon.id]) < ids.index(first[late.id])


def test_a_batch_over_the_tenants_bundle_quota_is_refused_413_and_nothing_runs(
        make_app: MakeApp, repo: Repo, tenant_token: str, tmp_path: Path) -> None:
    register_model(repo, tmp_path)
    client = make_client(make_app(tenant_bundle_gb=1e-6), tenant_token)   # ~1 KB
    file_id = upload(client, jsonl([request_line(i) for i in range(50)]))

    with pytest.raises(openai.APIStatusError) as refused:
        client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")

    assert refused.value.status_code == 413
    assert "tenant_bundle_gb" in refused.value.message    # the client shows OpenAI's error
    assert client.batches.list().data == []


def test_an_admin_registers_a_model_audited_and_a_tenant_may_only_list_it(
        make_app: MakeApp, repo: Repo, tenant_token: str, tmp_path: Path) -> None:
    app = make_app()
    _, admin = repo.create_tenant("ops", admin=True, now=utcnow())
    directory = tmp_path / "models" / "mine"
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    http = TestClient(app)

    refused = http.post("/v1/admin/models", json={"name": "mine", "path": str(directory)},
                        headers={"Authorization": f"Bearer {tenant_token}"})
    added = http.post("/v1/admin/models", json={"name": "mine", "path": str(directory)},
                      headers={"Authorization": f"Bearer {admin}"})
    outside = http.post("/v1/admin/models", json={"name": "other", "path": "/etc"},
                        headers={"Authorization": f"Bearer {admin}"})

    assert refused.status_code == 403
    assert added.status_code == 201 and added.json()["kind"] == "chat"   # from config.json
    assert outside.status_code == 403 and "models_dir" in outside.json()["message"]
    assert [m.id for m in make_client(app, tenant_token).models.list().data] == ["mine"]
    [event] = [e for e in repo.audit_log() if e.action == "model.add"]
    assert (event.actor, event.target) == ("ops", "mine")


def test_a_finalising_the_store_fails_is_tried_again_and_the_batch_still_ends(
        make_app: MakeApp, repo: Repo, tenant_token: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a cancelled batch whose first finalising meets a file store that fails once
    register_model(repo, tmp_path)
    app = make_app()
    client = make_client(app, tenant_token)
    batch = client.batches.create(input_file_id=upload(client, jsonl([request_line(0)])),
                                  endpoint=CHAT, completion_window="24h")
    files = app.state.services.files
    real, calls = files.add_output, []

    def failing_once(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(files, "add_output", failing_once)

    # When it is cancelled (its first finalising fails) and read again
    first = client.batches.cancel(batch.id)
    then = client.batches.retrieve(batch.id)

    # Then the failure left it where it was, and the next settle ended it
    assert first.status == "cancelling"
    assert then.status == "cancelled" and then.error_file_id is not None
