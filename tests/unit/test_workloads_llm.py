"""The `llm` workload in-process on CPU, on the built-in tiny models, with a JobContext on
temporary directories."""

from __future__ import annotations

import base64
import json
import math
import struct
import sys
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from e31_worker.workloads import llm, llm_hf
from e31_worker.workloads.tinymodels import CONTEXT_TOKENS, build
from tests.docblocks import doc, output_matches, python_shown_output
from tests.unit.workload_context import make_ctx, one_torch_thread  # noqa: F401 (autouse)

pytestmark = pytest.mark.torch
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {kind: build(root / kind, kind) for kind in ("chat", "embed")}


def request_line(custom_id: str, url: str, **body: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": "e31-tiny", **body}}) + "\n"


def chat(custom_id: str, text: str = "Hello there", **params: Any) -> str:
    return request_line(custom_id, CHAT, messages=[{"role": "user", "content": text}], **params)


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_file(tmp_path: Path, models: dict[str, Path], lines: Sequence[str], *,
             endpoint: str = CHAT, name: str = "run", attempt: int = 1,
             **params: Any) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """Write `lines` to a file and run the workload over it; (its result, {results, errors})."""
    src = tmp_path / f"{name}.jsonl"
    src.write_text("".join(lines))
    ctx = make_ctx(tmp_path / name, attempt)
    kind = "embed" if endpoint == EMBEDDINGS else "chat"
    result = llm.run(ctx, requests=str(src), model=str(models[kind]), model_name=f"e31-tiny-{kind}",
                     endpoint=endpoint, batch_id="batch_test", **params)
    return result, {k: rows(ctx.output_dir / f"{k}.jsonl") for k in ("results", "errors")}


def body(row: dict[str, Any]) -> dict[str, Any]:
    return dict(row["response"]["body"])


def test_chat_rows_are_openai_batch_output_lines_in_input_order(
        tmp_path: Path, models: dict[str, Path]) -> None:
    # Given five chat requests with different lengths and max_tokens
    lines = [chat(f"c{i}", "Hi " * (1 + 3 * i), max_tokens=4 + i, temperature=0)
             for i in range(5)]

    # When the workload runs them in batches of 2
    result, out = run_file(tmp_path, models, lines, batch_size=2)

    # Then each is a 200 row with a chat.completion body shaped as OpenAI's, in input order
    assert [r["custom_id"] for r in out["results"]] == [f"c{i}" for i in range(5)]
    assert out["errors"] == []
    for i, row in enumerate(out["results"]):
        assert row["id"].startswith("batch_req_") and len(row["id"]) == len("batch_req_") + 24
        assert row["error"] is None and row["response"]["status_code"] == 200
        b = body(row)
        assert b["object"] == "chat.completion" and b["id"].startswith("chatcmpl-")
        assert b["model"] == "e31-tiny-chat" and isinstance(b["created"], int)
        [choice] = b["choices"]
        assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
        assert choice["finish_reason"] == "length" and choice["logprobs"] is None
        usage = b["usage"]
        assert usage["completion_tokens"] == 4 + i == len(choice["message"]["content"])
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert result["total"] == result["succeeded"] == 5 and result["failed"] == 0
    assert result["prompt_tokens"] == sum(body(r)["usage"]["prompt_tokens"]
                                          for r in out["results"])
    assert result["completion_tokens"] == 4 + 5 + 6 + 7 + 8
    assert result["backend"] == "transformers" and result["device"] == "cpu"
    assert json.loads((tmp_path / "run" / "progress.json").read_text()) == {"done": 5, "total": 5}


def test_temperature_zero_and_a_seed_give_the_same_completions_on_every_run(
        tmp_path: Path, models: dict[str, Path]) -> None:
    # Given greedy requests, seeded hot requests and n=2 among them
    lines = [chat("greedy", temperature=0, max_tokens=12),
             chat("seeded", temperature=1.5, top_p=0.9, seed=7, max_tokens=12),
             chat("seeded-n2", temperature=1.5, seed=7, n=2, max_tokens=12),
             chat("greedy-n2", temperature=0, n=2, max_tokens=12)]

    # When the same file runs twice
    _, first = run_file(tmp_path, models, lines, name="first", batch_size=4)
    _, second = run_file(tmp_path, models, lines, name="second", batch_size=4)

    # Then every choice is the same both times; n gives two choices, the same when greedy
    def texts(out: dict[str, list[dict[str, Any]]]) -> dict[str, list[str]]:
        return {r["custom_id"]: [c["message"]["content"] for c in body(r)["choices"]]
                for r in out["results"]}

    assert texts(first) == texts(second)
    got = texts(first)
    assert len(got["seeded-n2"]) == 2 and len(got["greedy-n2"]) == 2
    assert got["seeded-n2"][0] != got["seeded-n2"][1] != got["greedy"][0]  # they do sample
    assert got["greedy-n2"][0] == got["greedy-n2"][1] == got["greedy"][0]
    assert [c["index"] for c in body(first["results"][2])["choices"]] == [0, 1]
    assert body(first["results"][2])["usage"]["completion_tokens"] == sum(
        len(t) for t in got["seeded-n2"])


def test_a_stop_string_cuts_the_completion_before_it(tmp_path: Path,
                                                     models: dict[str, Path]) -> None:
    # Given what the model writes greedily for a prompt
    _, plain = run_file(tmp_path, models, [chat("a", temperature=0, max_tokens=20)],
                        name="plain")
    text = body(plain["results"][0])["choices"][0]["message"]["content"]
    stop = text[5:7]
    at = text.find(stop)

    # When the same request names two characters of it as a stop string (and one never seen),
    # in one batch with the same request without stop strings
    _, cut = run_file(tmp_path, models, [chat("a", temperature=0, max_tokens=20,
                                              stop=[stop, "\u2603never"]),
                                         chat("b", temperature=0, max_tokens=20)],
                      name="cut", batch_size=2)

    # Then the completion ends before the first occurrence, counted up to the stop's end,
    # and its neighbour runs on to its max_tokens
    choice = body(cut["results"][0])["choices"][0]
    assert choice["message"]["content"] == text[:at]
    assert choice["finish_reason"] == "stop"
    assert body(cut["results"][0])["usage"]["completion_tokens"] == at + len(stop)
    other = body(cut["results"][1])["choices"][0]
    assert (other["message"]["content"], other["finish_reason"]) == (text, "length")


def test_a_prompt_longer_than_the_context_is_an_error_row_and_the_others_succeed(
        tmp_path: Path, models: dict[str, Path]) -> None:
    # Given a good request, one too long for the context, one with bad values, another good one
    lines = [chat("ok-1", max_tokens=3), chat("too-long", "x" * CONTEXT_TOKENS, max_tokens=3),
             request_line("bad", CHAT, messages="not a list"),
             chat("hot", temperature=3), chat("ok-2", max_tokens=3)]

    # When the workload runs them
    result, out = run_file(tmp_path, models, lines, batch_size=2)

    # Then the good ones are results, and each bad one is a 400 with OpenAI's error body
    assert [r["custom_id"] for r in out["results"]] == ["ok-1", "ok-2"]
    errors = {r["custom_id"]: r for r in out["errors"]}
    assert list(errors) == ["too-long", "bad", "hot"]
    for row in errors.values():
        assert row["response"]["status_code"] == 400 and row["error"] is None
        assert row["id"].startswith("batch_req_")
    too_long = body(errors["too-long"])["error"]
    assert too_long["code"] == "context_length_exceeded" and too_long["param"] == "messages"
    assert too_long["type"] == "invalid_request_error"
    assert f"maximum context length is {CONTEXT_TOKENS} tokens" in too_long["message"]
    assert body(errors["bad"])["error"]["param"] == "messages"
    assert body(errors["hot"])["error"]["param"] == "temperature"
    assert (result["total"], result["succeeded"], result["failed"]) == (5, 2, 3)


def test_completions_take_a_string_or_a_list_of_prompts(tmp_path: Path,
                                                        models: dict[str, Path]) -> None:
    # Given a completions request with one prompt and one with two prompts and n=2
    lines = [request_line("one", COMPLETIONS, prompt="Once upon", max_tokens=5, temperature=0),
             request_line("two", COMPLETIONS, prompt=["Once upon", "A time"], n=2,
                          max_tokens=5, temperature=0)]

    # When the workload runs them
    _, out = run_file(tmp_path, models, lines, endpoint=COMPLETIONS)

    # Then the bodies are text_completions, with prompt p's choices at p*n + j
    one, two = (body(r) for r in out["results"])
    assert one["object"] == "text_completion" and one["id"].startswith("cmpl-")
    assert [c["index"] for c in two["choices"]] == [0, 1, 2, 3]
    assert two["choices"][0]["text"] == one["choices"][0]["text"] == two["choices"][1]["text"]
    assert all(c["finish_reason"] == "length" and len(c["text"]) == 5 for c in two["choices"])
    assert two["usage"]["prompt_tokens"] == len("Once upon") + len("A time")


def test_embeddings_are_unit_vectors_as_floats_or_base64(tmp_path: Path,
                                                         models: dict[str, Path]) -> None:
    # Given an input string, a list of inputs, and one asking for base64
    lines = [request_line("one", EMBEDDINGS, input="hello"),
             request_line("two", EMBEDDINGS, input=["hello", "a longer sentence"]),
             request_line("b64", EMBEDDINGS, input="hello", encoding_format="base64")]

    # When the workload runs them on the embed model
    result, out = run_file(tmp_path, models, lines, endpoint=EMBEDDINGS, batch_size=2)

    # Then each input has a unit vector, the same for the same text whatever its batch
    one, two, b64 = (body(r) for r in out["results"])
    assert one["object"] == "list" and one["model"] == "e31-tiny-embed"
    assert [d["index"] for d in two["data"]] == [0, 1]
    vector = one["data"][0]["embedding"]
    assert math.isclose(math.sqrt(sum(x * x for x in vector)), 1.0, rel_tol=1e-5)
    assert two["data"][0]["embedding"] == pytest.approx(vector, abs=1e-5)
    raw = base64.b64decode(b64["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(vector, abs=1e-5)
    assert two["usage"] == {"prompt_tokens": len("hello") + len("a longer sentence"),
                            "total_tokens": len("hello") + len("a longer sentence")}
    assert result["completion_tokens"] == 0 and result["succeeded"] == 3


def test_a_stopped_attempt_resumes_after_its_last_commit_and_each_request_is_written_once(
        tmp_path: Path, models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    # Given 20 requests, windows of 6 committed each, and a first attempt that dies in its
    # third window
    lines = [chat(f"r{i}", "Hi " * (i % 5 + 1), max_tokens=3, temperature=0)
             for i in range(20)]
    params: dict[str, Any] = {"batch_size": 2, "checkpoint_every_records": 6}
    complete = llm_hf.HFBackend.complete
    calls = {"n": 0}

    def dies_in_the_third_window(self: Any, requests: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("the attempt dies here")
        return complete(self, requests)

    monkeypatch.setattr(llm_hf.HFBackend, "complete", dies_in_the_third_window)
    with pytest.raises(KeyboardInterrupt):
        run_file(tmp_path, models, lines, name="job", **params)
    monkeypatch.setattr(llm_hf.HFBackend, "complete", complete)

    # When the second attempt runs with the job's checkpoints
    result, out = run_file(tmp_path, models, lines, name="job", attempt=2, **params)

    # Then it started after the 12 committed requests and the output has each once, in order
    assert result["resumed_from"] == 12
    assert [r["custom_id"] for r in out["results"]] == [f"r{i}" for i in range(20)]
    assert result["succeeded"] == 20 and result["completion_tokens"] == 60
    assert result["prompt_tokens"] == sum(body(r)["usage"]["prompt_tokens"]
                                          for r in out["results"])
    assert json.loads((tmp_path / "job" / "progress.json").read_text()) == {
        "done": 20, "total": 20}


def test_the_example_of_docs_workloads_runs_and_prints_what_the_page_shows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Given the Python block of "The llm workload" in docs/workloads.md
    [block] = [b for b in doc("docs/workloads.md").blocks
               if b.lang == "python" and "workloads import llm" in b.text]

    # When it runs in an empty directory
    monkeypatch.chdir(tmp_path)
    exec(compile(block.text, block.where, "exec"), {"__name__": "__docs__"})

    # Then it prints what the page shows
    assert output_matches(python_shown_output(block), capsys.readouterr().out)


class FakeVllm:
    """Stands in for the `vllm` module (not installed here): an engine that answers each
    prompt with `n` choices of three tokens, and embeds every input as [3, 4]."""

    def __init__(self, refuses: str) -> None:
        self.refuses = refuses          # a keyword this "version" does not know
        self.made: list[dict[str, Any]] = []
        self.asked: list[tuple[list[int], Any]] = []

    def LLM(self, **kwargs: Any) -> Any:  # vllm's name
        if self.refuses in kwargs:
            raise TypeError(f"unexpected keyword argument {self.refuses!r}")
        self.made.append(kwargs)
        return self

    @staticmethod
    def SamplingParams(**kwargs: Any) -> Any:  # vllm's name
        return SimpleNamespace(**kwargs)

    def generate(self, prompts: list[dict[str, list[int]]], sampling_params: list[Any],
                 use_tqdm: bool) -> list[Any]:
        self.asked += [(p["prompt_token_ids"], sp) for p, sp in zip(prompts, sampling_params,
                                                                     strict=True)]
        return [SimpleNamespace(outputs=[
            SimpleNamespace(index=j, text=f"{len(p['prompt_token_ids'])}-{j}",
                            token_ids=[1, 2, 3], finish_reason="length")
            for j in reversed(range(sp.n))]) for p, sp in zip(prompts, sampling_params,
                                                                strict=True)]

    def embed(self, prompts: list[Any], use_tqdm: bool) -> list[Any]:
        return [SimpleNamespace(outputs=SimpleNamespace(embedding=[3.0, 4.0])) for _ in prompts]


def test_the_vllm_backend_hands_each_request_its_own_sampling_and_reads_the_choices_back(
        tmp_path: Path, models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a stand-in vllm module (this machine has no GPU and no vLLM)
    fake = FakeVllm(refuses="runner")
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # the backend sets it
    lines = [chat("hot", temperature=0.5, top_p=0.9, seed=3, n=2, stop="x", max_tokens=5),
             chat("greedy", temperature=0, n=3)]

    # When the workload runs with backend vllm, for chat and for embeddings
    result, out = run_file(tmp_path, models, lines, backend="vllm")
    _, emb = run_file(tmp_path, models, [request_line("e", EMBEDDINGS, input=["a", "b"])],
                      endpoint=EMBEDDINGS, name="emb", backend="vllm")

    # Then each request got its parameters (a greedy one a single choice, copied n times),
    # choices come back in index order, and embeddings are normalised
    hot, greedy = (sp for _, sp in fake.asked)
    assert (hot.n, hot.temperature, hot.top_p, hot.seed, hot.stop, hot.max_tokens) == (
        2, 0.5, 0.9, 3, ["x"], 5)
    assert greedy.n == 1 and greedy.max_tokens == 16
    texts = [[c["message"]["content"] for c in body(r)["choices"]] for r in out["results"]]
    width = len(fake.asked[0][0])
    assert texts == [[f"{width}-0", f"{width}-1"], [f"{width}-0"] * 3]
    assert body(out["results"][1])["usage"]["completion_tokens"] == 9
    assert result["backend"] == "vllm"
    assert [d["embedding"] for d in body(emb["results"][0])["data"]] == [[0.6, 0.8]] * 2
    assert fake.made[-1].get("task") == "embed"  # the older name, after "runner" was refused
