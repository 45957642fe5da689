"""The `llm` workload: one shard of an OpenAI-style batch, through a language model.

Input: a JSONL file of OpenAI batch requests (`{"custom_id", "method", "url", "body"}`, one
a line, checked by the API) and a Hugging Face-format model directory (a staged input;
nothing is downloaded). Each request is parsed and tokenized (`llm_requests`), run by a
backend in windows of requests (`llm_hf`: transformers' `generate` on length-sorted padded
batches; `llm_vllm`: vLLM's engine), and written as OpenAI's batch output rows
(`llm_rows`): `results.jsonl` for the answered requests, `errors.jsonl` for those that
failed on their own (a prompt longer than the context, a body the model cannot take).

Rows are committed in segments under `ctx.checkpoint_dir / "llm"` every
`checkpoint_every_records` requests or `checkpoint_every_s` seconds (at the end of a window,
whichever comes first; `segments.py`), so a killed attempt resumes after the last commit
without redoing or repeating a request, and a cancelled batch is finalised from them.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Iterator, Sequence
from itertools import islice
from pathlib import Path
from typing import Any, Protocol

from e31.core.batches import MODEL_MARKER, SHARD_CHECKPOINTS
from e31_worker.child.context import JobContext
from e31_worker.workloads.llm_requests import (
    EMBEDDINGS,
    ENDPOINTS,
    Choice,
    Prompter,
    Request,
    RequestError,
    custom_id,
)
from e31_worker.workloads.llm_rows import Rows, usage_of
from e31_worker.workloads.segments import SegmentWriter

CHECKPOINT_EVERY_RECORDS = 64   # requests a killed attempt may redo at most, by count ...
CHECKPOINT_EVERY_S = 10.0       # ... or by time (checked at the end of each window)
SORT_WINDOW_BATCHES = 4         # transformers: batches sorted by length together
SCRATCH = ".e31-llm"            # the open segment, in the attempt's work dir
BACKENDS = ("auto", "transformers", "vllm")
LONGEST_TEXT_TOKENS = 1 << 62   # the tokenizer's limit: Prompter says what is too long


class Backend(Protocol):
    """What runs a window of checked requests (llm_hf.HFBackend, llm_vllm.VllmBackend)."""

    name: str

    def complete(self, requests: Sequence[Request]) -> list[list[list[Choice]]]: ...

    def embed(self, requests: Sequence[Request]) -> list[list[list[float]]]: ...


def run(ctx: JobContext, requests: str, model: str, model_name: str, endpoint: str,
        batch_id: str = "", batch_size: int = 16,
        checkpoint_every_records: int = CHECKPOINT_EVERY_RECORDS,
        checkpoint_every_s: float = CHECKPOINT_EVERY_S, backend: str = "auto",
        cpu_threads: int | None = None) -> dict[str, Any]:
    """Answer every request of the file `requests` with the model in the directory `model`.

    Returns {total, succeeded, failed, prompt_tokens, completion_tokens, resumed_from,
    backend, device, seconds}; the token counts cover the whole job's output, the rows
    committed by earlier attempts included."""
    started = time.monotonic()
    if endpoint not in ENDPOINTS or backend not in BACKENDS:
        raise ValueError(f"endpoint must be one of {ENDPOINTS} and backend one of {BACKENDS}")
    model_dir = Path(ctx.input_path(model))
    src = Path(ctx.input_path(requests))
    context_tokens = context_of(model_dir)
    from transformers import AutoTokenizer
    # model_max_length: no warning about long texts, Prompter checks the context per request
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True,
                                              model_max_length=LONGEST_TEXT_TOKENS)
    engine, window = _backend(backend, ctx.device, model_dir, tokenizer, endpoint,
                              batch_size, context_tokens, checkpoint_every_records)
    total = sum(1 for _ in _lines(src))
    writer = SegmentWriter(checkpoint_dir=ctx.checkpoint_dir / SHARD_CHECKPOINTS,
                           scratch_dir=ctx.work_dir / SCRATCH,
                           every_records=checkpoint_every_records, every_s=checkpoint_every_s)
    resumed_from = done = writer.resume()
    tokens = [0, 0]  # prompt, completion
    for row in writer.committed("results"):
        for i, count in enumerate(usage_of(row)):
            tokens[i] += count
    if resumed_from:
        print(f"llm_resumed job={ctx.job_id} attempt={ctx.attempt} from={resumed_from} "
              f"total={total}", flush=True)
    ctx.progress(done, total)
    runner = _Runner(Prompter(tokenizer, context_tokens), engine,
                     Rows(batch_id=batch_id, model_name=model_name, endpoint=endpoint),
                     endpoint)
    threads = _Threads(ctx.device, cpu_threads)
    try:
        lines = _lines(src)
        for _ in islice(lines, done):
            pass
        while chunk := list(islice(lines, window)):
            results, errors, used = runner(chunk)
            writer.write("errors", "".join(errors))
            writer.write("results", "".join(results))
            writer.advance(len(chunk))
            tokens = [a + b for a, b in zip(tokens, used, strict=True)]
            done += len(chunk)
            ctx.progress(done, total)
        counts = writer.finish(ctx.output_dir)
    finally:
        writer.close()
        threads.restore()
    return {"total": counts["results"] + counts["errors"], "succeeded": counts["results"],
            "failed": counts["errors"], "prompt_tokens": tokens[0],
            "completion_tokens": tokens[1], "resumed_from": resumed_from,
            "backend": engine.name, "device": ctx.device,
            "seconds": round(time.monotonic() - started, 3)}


def context_of(model_dir: Path) -> int:
    """The model's context in tokens: its `e31_model.json`, else its config's
    `max_position_embeddings`."""
    marker = model_dir / MODEL_MARKER
    if marker.is_file():
        return int(json.loads(marker.read_text())["context_tokens"])
    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("max_position_embeddings") or config["n_positions"])


def _backend(name: str, device: str, model_dir: Path, tokenizer: Any, endpoint: str,
             batch_size: int, context_tokens: int, every_records: int) -> tuple[Backend, int]:
    """The backend to use and its window (requests per call): vLLM on CUDA where it is
    installed (`auto`), else transformers."""
    embed = endpoint == EMBEDDINGS
    if name == "vllm" or (name == "auto" and device == "cuda"
                          and importlib.util.find_spec("vllm") is not None):
        from e31_worker.workloads.llm_vllm import VllmBackend
        engine = VllmBackend.load(model_dir, context_tokens=context_tokens, embed=embed)
        return engine, engine.window(batch_size)
    from e31_worker.workloads.llm_hf import HFBackend
    hf = HFBackend.load(model_dir, tokenizer=tokenizer, device=device, embed=embed,
                        batch_size=batch_size)
    return hf, max(batch_size, min(batch_size * SORT_WINDOW_BATCHES, every_records))


class _Runner:
    """One window of lines -> (result rows, error rows, [prompt, completion] tokens)."""

    def __init__(self, prompter: Prompter, engine: Backend, rows: Rows, endpoint: str) -> None:
        self._prompter = prompter
        self._engine = engine
        self._rows = rows
        self._endpoint = endpoint
        self._proven = False  # has the backend answered a request in this attempt?

    def __call__(self, lines: list[str]) -> tuple[list[str], list[str], list[int]]:
        out: list[tuple[str, str]] = []   # (kind, row) per line, in input order
        good: list[tuple[int, Request]] = []
        for line in lines:
            try:
                good.append((len(out), self._prompter.parse(line, self._endpoint)))
                out.append(("results", ""))
            except RequestError as err:
                out.append(("errors", self._rows.error(custom_id(line), err)))
        used = [0, 0]
        for (i, _), (kind, row, tokens) in zip(good, self._answer([r for _, r in good]),
                                               strict=True):
            out[i] = (kind, row)
            used = [a + b for a, b in zip(used, tokens, strict=True)]
        return ([row for kind, row in out if kind == "results"],
                [row for kind, row in out if kind == "errors"], used)

    def _answer(self, requests: list[Request]) -> list[tuple[str, str, tuple[int, int]]]:
        """(kind, row, tokens) per request: all at once, or one by one when that fails."""
        if not requests:
            return []
        try:
            answered = self._all(requests)
        except Exception as exc:  # find out which requests make it fail
            if _out_of_memory(exc):
                raise
            answered = [self._alone(r) for r in requests]
            if not self._proven and all(kind == "errors" for kind, _, _ in answered):
                raise  # it fails on everything: the job's error (a broken model), not theirs
        self._proven = True
        return answered

    def _alone(self, request: Request) -> tuple[str, str, tuple[int, int]]:
        try:
            return self._all([request])[0]
        except Exception as exc:  # this request's own error
            if _out_of_memory(exc):
                raise
            err = RequestError(f"the model failed on this request: {type(exc).__name__}: "
                               f"{exc}", param=None, code="server_error")
            return ("errors", self._rows.error(request.custom_id, err, status_code=500,
                                               kind="server_error"), (0, 0))

    def _all(self, requests: list[Request]) -> list[tuple[str, str, tuple[int, int]]]:
        if self._endpoint == EMBEDDINGS:
            return [("results", self._rows.embedding(r, v), (_prompt_tokens(r), 0))
                    for r, v in zip(requests, self._engine.embed(requests), strict=True)]
        return [("results", self._rows.completion(r, c),
                 (_prompt_tokens(r), sum(x.completion_tokens for p in c for x in p)))
                for r, c in zip(requests, self._engine.complete(requests), strict=True)]


def _prompt_tokens(request: Request) -> int:
    return sum(len(p) for p in request.prompts)


def _out_of_memory(exc: BaseException) -> bool:
    """CUDA out of memory is the job's error (a smaller batch or a bigger GPU), never a
    request's."""
    return type(exc).__name__ == "OutOfMemoryError"


def _lines(path: Path) -> Iterator[str]:
    """The file's non-blank lines: one request each, counted by position."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield line


class _Threads:
    """On CPU, `cpu_threads` intra-op threads for the run (default: as the job was given)."""

    def __init__(self, device: str, cpu_threads: int | None) -> None:
        import torch
        self._before = torch.get_num_threads()
        if device == "cpu" and cpu_threads:
            torch.set_num_threads(cpu_threads)

    def restore(self) -> None:
        import torch
        torch.set_num_threads(self._before)
