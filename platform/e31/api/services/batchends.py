"""How a batch moves on as its shards do: counts while they run, the window's end, and the
output and error files once every shard ended.

`BatchEnds.settle` is called for a batch when a tenant reads it, and for every open batch by
the API's settling loop every `batch_settle_s` (`run`), so a batch nobody polls still expires
and finishes. Each move is a compare-and-set on the status (`BatchStore.move_batch`): of two
API processes, one finalises.

- **in progress**: `request_counts` are read from the shards' jobs: a shard that succeeded
  counts its result's succeeded and failed requests, a running one its progress (requests
  done), as completed until it ends.
- **the window's end**: a batch past `expires_at` has its unfinished shards cancelled; once
  they ended it is `expired`, as OpenAI's.
- **finalising**: the output file joins, shard by shard in input order, a succeeded shard's
  `results.jsonl` (its `errors.jsonl` into the error file), or, for a shard that was cancelled,
  expired or failed, the segments it committed (`checkpoints/llm`, e31_worker.workloads.segments'
  layout), and an error line for each of its requests that no segment holds
  (`batch_cancelled`, `batch_expired`, or `shard_failed` with the job's reason). The lines of
  unknown models, kept at creation, end the error file. Tokens in and out are summed from the
  output lines' `usage`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from e31.api.services.files import FileService
from e31.core.batches import FINAL, SHARD_CHECKPOINTS, BatchStatus, request_id
from e31.core.clock import utcnow
from e31.core.errors import E31Error
from e31.core.segments import WHOLE, segment_name
from e31.core.states import JobState
from e31.edge.artifacts import ArtifactStore
from e31.edge.bundlefiles import read_member
from e31.edge.bundlestore import BundleStore
from e31.store import Repo
from e31.store.batches import ShardJob
from e31.store.models import Batch

log = logging.getLogger(__name__)

CHECKPOINTS = f"checkpoints/{SHARD_CHECKPOINTS}"   # where an llm shard commits its segments
COPY_CHUNK_BYTES = 1024 * 1024
FINALIZE_STALE_S = 600.0          # a finalising this old was left by a process that died
REJECTED = "rejected.jsonl"       # the error lines of unknown models, beside the files
SHARD_FILE = "requests.jsonl"     # a shard's lines, the one entry of its bundle
FINAL_JOBS = {s.value for s in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)}
NOT_RUN = {"cancelled": ("batch_cancelled", "the batch was cancelled before this request ran"),
           "expired": ("batch_expired", "this request could not be executed before the "
                                        "completion window expired")}


def rejected_line(batch_id: str, custom_id: str, code: str, message: str) -> bytes:
    """An error line for a request that did not run: OpenAI's `error` field, no response."""
    return (json.dumps({"id": request_id(batch_id, custom_id), "custom_id": custom_id,
                        "response": None, "error": {"code": code, "message": message}},
                       separators=(",", ":")) + "\n").encode()


class BatchEnds:
    """Settles batches over the store, the artifacts (the shards' outputs and checkpoints),
    the bundles (the shards' lines) and the file store."""

    def __init__(self, *, repo: Repo, artifacts: ArtifactStore, bundles: BundleStore,
                 files: FileService, settle_s: float, shard_max_bytes: int) -> None:
        self._repo = repo
        self._artifacts = artifacts
        self._bundles = bundles
        self._files = files
        self._settle_s = settle_s
        self._shard_max_bytes = shard_max_bytes   # a shard's lines: at most its input file's

    def store_rejected(self, tenant_id: str, batch_id: str, lines: list[bytes]) -> None:
        if lines:
            with self._files.store.writing(tenant_id, f"{batch_id}.{REJECTED}") as out:
                out.writelines(lines)

    def run(self, stop: threading.Event) -> None:
        """Settle every open batch each `settle_s`, until `stop`."""
        while not stop.wait(self._settle_s):
            try:
                for batch in self._repo.open_batches():
                    self.settle(batch)
            except E31Error as exc:
                log.warning("batch_settle_failed %s: %s; next time", type(exc).__name__, exc)
            except Exception:   # this thread must not die alone: logged, tried again
                log.exception("batch_settle_failed: next time")

    def settle(self, batch: Batch) -> Batch:
        """Move `batch` on as far as its shards allow; returns it as it is now."""
        status = BatchStatus(batch.status)
        if status in FINAL:
            return batch
        now = utcnow()
        if status is BatchStatus.FINALIZING:
            if batch.finalizing_at and now - batch.finalizing_at < timedelta(
                    seconds=FINALIZE_STALE_S):
                return batch
        shards = self._repo.shard_jobs(batch.array_id) if batch.array_id else []
        ended = all(j.state in FINAL_JOBS for j in shards)
        if not ended:
            if status is BatchStatus.IN_PROGRESS and now >= batch.expires_at:
                self._repo.cancel_array(batch.tenant_id, batch.array_id or "", now=now)
                log.info("batch_window_ended batch=%s: its shards are cancelled", batch.id)
            completed, failed = _counts(batch, shards)
            if (completed, failed) != (batch.request_completed, batch.request_failed):
                self._repo.move_batch(batch.id, [status.value], request_completed=completed,
                                      request_failed=failed)
            return self._repo.get_batch(None, batch.id)
        if self._repo.move_batch(batch.id, [status.value], status=BatchStatus.FINALIZING.value,
                                 finalizing_at=now):
            try:
                self._finalize(batch, shards, end=_end(batch, status, shards, now))
            except Exception:   # the store or the artifacts failed: the next settle tries
                log.exception("batch_finalize_failed batch=%s: tried again at the next settle",
                              batch.id)
                back = status if status is not BatchStatus.FINALIZING else (
                    BatchStatus.CANCELLING if batch.cancelling_at else BatchStatus.IN_PROGRESS)
                self._repo.move_batch(batch.id, [BatchStatus.FINALIZING.value],
                                      status=back.value)
        return self._repo.get_batch(None, batch.id)

    def _finalize(self, batch: Batch, shards: list[ShardJob], *, end: str) -> None:
        tally = _Tally()
        with tempfile.TemporaryDirectory(prefix="e31-batch-") as tmp:
            errors_path = Path(tmp) / "errors.jsonl"
            with errors_path.open("wb") as errors:
                out = self._files_out(batch, shards, end, tally, errors)
                output = self._write(batch, "output", out)
                errors.writelines(self._rejected(batch))
            with errors_path.open("rb") as f:
                error = self._write(batch, "errors", iter(f))
        status = {"cancelled": BatchStatus.CANCELLED, "expired": BatchStatus.EXPIRED,
                  "completed": BatchStatus.COMPLETED}[end]
        now = utcnow()
        self._repo.move_batch(
            batch.id, [BatchStatus.FINALIZING.value], status=status.value,
            **{f"{status.value}_at": now}, output_file_id=output, error_file_id=error,
            request_completed=tally.completed, request_failed=tally.failed + batch.rejected,
            prompt_tokens=tally.prompt_tokens, completion_tokens=tally.completion_tokens)
        log.info("batch_%s batch=%s completed=%d failed=%d", status.value, batch.id,
                 tally.completed, tally.failed + batch.rejected)

    def _files_out(self, batch: Batch, shards: list[ShardJob], end: str, tally: _Tally,
                   errors: Any) -> Iterator[bytes]:
        """The output file's lines, shard by shard; the error lines go to `errors` as met."""
        for shard, note in zip(shards, batch.shards, strict=True):
            with tempfile.TemporaryDirectory(prefix="e31-shard-") as tmp:
                results, errs = self._shard_files(batch, shard, Path(tmp))
                seen: set[str] = set()
                for line in _lines(errs):
                    seen.add(_custom_id(line))
                    tally.failed += 1
                    errors.write(line)
                for line in _lines(results):
                    seen.add(_custom_id(line))
                    tally.count(line)
                    yield line
                if shard.state != JobState.SUCCEEDED.value:
                    for line in self._not_run(batch, note, shard, end, seen):
                        tally.failed += 1
                        errors.write(line)

    def _shard_files(self, batch: Batch, shard: ShardJob,
                     tmp: Path) -> tuple[list[Path], list[Path]]:
        """A shard's result and error files: its outputs if it succeeded, else its committed
        segments in order."""
        tenant, job = batch.tenant_id, shard.id
        if shard.state == JobState.SUCCEEDED.value:
            got = []
            for name in ("results.jsonl", "errors.jsonl"):
                path = tmp / name
                try:
                    with self._artifacts.open_output(tenant, job, name) as src, \
                            path.open("wb") as dst:
                        shutil.copyfileobj(src, dst, COPY_CHUNK_BYTES)
                    got.append([path])
                except E31Error:
                    got.append([])
            return got[0], got[1]
        self._artifacts.get_tree(tenant, job, CHECKPOINTS, tmp)
        spans = sorted((int(m[1]), int(m[2])) for p in tmp.glob("*.results.jsonl")
                       if (m := WHOLE.match(p.name)))
        return ([tmp / segment_name(a, b, "results") for a, b in spans],
                [tmp / segment_name(a, b, "errors") for a, b in spans])

    def _not_run(self, batch: Batch, note: dict[str, Any], shard: ShardJob, end: str,
                 seen: set[str]) -> Iterator[bytes]:
        code, message = NOT_RUN.get(end, ("shard_failed", ""))
        if end == "completed" or shard.state == JobState.FAILED.value:
            code, message = "shard_failed", (f"the job that ran this request's shard "
                                             f"({shard.id}) failed: {shard.reason or 'error'}")
        for request in shard_lines(self._bundles, batch.tenant_id, note["bundle"],
                                   max_bytes=self._shard_max_bytes):
            if request["custom_id"] not in seen:
                yield rejected_line(batch.id, request["custom_id"], code, message)

    def _rejected(self, batch: Batch) -> Iterator[bytes]:
        if not batch.rejected:
            return
        with self._files.store.open(batch.tenant_id, f"{batch.id}.{REJECTED}") as f:
            yield from f

    def _write(self, batch: Batch, kind: str, lines: Iterator[bytes]) -> str | None:
        """Store `lines` as the batch's output (or error) file; None when there are none.
        Its id is the batch's own, so that a finalising done again replaces it."""
        first = next(lines, None)
        if first is None:
            return None
        file_id = "file-" + hashlib.sha256(f"{batch.id}/{kind}".encode()).hexdigest()[:24]
        self._files.add_output(batch.tenant_id, file_id, f"{batch.id}_{kind}.jsonl",
                               _chain(first, lines))
        return file_id


class _Tally:
    """What the output lines add up to."""

    def __init__(self) -> None:
        self.completed = 0
        self.failed = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def count(self, line: bytes) -> None:
        self.completed += 1
        try:
            usage = json.loads(line)["response"]["body"].get("usage") or {}
        except (ValueError, KeyError, TypeError, AttributeError):
            return
        self.prompt_tokens += int(usage.get("prompt_tokens") or 0)
        self.completion_tokens += int(usage.get("completion_tokens") or 0)


def _end(batch: Batch, status: BatchStatus, shards: list[ShardJob], now: datetime) -> str:
    """How a batch whose shards all ended ends: `cancelled` when it was cancelled (or its
    array was, by hand), `expired` when its window ended before every shard succeeded,
    `completed` otherwise (a shard that failed fails its requests, not the batch)."""
    unfinished = any(j.state != JobState.SUCCEEDED.value for j in shards)
    if status is BatchStatus.CANCELLING or batch.cancelling_at is not None:
        return "cancelled"
    if unfinished and now >= batch.expires_at:
        return "expired"
    if any(j.state == JobState.CANCELLED.value for j in shards):
        return "cancelled"
    return "completed"


def _counts(batch: Batch, shards: list[ShardJob]) -> tuple[int, int]:
    """(completed, failed) requests as the shards stand."""
    completed, failed = 0, batch.rejected
    for j in shards:
        result = j.result if isinstance(j.result, dict) else {}
        if j.state == JobState.SUCCEEDED.value:
            completed += int(result.get("succeeded") or 0)
            failed += int(result.get("failed") or 0)
        else:
            completed += int(j.progress_done or 0)
    return completed, failed


def _lines(paths: list[Path]) -> Iterator[bytes]:
    for path in paths:
        if path.is_file():
            with path.open("rb") as f:
                yield from (line if line.endswith(b"\n") else line + b"\n"
                            for line in f if line.strip())


def _custom_id(line: bytes) -> str:
    try:
        return str(json.loads(line).get("custom_id"))
    except (ValueError, AttributeError):
        return ""


def _chain(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    yield first
    yield from rest


def shard_lines(bundles: BundleStore, tenant_id: str, digest: str, *,
                max_bytes: int) -> Iterator[dict[str, Any]]:
    """The requests of a stored shard, as they were given to its job (its bundle's one file,
    no larger than the batch's input file could be)."""
    with bundles.open(tenant_id, digest) as f:
        data = read_member(f, SHARD_FILE, max_bytes=max_bytes)
    return (json.loads(line) for line in data.splitlines() if line.strip())
