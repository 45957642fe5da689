"""The merge job of a footage fan-out: the chunk jobs' outputs into one result.

`e31.fanout.plan` gives this job its params (the files in source order, each with the array
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
from pathlib import Path
from typing import Any

from e31.fanout import CHUNKS_INPUT
from e31_worker.child.context import JobContext
from e31_worker.workloads.footage import summary_of

ITEM_DIR = "{:06d}"   # how the worker names an item's directory in the staged input


def merge(ctx: JobContext, files: list[dict[str, Any]], total_frames: int = 0,
          fps: float | None = None, labels: list[str] | None = None) -> dict[str, Any]:
    """Join the chunks of every file in `files` (as `e31.fanout.plan` listed them)."""
    started = time.monotonic()
    root = Path(ctx.input_path(CHUNKS_INPUT))
    out = ctx.output_dir
    summaries: list[dict[str, Any]] = []
    totals: Counter[str] = Counter()
    decoders: set[str] = set()
    frames_done = 0
    with open(out / "frames.jsonl", "wb") as merged:
        for entry in files:
            rows = _rows(root, entry)
            counts = Counter(r["label"] for _, r in rows)
            summary = summary_of(entry["name"], counts, [r["score"] for _, r in rows]) | {
                "kind": entry["kind"], "source": entry["url"], "fps": fps,
                "chunks": len(entry["items"])}
            if entry["kind"] == "video":
                summary["duration_s"] = entry["duration_s"]
                _check_order(entry["name"], [r["t_s"] for _, r in rows])
                video = out / "videos" / entry["name"]
                video.mkdir(parents=True, exist_ok=True)
                (video / "frames.jsonl").write_bytes(b"".join(line for line, _ in rows))
                (video / "summary.json").write_text(json.dumps(summary, indent=2))
            merged.writelines(line for line, _ in rows)
            decoders |= {_chunk_decoder(root, i) for i in entry["items"]}
            totals.update(counts)
            summaries.append(summary)
            frames_done += len(rows)
            ctx.progress(frames_done, max(total_frames, frames_done) or None)
    decoder = "cuda" if decoders == {"cuda"} else "cpu"
    whole = {"files": summaries, "frames": frames_done,
             "class_counts": dict(sorted(totals.items())), "decoder": decoder,
             "chunks": len({i for f in files for i in f["items"]})}
    (out / "summary.json").write_text(json.dumps(whole, indent=2))
    return {"files": len(files), "frames": frames_done, "class_counts": whole["class_counts"],
            "chunks": whole["chunks"], "decoder": decoder,
            "seconds": round(time.monotonic() - started, 3)}


def _rows(root: Path, entry: dict[str, Any]) -> list[tuple[bytes, dict[str, Any]]]:
    """The rows of one file from its chunks, in chunk order, with their raw lines."""
    rows: list[tuple[bytes, dict[str, Any]]] = []
    for item in entry["items"]:
        chunk = root / ITEM_DIR.format(item)
        path = chunk / "frames.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"item {item} ({entry['name']}) left no frames.jsonl")
        got = 0
        with open(path, "rb") as f:
            for line in f:
                row = json.loads(line)
                if row["file"] == entry["name"]:
                    rows.append((line, row))
                    got += 1
        summary = json.loads((chunk / "summary.json").read_text())
        expected = sum(s["frames"] for s in summary["files"] if s["file"] == entry["name"])
        if got != expected:
            raise ValueError(f"item {item}: {expected} frames of {entry['name']} in its "
                             f"summary, {got} rows")
    return rows


def _check_order(name: str, times: list[float]) -> None:
    for before, after in zip(times, times[1:], strict=False):
        if after <= before:
            raise ValueError(f"{name}: frame at {after} s after one at {before} s: chunks "
                             "overlap or are out of order")


def _chunk_decoder(root: Path, item: int) -> str:
    summary = json.loads((root / ITEM_DIR.format(item) / "summary.json").read_text())
    return str(summary.get("decoder", "cpu"))
