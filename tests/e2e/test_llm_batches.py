"""Batches of prompts, end to end: the official `openai` client against a real `e31 up` stack
(its API, scheduler and sandboxed workers running the `llm` workload on the built-in tiny
models): upload, create, counts that move, output and error files, cancel, expiry, a
malformed file; chat completions, completions and embeddings; and the docs' examples."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from e31.core.clock import utcnow
from e31.edge.settings import Settings
from e31.store import Repo, make_engine
from tests.conftest import wait_for
from tests.docblocks import doc, run_block
from tests.e2e.conftest import Stack

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(420)   # a batch's wait (BATCH_S) and the stack's first start

CHAT = "/v1/chat/completions"
FINAL = ("completed", "failed", "expired", "cancelled")
BATCH_S = 240.0          # a small batch ends well within this on a 2-core machine


@pytest.fixture(scope="module")
def client(stack: Stack) -> Any:
    models = {m["id"] for m in stack.client().batches.models()}
    if not {"e31-tiny-chat", "e31-tiny-embed"} <= models:
        pytest.fail(f"e31 up registered no built-in models ({models}): see {stack.home}/up.out")
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=stack.token, max_retries=2)


def chat(i: int, content: str | None = None, model: str = "e31-tiny-chat",
         **body: Any) -> dict[str, Any]:
    return {"custom_id": f"c-{i}", "method": "POST", "url": CHAT,
            "body": {"model": model, "max_tokens": 8, "temperature": 0,
                     "messages": [{"role": "user", "content": content or f"tell me {i}"}],
                     **body}}


def submit(client: Any, lines: list[dict[str, Any]], endpoint: str = CHAT,
           window: str = "24h") -> Any:
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    file = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    return client.batches.create(input_file_id=file.id, endpoint=endpoint,
                                 completion_window=window)


def wait_until(client: Any, batch_id: str, done: Any, timeout_s: float = BATCH_S) -> Any:
    seen: list[Any] = []

    def check() -> bool:
        seen.append(client.batches.retrieve(batch_id))
        return bool(done(seen[-1]))

    wait_for(check, timeout_s=timeout_s, poll_s=0.5, what=f"batch {batch_id}")
    return seen[-1]


def rows(client: Any, file_id: str | None) -> list[dict[str, Any]]:
    if not file_id:
        return []
    return [json.loads(x) for x in client.files.content(file_id).iter_lines() if x.strip()]


def test_a_chat_batch_runs_to_completed_with_each_request_answered_or_failing_alone(
        client: Any, stack: Stack) -> None:
    lines = [chat(0, "same question"), chat(1, "same question"), chat(2), chat(3, n=2),
             chat(4, model="no-such-model"), chat(5, "word " * 3000)]
    batch = submit(client, lines)

    ended = wait_until(client, batch.id, lambda b: b.status in FINAL)

    assert ended.status == "completed", ended
    assert (ended.request_counts.total, ended.request_counts.completed,
            ended.request_counts.failed) == (6, 4, 2)
    out = {r["custom_id"]: r for r in rows(client, ended.output_file_id)}
    assert sorted(out) == ["c-0", "c-1", "c-2", "c-3"]
    body = out["c-0"]["response"]["body"]
    assert out["c-0"]["response"]["status_code"] == 200 and out["c-0"]["error"] is None
    assert body["object"] == "chat.completion" and body["model"] == "e31-tiny-chat"
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert 0 < body["usage"]["completion_tokens"] <= 8
    assert body["choices"][0]["message"]["content"] == \
        out["c-1"]["response"]["body"]["choices"][0]["message"]["content"]   # temperature 0
    assert len(out["c-3"]["response"]["body"]["choices"]) == 2
    errors = {r["custom_id"]: r for r in rows(client, ended.error_file_id)}
    assert errors["c-4"]["error"]["code"] == "model_not_found"
    assert errors["c-5"]["response"]["body"]["error"]["code"] == "context_length_exceeded"
    assert ended.usage.input_tokens > 0 and ended.usage.output_tokens > 0
    usage = json.loads(stack.e31("usage", "--batches", "--json").stdout)
    mine = next(u for u in usage if u["batch"] == batch.id)
    assert mine["prompt_tokens"] == ended.usage.input_tokens and mine["gpu_seconds"] > 0


def test_completions_and_embeddings_run_on_the_built_in_models(client: Any) -> None:
    completions = submit(client, [
        {"custom_id": f"p-{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": "e31-tiny-chat", "prompt": f"once upon {i}", "max_tokens": 5}}
        for i in range(3)], endpoint="/v1/completions")
    embeddings = submit(client, [
        {"custom_id": f"e-{i}", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "e31-tiny-embed", "input": f"text {i}"}} for i in range(3)],
        endpoint="/v1/embeddings")

    done = [wait_until(client, b.id, lambda b: b.status in FINAL)
            for b in (completions, embeddings)]

    assert [b.status for b in done] == ["completed", "completed"]
    text = rows(client, done[0].output_file_id)
    assert {r["response"]["body"]["object"] for r in text} == {"text_completion"}
    vectors = rows(client, done[1].output_file_id)
    first = vectors[0]["response"]["body"]["data"][0]["embedding"]
    assert len(vectors) == 3 and len(first) > 8
    assert abs(sum(x * x for x in first) - 1.0) < 1e-3     # L2-normalised


def big_batch(client: Any, count: int) -> Any:
    return submit(client, [chat(i, f"a longer question number {i}", max_tokens=24)
                           for i in range(count)])


def test_a_cancelled_batch_keeps_what_its_shards_finished_and_fails_the_rest(
        client: Any) -> None:
    batch = big_batch(client, 1500)
    running = wait_until(client, batch.id, lambda b: b.request_counts.completed > 0)
    assert running.status == "in_progress"           # the counts move while it runs
    assert running.request_counts.completed < running.request_counts.total == 1500

    client.batches.cancel(batch.id)
    ended = wait_until(client, batch.id, lambda b: b.status in FINAL)

    assert ended.status == "cancelled", ended
    done, failed = rows(client, ended.output_file_id), rows(client, ended.error_file_id)
    assert done, "the shards had committed rows before the cancel"
    ids = [r["custom_id"] for r in done + failed]
    assert sorted(ids) == sorted(f"c-{i}" for i in range(1500))    # each once
    assert {r["error"]["code"] for r in failed} == {"batch_cancelled"}
    assert ended.request_counts.completed == len(done)


def test_a_batch_past_its_window_expires_with_what_it_finished(client: Any,
                                                              stack: Stack) -> None:
    batch = big_batch(client, 1500)
    wait_until(client, batch.id, lambda b: b.request_counts.completed > 0)
    settings = Settings(home=stack.home)
    repo = Repo(make_engine(settings.resolved_database_url),
                half_life_s=settings.fair_share_half_life_s)
    repo.move_batch(batch.id, ["in_progress"], expires_at=utcnow() - timedelta(seconds=1))

    ended = wait_until(client, batch.id, lambda b: b.status in FINAL)

    assert ended.status == "expired", ended
    done, failed = rows(client, ended.output_file_id), rows(client, ended.error_file_id)
    assert done and failed
    assert {r["error"]["code"] for r in failed} == {"batch_expired"}
    assert len({r["custom_id"] for r in done + failed}) == 1500


def test_a_malformed_file_fails_at_validation_and_runs_nothing(client: Any) -> None:
    batch = submit(client, [chat(0), chat(0), {"custom_id": "x", "url": CHAT, "body": {}}])

    assert batch.status == "failed"
    assert [(e.line, e.code) for e in batch.errors.data] == [
        (2, "duplicate_custom_id"), (3, "missing_required_parameter")]
    assert batch.request_counts.total == 0


def test_the_workloads_page_openai_example_runs_as_shown(stack: Stack, tmp_path: Path) -> None:
    [block] = doc("docs/workloads.md").run_blocks("openai-batch")
    script = tmp_path / "batch.py"
    script.write_text(block.text)
    env = dict(stack.env, E31_URL=stack.url, E31_TOKEN=stack.token)
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=BATCH_S)

    assert done.returncode == 0, done.stderr[-2000:]
    last = done.stdout.strip().splitlines()
    assert "completed 20 of 20" in last[-2] and last[-1].startswith("q-"), last
    assert time.monotonic() - started < BATCH_S


def test_the_workloads_page_batch_commands_run_as_shown(stack: Stack, tmp_path: Path) -> None:
    env = dict(stack.env, E31_URL=stack.url, E31_TOKEN=stack.token,
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    for block in doc("docs/workloads.md").run_blocks("batch-cli"):
        result = run_block(block, env=env, cwd=tmp_path, timeout_s=BATCH_S)
        assert result.returncode == 0, result.output
        assert "completed" in result.output and "tokens in" in result.output


def test_the_batch_commands_show_cancel_and_download_a_batch(stack: Stack, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"p{i}", "max_tokens": 3}) + "\n"
                               for i in range(4)))

    submitted = stack.e31("batch", "submit", str(prompts), "--model", "e31-tiny-chat",
                          "--wait", timeout_s=BATCH_S)
    batch_id = submitted.stdout.split()[0]
    status = stack.e31("batch", "status", batch_id, "--json")
    fetched = stack.e31("batch", "download", batch_id, "-o", str(tmp_path / "out"))
    cancelled = stack.e31("batch", "cancel", batch_id)

    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert json.loads(status.stdout)["endpoint"] == "/v1/completions"   # from the bodies
    assert fetched.returncode == 0 and (tmp_path / "out" / f"{batch_id}_output.jsonl").is_file()
    rows = (tmp_path / "out" / f"{batch_id}_output.jsonl").read_text().splitlines()
    assert sorted(json.loads(r)["custom_id"] for r in rows) == [f"row-{i}" for i in range(1, 5)]
    assert "completed" in cancelled.stdout     # an ended batch stays as it ended


def test_an_operator_adds_a_model_by_name_and_a_batch_uses_it(stack: Stack, client: Any) -> None:
    # Given the built-in chat model's directory, registered again under another name
    directory = stack.home / "models" / "e31-tiny-chat"
    added = stack.e31("model", "add", "chat-copy", "--path", str(directory), "--replace")
    listed = stack.e31("model", "list")

    # When a batch names it
    batch = submit(client, [chat(0, model="chat-copy")])
    ended = wait_until(client, batch.id, lambda b: b.status in FINAL)

    # Then it ran on it
    assert added.returncode == 0 and "model chat-copy (chat)" in added.stdout, added.stderr
    assert "chat-copy" in listed.stdout and "e31-tiny-embed" in listed.stdout
    assert ended.status == "completed"
    assert rows(client, ended.output_file_id)[0]["response"]["body"]["model"] == "chat-copy"
