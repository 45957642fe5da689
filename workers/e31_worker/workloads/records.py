"""Batch-inference input: JSONL records from a file or a directory, a path or an fsspec URL.

Every non-blank line of a `.jsonl`/`.json`/`.ndjson` file is one record (a JSON object with
a `custom_id`); any other file in a directory is one record `{"custom_id": <relative path>,
"path": <its URL>}` for a `preprocess` function to load. Files are read in sorted order, so a
record's position is the same in every attempt: that is what resuming skips by.

Records travel in `Chunk`s of raw lines, parsed later in one go (`parse_chunk`) on the
loader thread.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import fsspec

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
# Parsing a chunk as one JSON array is ~25% cheaper than a json.loads per line, and exact
# when every value is an object and no line holds "}" "," "{" (the only way one line could
# hold two top-level objects, or one object span two lines, and still parse): a chunk with
# such a line, or any bad line, is parsed line by line instead.
_TWO_OBJECTS = re.compile(r"}\s*,\s*{").search


@dataclass
class Chunk:
    """Consecutive records: raw JSONL `lines`, or ready `records` (one per non-JSONL file)."""

    lines: list[str] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    where: list[str] = field(default_factory=list)  # `file:line`, or the file, per record

    def __len__(self) -> int:
        return len(self.lines) + len(self.records)


def list_files(url: str) -> list[str]:
    """The input files under `url` (itself when it is a file), as URLs, in sorted order."""
    fs, root = fsspec.core.url_to_fs(url)
    if not fs.isdir(root):
        return [url]
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    found = sorted(p for p in fs.find(root) if not posixpath.basename(p).startswith("."))
    if protocol in ("file", "local"):
        return found
    return [f"{protocol}://{p}" for p in found]


def count_records(files: list[str]) -> int:
    """How many records `iter_chunks` yields (one pass over the lines, no JSON parsing)."""
    total = 0
    for url in files:
        if url.endswith(JSONL_SUFFIXES):
            with fsspec.open(url, "rb") as f:
                total += sum(1 for line in f if line.strip())
        else:
            total += 1
    return total


def iter_chunks(files: list[str], size: int, skip: int = 0) -> Iterator[Chunk]:
    """Chunks of `size` records after the first `skip` (counted, not parsed). A chunk holds
    either lines or file records, so one may end early where the input changes kind."""
    if not files:
        return
    seen = 0
    chunk = Chunk()
    root = posixpath.commonpath(files) if len(files) > 1 else posixpath.dirname(files[0])
    for url in files:
        if not url.endswith(JSONL_SUFFIXES):
            seen += 1
            if seen > skip:
                if chunk.lines:
                    yield chunk
                    chunk = Chunk()
                rel = posixpath.relpath(url, root)
                chunk.records.append({"custom_id": rel, "path": url})
                chunk.where.append(url)
                if len(chunk) == size:
                    yield chunk
                    chunk = Chunk()
            continue
        if chunk.records:
            yield chunk
            chunk = Chunk()
        name = posixpath.basename(url)
        with fsspec.open(url, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                seen += 1
                if seen <= skip:
                    continue
                chunk.lines.append(line)
                chunk.where.append(f"{name}:{lineno}")
                if len(chunk.lines) == size:
                    yield chunk
                    chunk = Chunk()
    if len(chunk):
        yield chunk


def parse_chunk(chunk: Chunk) -> tuple[list[dict[str, Any]], list[str], list[tuple[Any, str, str]]]:
    """(records, their `where`, errors as (custom_id, error, where)) of a chunk."""
    if chunk.records:
        return chunk.records, chunk.where, []
    try:  # the common case: every line a JSON object with a custom_id, parsed in one call
        lines = chunk.lines
        if not any(map(_TWO_OBJECTS, lines)):
            values = json.loads("[" + ",".join(lines) + "]")
            for v in values:
                v["custom_id"]  # raises unless v is an object with a custom_id
            if len(values) == len(lines):
                return values, chunk.where, []
    except (ValueError, KeyError, TypeError, IndexError):
        pass
    records: list[dict[str, Any]] = []
    wheres: list[str] = []
    errors: list[tuple[Any, str, str]] = []
    for line, where in zip(chunk.lines, chunk.where, strict=True):
        try:
            value = json.loads(line)
        except ValueError as exc:
            errors.append((None, f"invalid JSON: {exc}", where))
            continue
        if not isinstance(value, dict) or "custom_id" not in value:
            cid = value.get("custom_id") if isinstance(value, dict) else None
            errors.append((cid, "a record must be a JSON object with a custom_id", where))
            continue
        records.append(value)
        wheres.append(where)
    return records, wheres, errors
