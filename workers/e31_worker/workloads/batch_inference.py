"""Batch inference: a model over JSONL records, writing `results.jsonl` and `errors.jsonl`.

Records are read, parsed and collated into tensors on a background thread while the model
runs mini-batches on `ctx.device` under `torch.inference_mode` (pinned memory and
`non_blocking` copies on CUDA). A record that cannot be read or converted, or that makes the
model fail on its own, becomes a row of `errors.jsonl`; the batch goes on. Rows are committed
to the job's checkpoints every `checkpoint_every_records` records or `checkpoint_every_s`
seconds (`segments.py`), so a retried or requeued attempt starts after the last commit.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii
from typing import Any

import numpy
import torch

from e31_worker.child.context import JobContext
from e31_worker.child.runner import load_entrypoint
from e31_worker.workloads.models import build_model
from e31_worker.workloads.pipeline import (
    PREFETCH_DEPTH,
    cuda_batch_fits,
    prefetch,
    search_batch_size,
)
from e31_worker.workloads.records import Chunk, count_records, iter_chunks, list_files, parse_chunk
from e31_worker.workloads.segments import SegmentWriter

CHECKPOINT_EVERY_RECORDS = 10_000  # rows a retry may redo at most, by count ...
CHECKPOINT_EVERY_S = 60.0          # ... or by time, whichever comes first
MAX_BATCH_SIZE = 8192              # the batch-size search stops doubling here
SCRATCH = ".e31-batch-inference"   # the open segment, in the attempt's work dir

Preprocess = Callable[[dict[str, Any]], Any]
Postprocess = Callable[[torch.Tensor, list[Any], list[dict[str, Any]]], list[str]]


@dataclass
class Batch:
    """`count` consecutive input records: the good ones as `inputs`, the rest as `errors`."""

    count: int
    ids: list[Any] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    inputs: torch.Tensor | None = None
    errors: list[tuple[Any, str, str]] = field(default_factory=list)  # (custom_id, error, where)


class Collator:
    """Parses a chunk and turns its records into one input tensor; a record that cannot be
    read, or whose input has another shape than the others', becomes an error."""

    def __init__(self, *, input_key: str, input_shape: Sequence[int] | None, dtype: torch.dtype,
                 preprocess: Preprocess | None, pin: bool) -> None:
        self._key = input_key
        self._shape = tuple(input_shape) if input_shape else None
        self._dtype = dtype
        self._preprocess = preprocess
        self._pin = pin
        self._expected: tuple[int, ...] | None = self._shape
        try:
            self._np_dtype: numpy.dtype[Any] | None = torch.empty(0, dtype=dtype).numpy().dtype
        except TypeError:  # bfloat16 and friends have no numpy dtype
            self._np_dtype = None

    def __call__(self, chunk: Chunk) -> Batch:
        records, wheres, errors = parse_chunk(chunk)
        batch = Batch(count=len(chunk), errors=errors)
        tensors = self._fast(records) if self._preprocess is None and records else None
        if tensors is None and records:
            tensors, records = self._each(records, wheres, batch)
        if records and tensors is not None:
            batch.ids = [r["custom_id"] for r in records]
            batch.records = records
            batch.inputs = tensors.pin_memory() if self._pin else tensors
        return batch

    def _fast(self, records: list[dict[str, Any]]) -> torch.Tensor | None:
        """All records at once (the common case); None when any one does not fit."""
        key = self._key
        try:
            values = [r[key] for r in records]
            if self._np_dtype is not None:  # numpy converts nested lists ~2.5x faster
                t = torch.from_numpy(numpy.array(values, dtype=self._np_dtype))
            else:
                t = torch.tensor(values, dtype=self._dtype)
            if self._shape is not None:
                t = t.reshape(len(records), *self._shape)
        except (KeyError, TypeError, ValueError, RuntimeError):
            return None
        if self._expected is None:
            self._expected = tuple(t.shape[1:])
        return t if tuple(t.shape[1:]) == self._expected else None

    def _each(self, records: list[dict[str, Any]], wheres: list[str],
              batch: Batch) -> tuple[torch.Tensor | None, list[dict[str, Any]]]:
        """One record at a time, to tell the bad ones from the good."""
        converted: list[tuple[dict[str, Any], torch.Tensor, str]] = []
        for rec, where in zip(records, wheres, strict=True):
            try:
                converted.append((rec, self._one(rec), where))
            except Exception as exc:  # noqa: BLE001 - any failure is this record's error
                batch.errors.append((rec["custom_id"], f"{type(exc).__name__}: {exc}", where))
        if self._expected is None and converted:
            self._expected = Counter(tuple(t.shape) for _, t, _ in converted).most_common(1)[0][0]
        kept = []
        for rec, t, where in converted:
            if tuple(t.shape) == self._expected:
                kept.append((rec, t))
            else:
                why = f"input shape {list(t.shape)} does not match {list(self._expected or ())}"
                batch.errors.append((rec["custom_id"], why, where))
        if not kept:
            return None, []
        return torch.stack([t for _, t in kept]), [rec for rec, _ in kept]

    def _one(self, value: dict[str, Any]) -> torch.Tensor:
        if self._preprocess is not None:
            t = torch.as_tensor(self._preprocess(value))
        elif self._key not in value:
            raise KeyError(f"the record has no {self._key!r}")
        else:
            t = torch.as_tensor(value[self._key], dtype=self._dtype)
        return t.reshape(self._shape) if self._shape is not None else t


def run(ctx: JobContext, path: str, model: str, model_kwargs: dict[str, Any] | None = None,
        weights: str | None = None, batch_size: int = 64, auto_batch_size: bool = False,
        max_batch_size: int = MAX_BATCH_SIZE, input_key: str = "input",
        input_shape: list[int] | None = None, input_dtype: str = "float32",
        preprocess: str | None = None, postprocess: str = "classify",
        labels: list[Any] | None = None, checkpoint_every_records: int = CHECKPOINT_EVERY_RECORDS,
        checkpoint_every_s: float = CHECKPOINT_EVERY_S,
        prefetch_batches: int = PREFETCH_DEPTH, cpu_threads: int | None = None) -> dict[str, Any]:
    """Run `model` over the records at `path`; returns {total, succeeded, failed, ...}.

    A relative `path` or `weights` is one of the job's `inputs` (`ctx.input_path`).

    `postprocess`: `classify` (rows get `label` — an index, or `labels[index]` — and
    `score`, the softmax probability), `raw` (rows get `output`, the model's output as
    lists), or `module:fn` called as `fn(outputs_on_cpu, records) -> [dict per record]`.
    On CPU the model gets `cpu_threads` intra-op threads (default: torch's count less one,
    which leaves a core to the loader thread instead of fighting it for one).
    """
    started = time.monotonic()
    device = ctx.device
    net = build_model(model, model_kwargs, weights and ctx.input_path(weights), device).eval()
    files = list_files(ctx.input_path(path))
    total = count_records(files)
    writer = SegmentWriter(checkpoint_dir=ctx.checkpoint_dir / "batch_inference",
                           scratch_dir=ctx.work_dir / SCRATCH,
                           every_records=checkpoint_every_records, every_s=checkpoint_every_s)
    resumed_from = done = writer.resume()
    if resumed_from:
        print(f"batch_inference_resumed job={ctx.job_id} attempt={ctx.attempt} "
              f"from={resumed_from} total={total}", flush=True)
    ctx.progress(done, total)
    def make_collator() -> Collator:
        return Collator(input_key=input_key, input_shape=input_shape,
                        dtype=getattr(torch, input_dtype),
                        preprocess=load_entrypoint(preprocess) if preprocess else None,
                        pin=device == "cuda")

    collator = make_collator()
    if auto_batch_size and device == "cuda":  # its own collator: the run's learns its shape itself
        batch_size = _search(net, files, done, batch_size, min(max_batch_size, total),
                             make_collator())
    forward = _Forward(net, device, _postprocessor(postprocess, labels))
    threads_before = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(cpu_threads or max(1, threads_before - 1))
    try:
        chunks = iter_chunks(files, batch_size, skip=done)
        for batch in prefetch(map(collator, chunks), depth=prefetch_batches):
            rows, errors = forward(batch)
            writer.write("errors", "".join(errors))
            writer.write("results", "".join(rows))
            writer.advance(batch.count)
            done += batch.count
            ctx.progress(done, total)
        counts = writer.finish(ctx.output_dir)
    finally:
        writer.close()
        torch.set_num_threads(threads_before)
    return {"total": counts["results"] + counts["errors"], "succeeded": counts["results"],
            "failed": counts["errors"], "resumed_from": resumed_from, "batch_size": batch_size,
            "device": device, "seconds": round(time.monotonic() - started, 3)}


class _Forward:
    """One batch through the model; a failing batch is retried record by record."""

    def __init__(self, net: torch.nn.Module, device: str, post: Postprocess) -> None:
        self._net = net
        self._device = device
        self._post = post
        self._proven = False  # has the model run a batch in this attempt?

    def __call__(self, batch: Batch) -> tuple[list[str], list[str]]:
        errors = [_error_row(cid, err, where) for cid, err, where in batch.errors]
        if batch.inputs is None:
            return [], errors
        try:
            rows = self._rows(batch.inputs, batch.ids, batch.records)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - find out which records make it fail
            rows = self._one_by_one(batch, exc, errors)
        self._proven = True
        return rows, errors

    def _rows(self, inputs: torch.Tensor, ids: list[Any],
              records: list[dict[str, Any]]) -> list[str]:
        with torch.inference_mode():
            out = self._net(inputs.to(self._device, non_blocking=True))
            return self._post(out, ids, records)

    def _one_by_one(self, batch: Batch, exc: Exception, errors: list[str]) -> list[str]:
        assert batch.inputs is not None
        rows: list[str] = []
        for i, cid in enumerate(batch.ids):
            try:
                rows += self._rows(batch.inputs[i:i + 1], [cid], batch.records[i:i + 1])
            except Exception as one:  # noqa: BLE001 - this record's error
                errors.append(_error_row(cid, f"{type(one).__name__}: {one}", ""))
        if not rows and not self._proven:
            raise exc  # the model fails on everything: the job's error, not the records'
        return rows


def _error_row(cid: Any, error: str, where: str) -> str:
    return json.dumps({"custom_id": cid, "error": error, "where": where}) + "\n"


def _postprocessor(name: str, labels: list[Any] | None) -> Postprocess:
    """The model's outputs for a batch -> one JSON row (with its newline) per record."""
    dumps = json.dumps
    if name == "classify":
        def classify(out: torch.Tensor, ids: list[Any], records: Any) -> list[str]:
            score, index = out.float().softmax(-1).max(-1)
            idx = index.tolist()
            names = [_json(labels[i]) for i in idx] if labels else [str(i) for i in idx]
            # the text json.dumps({"custom_id": c, "label": n, "score": s}) writes, 4x faster
            return [f'{{"custom_id": {_json(c)}, "label": {n}, "score": {s!r}}}\n'
                    for c, n, s in zip(ids, names, score.tolist(), strict=False)]
        return classify
    if name == "raw":
        return lambda out, ids, records: [
            dumps({"custom_id": c, "output": o}) + "\n"
            for c, o in zip(ids, out.float().cpu().tolist(), strict=False)]
    fn = load_entrypoint(name)
    return lambda out, ids, records: [dumps({"custom_id": c, **v}) + "\n"
                                      for c, v in zip(ids, fn(out.cpu(), records), strict=True)]


def _json(value: Any) -> str:
    """`json.dumps(value)`, with a short cut for strings (the same C function it uses)."""
    return encode_basestring_ascii(value) if type(value) is str else json.dumps(value)


def _search(net: torch.nn.Module, files: list[str], skip: int, start: int, limit: int,
            collator: Collator) -> int:
    """The largest batch that fits the GPU, tried on copies of a record of the first batch
    that has good records (of the shape most of them have)."""
    for chunk in iter_chunks(files, start, skip=skip):
        batch = collator(chunk)
        if batch.inputs is not None:
            return search_batch_size(cuda_batch_fits(net, batch.inputs[0], "cuda"), start,
                                     max(start, limit))
    return start
