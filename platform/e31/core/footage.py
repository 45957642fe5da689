"""Footage, the shared part: which files are media, how a video is cut into chunks, and
which frames a span keeps.

The planner (`e31.ops.fanout`), the footage workload and the tests share this one
definition: chunks are half-open `[start_s, end_s)`, and frames are sampled on a grid anchored
at 0 s (`Sampler`), so the chunks of a file select exactly the frames the whole file does, none
missing and none twice at a border (docs/workloads.md, "Forty hours of footage"). Listing and
probing import fsspec and PyAV lazily: only a process that plans or decodes needs them.
"""

from __future__ import annotations

import math
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

VIDEO_SUFFIXES = (".mp4", ".mkv", ".mov", ".avi", ".webm", ".m4v")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
TIME_EPS_S = 1e-6          # frame times are floats: compare with this slack
# A span's decode starts this far before it, so that the frame before its first is seen
# (`Sampler` compares the two); more than any frame interval, little next to a chunk.
SEEK_MARGIN_S = 1.0
# A remote video is probed in ranged reads of this size (fsspec's `block_size`; s3fs's own
# default of 50 MiB would fetch the whole of most files just to read a header).
PROBE_BLOCK_BYTES = 1024 * 1024
CHUNKS_INPUT = "chunks"    # the merge job's input: every item's outputs, by item index


def is_image(url: str) -> bool:
    return url.lower().endswith(IMAGE_SUFFIXES)


def is_media(url: str) -> bool:
    return url.lower().endswith(VIDEO_SUFFIXES + IMAGE_SUFFIXES)


def list_media(path: str, suffixes: tuple[str, ...] = VIDEO_SUFFIXES + IMAGE_SUFFIXES
               ) -> list[str]:
    """The media files under `path` (a local path or an fsspec URL; itself when it is a
    file), sorted, as URLs of the same kind as `path`."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(path)
    if not fs.isdir(root):
        return [path]
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    found = sorted(p for p in fs.find(root) if p.lower().endswith(suffixes)
                   and not posixpath.basename(p).startswith("."))
    return found if protocol in ("file", "local") else [f"{protocol}://{p}" for p in found]


def probe_duration_s(url: str) -> float:
    """The duration of the first video stream (else of the container), in seconds (PyAV)."""
    import av
    import fsspec

    fs, local = fsspec.core.url_to_fs(url)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    source: Any = (local if protocol in ("file", "local")
                   else fs.open(local, "rb", block_size=PROBE_BLOCK_BYTES))
    try:
        with av.open(source) as container:
            stream = container.streams.video[0]
            if stream.duration is not None and stream.time_base is not None:
                return float(stream.duration * stream.time_base)
            if container.duration is not None:
                return float(container.duration / av.time_base)
    finally:
        if not isinstance(source, str):
            source.close()
    raise ValueError(f"{url}: the duration is unknown")


def chunk_bounds(duration_s: float, chunk_s: float | None) -> list[tuple[float, float]]:
    """Half-open `[start_s, end_s)` spans of `chunk_s` covering `[0, duration_s)` (one span
    when `chunk_s` is None or covers the whole)."""
    n = max(1, math.ceil(duration_s / chunk_s - 1e-9)) if chunk_s else 1
    step = chunk_s if chunk_s else duration_s
    return [(round(i * step, 6), round(min((i + 1) * step, duration_s), 6)) for i in range(n)]


def plan_chunks(paths: str | Sequence[str], chunk_s: float | None = None, *,
                durations: Mapping[str, float] | None = None,
                **params: Any) -> list[dict[str, Any]]:
    """The params of one footage job per file, or per `chunk_s` seconds of each file.

    Each item is `{"path", "start_s", "end_s", **params}`; chunks are half-open, so their
    frames add up to the whole file's. Pure when `durations` (path -> seconds) covers every
    file; otherwise the missing durations are read from the files. A directory stands for
    the videos in it.
    """
    files = [f for p in ([paths] if isinstance(paths, str) else paths)
             for f in list_media(p, VIDEO_SUFFIXES)]
    items: list[dict[str, Any]] = []
    for f in files:
        duration = (durations or {}).get(f)
        if duration is None:
            duration = probe_duration_s(f)
        items += [{**params, "path": f, "start_s": start, "end_s": end}
                  for start, end in chunk_bounds(duration, chunk_s)]
    return items


def frames_in(start_s: float, end_s: float, fps: float) -> int:
    """How many points of the `fps` grid (k / fps) lie in `[start_s, end_s)`: the frames a
    chunk samples when the video has a frame at every grid point."""
    return max(0, math.ceil(end_s * fps - TIME_EPS_S) - math.ceil(start_s * fps - TIME_EPS_S))


class Sampler:
    """Which decoded frames a span `[start_s, end_s)` keeps at `fps` (None: every frame).

    A frame is kept when a point of the `fps` grid (k / fps, anchored at 0 s) lies after the
    frame decoded before it and at or before it: the first frame at or after each grid
    point. The rule reads only the frame and the one before it, so each frame is kept or not
    whatever span decodes it: the chunks of a file keep exactly the frames the whole file
    keeps, and a chunk resumed `after_s` a kept frame keeps what it would have kept. Feed it
    every decoded frame in order, from before `start_s` (decode from a seek point before it:
    `SEEK_MARGIN_S`); the first frame of a file is always a grid frame (k = 0).
    """

    def __init__(self, fps: float | None, start_s: float = 0.0, end_s: float | None = None,
                 after_s: float | None = None) -> None:
        self.fps, self.start_s, self.end_s = fps, start_s, end_s
        self.after_s = after_s
        self._prev: float | None = None

    def past_end(self, t: float) -> bool:
        """Whether `t` (and every later frame) is beyond the span."""
        return self.end_s is not None and t >= self.end_s - TIME_EPS_S

    def keep(self, t: float) -> bool:
        """Whether the frame at `t` (the next decoded one, before `past_end`) is kept."""
        prev, self._prev = self._prev, t
        if t < self.start_s - TIME_EPS_S:
            return False
        if self.after_s is not None and t <= self.after_s + TIME_EPS_S:
            return False
        if not self.fps or prev is None:
            return True
        return math.floor(t * self.fps + TIME_EPS_S) > math.floor(prev * self.fps + TIME_EPS_S)


def decode_threads_ok(value: object) -> bool:
    """A footage job's `decode_threads`: a whole number of threads, 0 (FFmpeg's own count) or
    more; checked at submit (here) and by the workload itself."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
