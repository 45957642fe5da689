"""Resumable JSONL outputs: rows are committed in immutable segments under the checkpoint dir.

A segment covers the input records `[start, end)` and is two files,
`<start>-<end>.errors.jsonl` then `<start>-<end>.results.jsonl` (renamed into place in that
order, so a results file means its segment is whole: `e31.core.segments`, which the API
reads them by too). The checkpoint dir belongs to the job
and comes back at the start of every attempt, so a retried attempt skips the records of the
segments already there and loses at most the rows since the last commit. `finish` joins the
segments into `results.jsonl` and `errors.jsonl` in the attempt's output dir: complete, in
input order, without duplicates.

A commit is a close and a rename, no `fsync`: a killed process loses nothing the kernel
holds, and a host that goes down takes the attempt's directory with it; the next attempt,
on whichever host, starts from the checkpoints the worker uploaded (read back from the page
cache after the rename, so whole), never from this directory. The `fsync`s cost two disk
flushes per commit (tens of ms each on a busy disk: docs/performance.md, footage).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from e31.core.segments import KINDS, WHOLE, segment_name

COPY_CHUNK_BYTES = 1 << 20


class SegmentWriter:
    """Appends rows to the open segment and commits it every `every_records` or `every_s`."""

    def __init__(self, *, checkpoint_dir: Path, scratch_dir: Path, every_records: int,
                 every_s: float) -> None:
        self._dir = checkpoint_dir
        self._scratch = scratch_dir
        self._every_records = max(1, every_records)
        self._every_s = every_s
        self._segments: list[tuple[int, int]] = []
        self._start = 0
        self._end = 0
        self._files: dict[str, IO[str]] = {}
        self._opened_at = time.monotonic()

    def resume(self) -> int:
        """Number of leading input records already committed by earlier attempts."""
        found = sorted((int(m[1]), int(m[2])) for p in self._dir.glob("*.results.jsonl")
                       if (m := WHOLE.match(p.name)))
        done = 0
        for start, end in found:
            if start != done or not (self._dir / segment_name(start, end, "errors")).is_file():
                break  # only an unbroken chain from record 0 counts
            self._segments.append((start, end))
            done = end
        self._start = self._end = done
        return done

    def committed(self, kind: str) -> Iterator[bytes]:
        """The rows of `kind` committed so far (after `resume`: by earlier attempts), in order."""
        for start, end in self._segments:
            with open(self._dir / segment_name(start, end, kind), "rb") as seg:
                yield from seg

    def write(self, kind: str, line: str) -> None:
        """Append one row (`line` ends with a newline) of `kind` to the open segment."""
        f = self._files.get(kind)
        if f is None:
            f = self._open()[kind]
        f.write(line)

    def advance(self, records: int) -> None:
        """`records` more input records are written; commit when the interval is reached."""
        self._end += records
        if (self._end - self._start >= self._every_records
                or time.monotonic() - self._opened_at >= self._every_s):
            self.commit()

    def commit(self) -> None:
        """Make the open segment durable (a no-op when it covers no record)."""
        if self._end == self._start:
            return
        files = self._files or self._open()
        self._dir.mkdir(parents=True, exist_ok=True)
        for kind in KINDS:
            f = files[kind]
            f.close()
            _move(Path(f.name), self._dir / segment_name(self._start, self._end, kind))
        self._segments.append((self._start, self._end))
        self._files = {}
        self._start = self._end
        self._opened_at = time.monotonic()

    def finish(self, output_dir: Path) -> dict[str, int]:
        """Commit, then join every segment into `<kind>.jsonl`; returns the rows of each kind."""
        self.commit()
        counts = {}
        for kind in KINDS:
            rows = 0
            with open(output_dir / f"{kind}.jsonl", "wb") as out:
                for start, end in self._segments:
                    with open(self._dir / segment_name(start, end, kind), "rb") as seg:
                        while chunk := seg.read(COPY_CHUNK_BYTES):
                            rows += chunk.count(b"\n")
                            out.write(chunk)
            counts[kind] = rows
        return counts

    def close(self) -> None:
        """Drop the open, uncommitted segment (on failure: the next attempt redoes it)."""
        for f in self._files.values():
            f.close()
        self._files = {}

    def _open(self) -> dict[str, IO[str]]:
        self._scratch.mkdir(parents=True, exist_ok=True)
        # kept open across calls until commit() or close()
        self._files = {kind: open(self._scratch / f"open.{kind}.jsonl", "w")
                       for kind in KINDS}
        self._opened_at = time.monotonic()
        return self._files


def _move(src: Path, dst: Path) -> None:
    """Rename into place (atomic on one file system); copy then rename across file systems."""
    try:
        os.replace(src, dst)
    except OSError:
        tmp = dst.with_name(f".{dst.name}.tmp")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
        src.unlink()
