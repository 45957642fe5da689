"""The built-in tiny language models: built in code, the same files every time, loadable
offline by transformers' Auto classes."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from e31.core.batches import MODEL_MARKER  # noqa: E402
from e31_worker.workloads.tinymodels import CONTEXT_TOKENS, build  # noqa: E402
from tests.unit.workload_context import one_torch_thread  # noqa: E402, F401 (autouse)

pytestmark = pytest.mark.torch


def digests(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_two_builds_write_the_same_files_quickly(tmp_path: Path) -> None:
    # Given the chat and embed models built twice into different directories
    started = time.monotonic()
    for kind in ("chat", "embed"):
        build(tmp_path / f"{kind}-1", kind)
        build(tmp_path / f"{kind}-2", kind)
    elapsed_s = time.monotonic() - started

    # Then each kind's files are byte for byte the same, a few MB, built well under 10 s
    for kind in ("chat", "embed"):
        first = digests(tmp_path / f"{kind}-1")
        assert first == digests(tmp_path / f"{kind}-2")
        assert "model.safetensors" in first and "tokenizer.json" in first
        size = sum(p.stat().st_size for p in (tmp_path / f"{kind}-1").rglob("*"))
        assert size < 8 * 2**20
        assert json.loads((tmp_path / f"{kind}-1" / MODEL_MARKER).read_text()) == {
            "kind": kind, "context_tokens": CONTEXT_TOKENS}
    assert elapsed_s < 10


def test_the_chat_model_loads_offline_and_answers_through_its_chat_template(
        tmp_path: Path) -> None:
    # Given the chat model
    directory = build(tmp_path / "chat", "chat")

    # When transformers' Auto classes load it, without the network
    tok = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    text = tok.apply_chat_template([{"role": "user", "content": "Hello"}],
                                   add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=12, do_sample=False,
                         pad_token_id=tok.pad_token_id)

    # Then the template wrapped the turn, and it wrote 12 printable characters after it
    assert text == "<|user|>Hello<|end|>\n<|assistant|>"
    assert model.config.max_position_embeddings == CONTEXT_TOKENS > 256
    reply = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert len(reply) == 12 and reply.isprintable()
    assert tok.decode(tok.encode("a\tb\nc", add_special_tokens=False)) == "a\tb\nc"


def test_the_embed_model_loads_with_automodel_and_says_mean_pooling(tmp_path: Path) -> None:
    # Given the embed model
    directory = build(tmp_path / "embed", "embed")

    # When AutoModel loads it
    tok = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    model = transformers.AutoModel.from_pretrained(directory, local_files_only=True)
    hidden = model(**tok(["two words"], return_tensors="pt")).last_hidden_state

    # Then it gives a hidden state per token, and its pooling is mean then normalise
    assert hidden.shape == (1, len("two words"), model.config.hidden_size)
    pooling = json.loads((directory / "1_Pooling" / "config.json").read_text())
    assert pooling["pooling_mode_mean_tokens"] is True


def test_the_command_line_builds_a_model_directory(tmp_path: Path) -> None:
    # When `python -m e31_worker.workloads.tinymodels DIR --kind chat` runs
    out = subprocess.run([sys.executable, "-m", "e31_worker.workloads.tinymodels",
                          str(tmp_path / "m"), "--kind", "chat"],
                         capture_output=True, text=True, check=True)

    # Then it printed the directory it wrote
    assert out.stdout.strip() == str(tmp_path / "m")
    assert (tmp_path / "m" / "config.json").is_file()
