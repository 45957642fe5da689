"""The merge job of a footage fan-out: the chunk jobs' outputs into one result.

`e31.ops.fanout.plan` gives this job its params (the files in source order, each with the array
items that cover it) and one input, `chunks`: the array's outputs, staged by the worker as
`chunks/<item index>/<output path>` (`array:<id>/outputs`, docs/jobs.md). It writes
`frames.jsonl` (every sampled frame of the source, in source then time order: the rows a
single job over the whole source writes), `summary.json` (per file and for the whole
source), and per video `videos/<name>/frames.jsonl` and `videos/<name>/summary.json`.
It checks what it joins: each video's frame times strictly increase across its chunks
(nothing repeated at a border) and every chunk's rows are there.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e31.core.footage import CHUNKS_INPUT
from e31_worker.child.context import JobContext
from e31_worker.workloads.footage import summary_of

ITEM_DIR = "{:06d}"   # how the worker names an item's directory in the staged input


def merge(ctx: JobContext, files: list[dict[str, Any]], total_frames: int = 0,
          fps: float | None = None, labels: list[str] | None = None) -> dict[str, Any]:
    """Join the chunks of every file in `files` (as `e31.ops.fanout.plan` listed them)."""
    started = time.monotonic()
    root = Path(ctx.input_path(CHUNKS_INPUT))
    out = ctx.output_dir
    summaries: list[dict[str, Any]] = []
    totals: Counter[str] = Counter()
    decoders: set[str] = set()
    frames_done = 0
    with open(out / "frames.jsonl", "wb") as merged:
        for entry in files:
            joined = _join(root, entry)
            summary = summary_of(entry["name"], joined.counts, joined.frames, joined.parts,
                                 joined.times) | {
                "kind": entry["kind"], "source": entry["url"], "fps": fps,
                "chunks": len(entry["items"])}
            if entry["kind"] == "video":
                summary["duration_s"] = entry["duration_s"]
                video = out / "videos" / entry["name"]
                video.mkdir(parents=True, exist_ok=True)
                (video / "frames.jsonl").write_bytes(b"".join(joined.blocks))
                (video / "summary.json").write_text(json.dumps(summary, indent=2))
            merged.writelines(joined.blocks)
            decoders |= joined.decoders
            totals.update(joined.counts)
            summaries.append(summary)
            frames_done += joined.frames
            ctx.progress(frames_done, max(total_frames, frames_done) or None)
    decoder = "cuda" if decoders == {"cuda"} else "cpu"
    whole = {"files": summaries, "frames": frames_done,
             "class_counts": dict(sorted(totals.items())), "decoder": decoder,
             "chunks": len({i for f in files for i in f["items"]})}
    (out / "summary.json").write_text(json.dumps(whole, indent=2))
    return {"files": len(files), "frames": frames_done, "class_counts": whole["class_counts"],
            "chunks": whole["chunks"], "decoder": decoder,
            "seconds": round(time.monotonic() - started, 3)}


@dataclass
class _Joined:
    """One file's rows from its chunks (raw JSONL blocks, in chunk order) and what they add
    up to."""

    blocks: list[bytes] = field(default_factory=list)
    frames: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    parts: list[float] = field(default_factory=list)   # their scores' exact sum (summary_of)
    times: tuple[float, float] | None = None            # first and last frame's time
    decoders: set[str] = field(default_factory=set)


def _join(root: Path, entry: dict[str, Any]) -> _Joined:
    """The rows of one file from its chunks. A chunk of this file alone (every chunk of a
    video) is taken whole, as bytes, with its summary's counts, score parts and first and
    last time: its row count is checked against its summary, and the times across chunk
    borders. A chunk of several files (images) is read row by row."""
    name = entry["name"]
    joined = _Joined()
    for item in entry["items"]:
        chunk = root / ITEM_DIR.format(item)
        path = chunk / "frames.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"item {item} ({name}) left no frames.jsonl")
        summary = json.loads((chunk / "summary.json").read_text())
        joined.decoders.add(str(summary.get("decoder", "cpu")))
        mine = [s for s in summary["files"] if s["file"] == name]
        expected = sum(s["frames"] for s in mine)
        if len(summary["files"]) == 1 and mine and "score_sum_parts" in mine[0]:
            block = path.read_bytes()
            got, times = block.count(b"\n"), _span(mine[0])
            joined.blocks.append(block)
            joined.counts.update(mine[0]["class_counts"])
            joined.parts.extend(mine[0]["score_sum_parts"])
        else:
            got, times = _read_rows(path, name, joined)
        if got != expected:
            raise ValueError(f"item {item}: {expected} frames of {name} in its summary, "
                             f"{got} rows")
        joined.frames += got
        if times is None:
            continue
        if entry["kind"] == "video" and joined.times is not None and times[0] <= joined.times[1]:
            raise _out_of_order(name, times[0], joined.times[1])
        joined.times = (joined.times or times)[0], times[1]
    return joined


def _out_of_order(name: str, t: float, before: float) -> ValueError:
    return ValueError(f"{name}: frame at {t} s after one at {before} s: chunks overlap or are "
                      "out of order")


def _span(summary: dict[str, Any]) -> tuple[float, float] | None:
    first, last = summary.get("first_t_s"), summary.get("last_t_s")
    return None if first is None or last is None else (float(first), float(last))


def _read_rows(path: Path, name: str, joined: _Joined) -> tuple[int, tuple[float, float] | None]:
    """Add the rows of `name` in `path` to `joined`; returns how many, and the first and last
    one's time. Their times must increase."""
    got, first, last = 0, None, None
    lines: list[bytes] = []
    with open(path, "rb") as f:
        for line in f:
            row = json.loads(line)
            if row["file"] != name:
                continue
            t = float(row["t_s"])
            if last is not None and t <= last:
                raise _out_of_order(name, t, last)
            first = t if first is None else first
            last = t
            lines.append(line)
            joined.counts[row["label"]] += 1
            joined.parts.append(row["score"])
            got += 1
    joined.blocks.append(b"".join(lines))
    return got, None if first is None or last is None else (first, last)
