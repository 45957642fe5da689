"""Footage processing: a per-frame model over video (or image) files, frames sampled at `fps`.

Frames are decoded (PyAV; NVDEC on a GPU where the build and driver allow), sampled and
resized on a background thread while the model runs batches on `ctx.device` (a bounded
queue between them: `pipeline.prefetch`). Outputs: `frames.jsonl` (one row per sampled
frame: file, time, label, score) and `summary.json` (per file: frames, duration, class
counts, mean score; and the decoder used). A job may cover a part of a file (`start_s`,
`end_s`); rows are committed in segments to the job's checkpoints (`segments.py`), so a
drained, preempted or lost attempt resumes after its last committed frame.

A `source` param instead of `path` makes one submit a whole fan-out: chunk jobs in an array
and a merge job (`e31.ops.fanout`, `footage_merge`); `plan_chunks` splits files by hand.
"""

from __future__ import annotations

import json
import math
import posixpath
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy
import torch

from e31.core.footage import decode_threads_ok, is_image, plan_chunks
from e31_worker.child.context import JobContext
from e31_worker.workloads.models import build_model
from e31_worker.workloads.pipeline import (
    PREFETCH_DEPTH,
    cuda_batch_fits,
    prefetch,
    search_batch_size,
)
from e31_worker.workloads.segments import SegmentWriter
from e31_worker.workloads.video import (
    cuda_decoder,
    image_frame,
    list_videos,
    render_test_video,
    sampled_frames,
    video_duration_s,
)

__all__ = ["plan_chunks", "render_test_video", "run", "video_duration_s"]

DEFAULT_MODEL = "e31_worker.workloads.models:frame_classifier"
CHECKPOINT_EVERY_FRAMES = 1000   # frames a resumed attempt may redo at most, by count ...
CHECKPOINT_EVERY_S = 30.0        # ... or by time, whichever comes first
MAX_BATCH_SIZE = 1024            # the GPU batch-size search stops doubling here
SCRATCH = ".e31-footage"         # the open segment, in the attempt's work dir
# Progress is written at most this often (and at the end): the worker relays it at its
# heartbeat (2 s by default), and each write replaces a file, which costs a flush on ext4.
PROGRESS_EVERY_S = 1.0

Span = tuple[str, float, float | None]   # (url, start_s, end_s or None for the whole file)


def run(ctx: JobContext, path: str | list[str], model: str = DEFAULT_MODEL,
        model_kwargs: dict[str, Any] | None = None, weights: str | None = None,
        fps: float | None = 1.0, start_s: float = 0.0, end_s: float | None = None,
        size: list[int] | None = None, batch_size: int = 32, auto_batch_size: bool = True,
        labels: list[str] | None = None, names: list[str] | None = None,
        expected_frames: int | None = None, decode: str = "auto", decode_threads: int = 1,
        checkpoint_every_frames: int = CHECKPOINT_EVERY_FRAMES,
        checkpoint_every_s: float = CHECKPOINT_EVERY_S,
        prefetch_batches: int = PREFETCH_DEPTH) -> dict[str, Any]:
    """Run a frame model over the video(s) or image(s) at `path`; returns frame and class
    counts.

    `fps`: frames sampled per second of video (None: every frame). `size`: [width, height]
    the frames are resized to while decoded (None: as decoded). Labels come from `labels`,
    else from the model's `labels` attribute, else are class indexes. A relative `path` or
    `weights` is one of the job's `inputs` (`ctx.input_path`). `names`: the files' names in
    the rows (default: their base names). On CUDA the batch size is the largest that fits
    (doubling from `batch_size`) unless `auto_batch_size` is false; `decode`: `auto` (the
    GPU's decoder on CUDA where PyAV can use it), `cpu` or `cuda`. `expected_frames`: the
    progress total (the fan-out's planner sets it), else seconds of footage.
    `decode_threads`: the CPU decoder's and the resize's threads (0: FFmpeg's automatic
    count, one per core). One by default: the fan-out runs chunk jobs side by side, one per
    worker, where FFmpeg's automatic threads only contend (docs/performance.md, "Footage").
    """
    if not decode_threads_ok(decode_threads):
        raise ValueError(f"decode_threads: {decode_threads!r} is not a whole number of "
                         "threads, 0 (FFmpeg's choice) or more")
    started = time.monotonic()
    device = ctx.device
    net = build_model(model, model_kwargs, weights and ctx.input_path(weights), device).eval()
    label_names = labels or getattr(net, "labels", None)
    spans, summaries = _plan(ctx, path, names, fps, start_s, end_s)
    writer = SegmentWriter(checkpoint_dir=ctx.checkpoint_dir / "footage",
                           scratch_dir=ctx.work_dir / SCRATCH,
                           every_records=checkpoint_every_frames, every_s=checkpoint_every_s)
    resumed_from = writer.resume()
    first, after_s = _replay(writer, summaries)
    if resumed_from:
        print(f"footage_resumed job={ctx.job_id} attempt={ctx.attempt} frames={resumed_from} "
              f"file={first} after_s={after_s}", flush=True)
    progress = _Progress(ctx, summaries, expected_frames)
    hwaccel = cuda_decoder() if device == "cuda" and decode in ("auto", "cuda") else None
    if decode == "cuda" and hwaccel is None:
        raise RuntimeError("decode=cuda: this PyAV build or machine has no CUDA decoder")
    frame_size = (int(size[0]), int(size[1])) if size else None
    if auto_batch_size and device == "cuda" and first < len(spans):
        batch_size = _search(net, spans[first], fps, frame_size, batch_size)
    used: list[list[str]] = [[] for _ in spans]
    try:
        batches = _batches(spans, first, after_s, fps, frame_size, batch_size,
                           pin=device == "cuda", hwaccel=hwaccel, used=used,
                           threads=decode_threads)
        for index, times, frames in prefetch(batches, depth=prefetch_batches):
            rows = summaries[index].add(times, *_classify(net, frames, device), label_names)
            writer.write("results", "".join(json.dumps(r) + "\n" for r in rows))
            writer.advance(len(rows))
            progress.report()
        writer.finish(ctx.output_dir)
    finally:
        writer.close()
    frames_total, class_counts, decoder = _write_outputs(ctx, summaries, used, decode)
    progress.report(final=True)
    return {"files": len(spans), "frames": frames_total, "class_counts": class_counts,
            "device": device, "decoder": decoder, "batch_size": batch_size,
            "resumed_from": resumed_from, "seconds": round(time.monotonic() - started, 3)}


def _plan(ctx: JobContext, path: str | list[str], names: list[str] | None, fps: float | None,
          start_s: float, end_s: float | None) -> tuple[list[Span], list[_Summary]]:
    """The files at `path` (each an input of the job when relative) as spans to sample, and
    an empty summary of each under its name in the rows."""
    files = [f for p in ([path] if isinstance(path, str) else path)
             for f in list_videos(ctx.input_path(p))]
    shown = names if names and len(names) == len(files) else [posixpath.basename(f)
                                                               for f in files]
    durations = [video_duration_s(f) for f in files]
    spans: list[Span] = [(f, start_s, d if end_s is None else min(end_s, d))
                         for f, d in zip(files, durations, strict=True)]
    summaries = [_Summary(n, f, s, e, fps, d)
                 for n, (f, s, e), d in zip(shown, spans, durations, strict=True)]
    return spans, summaries


def _classify(net: torch.nn.Module, frames: torch.Tensor,
              device: str) -> tuple[list[int], list[float]]:
    """Each frame's best class and its score (softmax), from a batch of uint8 frames."""
    with torch.inference_mode():
        x = frames.to(device, non_blocking=True).permute(0, 3, 1, 2).float().div_(255)
        score, label = net(x).float().softmax(-1).max(-1)
    return label.tolist(), score.tolist()


def _write_outputs(ctx: JobContext, summaries: list[_Summary], used: list[list[str]],
                   decode: str) -> tuple[int, dict[str, int], str]:
    """Name the committed rows `frames.jsonl` and write `summary.json`; returns the frames,
    the class counts and the decoder of the whole job (`cuda` only if the GPU decoded every
    file). With `decode=cuda`, a file the CPU decoded is an error."""
    (ctx.output_dir / "results.jsonl").rename(ctx.output_dir / "frames.jsonl")
    (ctx.output_dir / "errors.jsonl").unlink()
    for summary, u in zip(summaries, used, strict=True):
        summary.decoder = "cuda" if u and all(d == "cuda" for d in u) else "cpu"
    decoder = "cuda" if all(s.decoder == "cuda" for s in summaries) and summaries else "cpu"
    if decode == "cuda" and decoder != "cuda":
        raise RuntimeError("decode=cuda: the GPU did not decode this footage (PyAV or the "
                           "driver cannot); decode=auto falls back to the CPU")
    counts: Counter[str] = Counter()
    for s in summaries:
        counts.update(s.counts)
    frames_total = sum(s.frames for s in summaries)
    class_counts = dict(sorted(counts.items()))
    (ctx.output_dir / "summary.json").write_text(json.dumps(
        {"files": [s.as_dict() for s in summaries], "frames": frames_total,
         "class_counts": class_counts, "decoder": decoder}, indent=2))
    return frames_total, class_counts, decoder


def _replay(writer: SegmentWriter, summaries: list[_Summary]) -> tuple[int, float | None]:
    """Feed the rows earlier attempts committed into `summaries`; returns where to go on:
    the index of the file of the last committed row and the time of that row (None: from
    the start of that file)."""
    index, after = 0, None
    for line in writer.committed("results"):
        row = json.loads(line)
        while summaries[index].name != row["file"]:
            index += 1
            after = None
        summaries[index].add_row(row)
        after = row["t_s"]
    if after is not None and is_image(summaries[index].url):
        return index + 1, None   # an image is one frame: it is done
    return index, after


def _batches(spans: list[Span], first: int, after_s: float | None, fps: float | None,
             size: tuple[int, int] | None, batch_size: int, pin: bool, hwaccel: Any,
             used: list[list[str]],
             threads: int = 1) -> Iterator[tuple[int, list[float], torch.Tensor]]:
    """(file index, frame times, uint8 frames [N, H, W, 3]) from file `first` on, after the
    frame at `after_s` in it; a batch never spans two files, except images, which are batched
    together (one frame each)."""
    times: list[float] = []
    images: list[numpy.ndarray] = []
    for index in range(first, len(spans)):
        url, start, end = spans[index]
        if is_image(url):
            used[index].append("cpu")
            yield index, [0.0], _stack([image_frame(url, size)], pin)
            continue
        frames = sampled_frames(url, fps=fps, start_s=start, end_s=end, size=size,
                                after_s=after_s if index == first else None, hwaccel=hwaccel,
                                used=used[index], threads=threads)
        for t, image in frames:
            times.append(t)
            images.append(image)
            if len(images) == batch_size:
                yield index, times, _stack(images, pin)
                times, images = [], []
        if images:
            yield index, times, _stack(images, pin)
            times, images = [], []


def _stack(images: list[numpy.ndarray], pin: bool) -> torch.Tensor:
    batch = torch.from_numpy(numpy.stack(images))
    return batch.pin_memory() if pin else batch


def _search(net: torch.nn.Module, span: Span, fps: float | None,
            size: tuple[int, int] | None, start: int) -> int:
    """The largest batch of this footage's frames that fits the GPU, by doubling."""
    url, start_s, end_s = span
    if is_image(url):
        image = image_frame(url, size)
    else:
        first = next(sampled_frames(url, fps=fps, start_s=start_s, end_s=end_s, size=size),
                     None)
        if first is None:
            return start
        image = first[1]
    sample = torch.from_numpy(image).permute(2, 0, 1).float().div_(255)
    return search_batch_size(cuda_batch_fits(net, sample, "cuda"), start, MAX_BATCH_SIZE)


class _Progress:
    """Reports frames done of the planned total, or seconds of footage when none is planned."""

    def __init__(self, ctx: JobContext, summaries: list[_Summary],
                 expected_frames: int | None) -> None:
        self._ctx = ctx
        self._summaries = summaries
        self._expected = expected_frames
        self._seconds = sum(max(0.0, (s.end_s or 0.0) - s.start_s) for s in summaries)
        self._last = -math.inf

    def report(self, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self._last < PROGRESS_EVERY_S:
            return
        self._last = now
        if self._expected is not None:
            done = sum(s.frames for s in self._summaries)
            total = max(self._expected, done)
            self._ctx.progress(total if final else done, total)
            return
        covered = sum(s.last_t - s.start_s for s in self._summaries)
        self._ctx.progress(self._seconds if final else min(self._seconds, covered),
                           self._seconds)


class _Summary:
    """What one file's sampled frames came to."""

    def __init__(self, name: str, url: str, start_s: float, end_s: float | None,
                 fps: float | None, duration_s: float) -> None:
        self.url, self.start_s, self.end_s, self.fps = url, start_s, end_s, fps
        self.duration_s = duration_s
        self.name = name
        self.frames = 0
        self.scores: list[float] = []
        self.first_t: float | None = None
        self.last_t = start_s
        self.counts: Counter[str] = Counter()
        self.decoder = "cpu"

    def add(self, times: list[float], labels: list[int], scores: list[float],
            names: Sequence[str] | None) -> list[dict[str, Any]]:
        rows = [{"file": self.name, "t_s": round(t, 6), "label": names[i] if names else str(i),
                 "score": s} for t, i, s in zip(times, labels, scores, strict=True)]
        for row in rows:
            self.add_row(row)
        return rows

    def add_row(self, row: dict[str, Any]) -> None:
        self.counts[row["label"]] += 1
        self.frames += 1
        self.scores.append(row["score"])
        if self.first_t is None:
            self.first_t = row["t_s"]
        self.last_t = row["t_s"]

    def as_dict(self) -> dict[str, Any]:
        times = ((self.first_t, self.last_t) if self.first_t is not None else None)
        return summary_of(self.name, self.counts, self.frames, self.scores, times) | {
            "path": self.url, "start_s": self.start_s, "end_s": self.end_s,
            "duration_s": round(self.duration_s, 6), "fps": self.fps, "decoder": self.decoder}


def summary_of(name: str, counts: Counter[str], frames: int, score_parts: list[float],
               times: tuple[float, float] | None = None) -> dict[str, Any]:
    """A file's frames, class counts and mean score, its first and last frame's time, and
    `score_sum_parts`: its scores' sum, exactly, as a few floats (`exact_parts`).

    `score_parts` are the scores, or any floats whose exact sum is theirs (the parts of the
    chunks of a file): the mean is `math.fsum` of them over `frames`, the correctly rounded
    exact sum, so it does not depend on how the frames were batched or chunked, and a merge
    reads the parts instead of every row's score."""
    return {"file": name, "frames": frames, "class_counts": dict(sorted(counts.items())),
            "mean_score": math.fsum(score_parts) / frames if frames else None,
            "first_t_s": times[0] if times else None, "last_t_s": times[1] if times else None,
            "score_sum_parts": exact_parts(score_parts)}


def exact_parts(values: Iterable[float]) -> list[float]:
    """Non-overlapping floats whose exact sum is the exact sum of `values` (finite ones),
    smallest first: Shewchuk's partials, the ones `math.fsum` keeps. `math.fsum` of them (or
    of the parts of several lists of values together) is `math.fsum` of the values."""
    partials: list[float] = []
    for x in values:
        i = 0
        for y in partials:
            if abs(x) < abs(y):
                x, y = y, x
            hi = x + y
            lo = y - (hi - x)
            if lo:
                partials[i] = lo
                i += 1
            x = hi
        partials[i:] = [x]
    return [p for p in partials if p] or [0.0]
