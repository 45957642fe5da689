"""Footage processing: a per-frame model over video files, frames sampled at `fps`.

Frames are decoded (PyAV), sampled and resized on a background thread while the model runs
batches on `ctx.device`. Outputs: `frames.jsonl` (one row per sampled frame: file, time,
label, score) and `summary.json` (per file: frames, duration, class counts, mean score). A job
may cover a part of a file (`start_s`, `end_s`); `plan_chunks` splits many files, or a long
one, into the params of one job each.
"""

from __future__ import annotations

import json
import math
import posixpath
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy
import torch

from e31_worker.child.context import JobContext
from e31_worker.workloads.models import build_model
from e31_worker.workloads.pipeline import PREFETCH_DEPTH, prefetch
from e31_worker.workloads.video import (
    list_videos,
    render_test_video,
    sampled_frames,
    video_duration_s,
)

__all__ = ["plan_chunks", "render_test_video", "run", "video_duration_s"]

DEFAULT_MODEL = "e31_worker.workloads.models:frame_classifier"


def plan_chunks(paths: str | Sequence[str], chunk_s: float | None = None, *,
                durations: Mapping[str, float] | None = None,
                **params: Any) -> list[dict[str, Any]]:
    """The params of one footage job per file, or per `chunk_s` seconds of each file.

    Each item is `{"path", "start_s", "end_s", **params}`; chunks are half-open, so their
    frames add up to the whole file's. Pure when `durations` (path -> seconds) covers every
    file; otherwise the missing durations are read from the files. A directory stands for
    the videos in it.
    """
    files = [f for p in ([paths] if isinstance(paths, str) else paths) for f in list_videos(p)]
    items: list[dict[str, Any]] = []
    for f in files:
        duration = (durations or {}).get(f)
        if duration is None:
            duration = video_duration_s(f)
        n = max(1, math.ceil(duration / chunk_s - 1e-9)) if chunk_s else 1
        step = chunk_s if chunk_s else duration
        for i in range(n):
            items.append({**params, "path": f, "start_s": round(i * step, 6),
                          "end_s": round(min((i + 1) * step, duration), 6)})
    return items


def run(ctx: JobContext, path: str | list[str], model: str = DEFAULT_MODEL,
        model_kwargs: dict[str, Any] | None = None, weights: str | None = None,
        fps: float | None = 1.0, start_s: float = 0.0, end_s: float | None = None,
        size: list[int] | None = None, batch_size: int = 32, labels: list[str] | None = None,
        prefetch_batches: int = PREFETCH_DEPTH) -> dict[str, Any]:
    """Run a frame model over the video(s) at `path`; returns frame and class counts.

    `fps`: frames sampled per second of video (None: every frame). `size`: [width, height]
    the frames are resized to before the model (None: as decoded). Labels come from
    `labels`, else from the model's `labels` attribute, else are class indexes. A relative
    `path` or `weights` is one of the job's `inputs` (`ctx.input_path`).
    """
    started = time.monotonic()
    device = ctx.device
    net = build_model(model, model_kwargs, weights and ctx.input_path(weights), device).eval()
    names = labels or getattr(net, "labels", None)
    files = [f for p in ([path] if isinstance(path, str) else path)
             for f in list_videos(ctx.input_path(p))]
    durations = [video_duration_s(f) for f in files]
    spans = [(f, start_s, d if end_s is None else min(end_s, d))
             for f, d in zip(files, durations, strict=True)]
    total_s = sum(max(0.0, e - s) for _, s, e in spans)
    frame_size = (int(size[0]), int(size[1])) if size else None
    summaries = [_Summary(f, s, e, fps, d) for (f, s, e), d in zip(spans, durations, strict=True)]
    with open(ctx.output_dir / "frames.jsonl", "w") as out:
        batches = _batches(spans, fps, frame_size, batch_size, pin=device == "cuda")
        for index, times, frames in prefetch(batches, depth=prefetch_batches):
            with torch.inference_mode():
                x = frames.to(device, non_blocking=True).permute(0, 3, 1, 2).float().div_(255)
                score, label = net(x).float().softmax(-1).max(-1)
            summary = summaries[index]
            rows = summary.add(times, label.tolist(), score.tolist(), names)
            out.write("".join(json.dumps(r) + "\n" for r in rows))
            ctx.progress(min(total_s, _progress_s(summaries)), total_s)
    per_file = [s.as_dict() for s in summaries]
    (ctx.output_dir / "summary.json").write_text(json.dumps({"files": per_file}, indent=2))
    counts: Counter[str] = Counter()
    for s in summaries:
        counts.update(s.counts)
    ctx.progress(total_s, total_s)
    return {"files": len(files), "frames": sum(s.frames for s in summaries),
            "class_counts": dict(sorted(counts.items())), "device": device,
            "seconds": round(time.monotonic() - started, 3)}


def _batches(spans: list[tuple[str, float, float]], fps: float | None,
             size: tuple[int, int] | None, batch_size: int,
             pin: bool) -> Iterator[tuple[int, list[float], torch.Tensor]]:
    """(file index, frame times, uint8 frames [N, H, W, 3]); a batch never spans two files."""
    for index, (url, start, end) in enumerate(spans):
        times: list[float] = []
        images: list[numpy.ndarray] = []
        for t, image in sampled_frames(url, fps=fps, start_s=start, end_s=end, size=size):
            times.append(t)
            images.append(image)
            if len(images) == batch_size:
                yield index, times, _stack(images, pin)
                times, images = [], []
        if images:
            yield index, times, _stack(images, pin)


def _stack(images: list[numpy.ndarray], pin: bool) -> torch.Tensor:
    batch = torch.from_numpy(numpy.stack(images))
    return batch.pin_memory() if pin else batch


class _Summary:
    """What one file's sampled frames came to."""

    def __init__(self, url: str, start_s: float, end_s: float, fps: float | None,
                 duration_s: float) -> None:
        self.url, self.start_s, self.end_s, self.fps = url, start_s, end_s, fps
        self.duration_s = duration_s
        self.name = posixpath.basename(url)
        self.frames = 0
        self.score_sum = 0.0
        self.last_t = start_s
        self.counts: Counter[str] = Counter()

    def add(self, times: list[float], labels: list[int], scores: list[float],
            names: Sequence[str] | None) -> list[dict[str, Any]]:
        rows = []
        for t, i, s in zip(times, labels, scores, strict=True):
            label = names[i] if names else str(i)
            self.counts[label] += 1
            rows.append({"file": self.name, "t_s": round(t, 6), "label": label, "score": s})
        self.frames += len(times)
        self.score_sum += sum(scores)
        self.last_t = times[-1]
        return rows

    def as_dict(self) -> dict[str, Any]:
        return {"file": self.name, "path": self.url, "start_s": self.start_s,
                "end_s": self.end_s, "duration_s": round(self.duration_s, 6),
                "fps": self.fps, "frames": self.frames,
                "class_counts": dict(sorted(self.counts.items())),
                "mean_score": self.score_sum / self.frames if self.frames else None}


def _progress_s(summaries: list[_Summary]) -> float:
    """Seconds of footage covered so far (files are processed in order)."""
    return sum(s.last_t - s.start_s for s in summaries)
