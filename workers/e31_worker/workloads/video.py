"""Video files with PyAV: a rendered test clip, durations, and frames sampled at a rate."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import av
import fsspec
import numpy

VIDEO_SUFFIXES = (".mp4", ".mkv", ".mov", ".avi", ".webm", ".m4v")
TIME_EPS_S = 1e-6          # frame times are floats: compare with this slack
TEST_COLOURS = ((255, 0, 0), (0, 255, 0), (0, 0, 255))  # red, green, blue: one per second


def render_test_video(path: str | Path, seconds: float = 3.0, fps: int = 10,
                      size: tuple[int, int] = (64, 48)) -> Path:
    """Render a clip of a square moving over black, red in second 0, green in 1, blue in 2,
    then again: `frame_classifier` labels its frames exactly that way. MPEG-4 in `.mp4`."""
    width, height = size
    side = height // 2
    frames = round(seconds * fps)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            image = numpy.zeros((height, width, 3), dtype=numpy.uint8)
            x = (i * 2) % max(1, width - side)
            image[height // 4:height // 4 + side, x:x + side] = TEST_COLOURS[(i // fps) % 3]
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return Path(path)


def list_videos(path: str) -> list[str]:
    """The video files under `path` (itself when it is a file), in sorted order."""
    fs, root = fsspec.core.url_to_fs(path)
    if not fs.isdir(root):
        return [path]
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    found = sorted(p for p in fs.find(root) if p.lower().endswith(VIDEO_SUFFIXES))
    return found if protocol in ("file", "local") else [f"{protocol}://{p}" for p in found]


def _open(url: str, stack: ExitStack) -> Any:
    """A PyAV container for a local path or any fsspec URL."""
    fs, local = fsspec.core.url_to_fs(url)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    source: Any = (local if protocol in ("file", "local")
                   else stack.enter_context(fs.open(local, "rb")))
    return stack.enter_context(av.open(source))


def video_duration_s(url: str) -> float:
    """The duration of the first video stream (else of the container), in seconds."""
    with ExitStack() as stack:
        container = _open(url, stack)
        stream = container.streams.video[0]
        if stream.duration is not None and stream.time_base is not None:
            return float(stream.duration * stream.time_base)
        if container.duration is not None:
            return float(container.duration / av.time_base)
    raise ValueError(f"{url}: the duration is unknown")


def sampled_frames(url: str, *, fps: float | None, start_s: float = 0.0,
                   end_s: float | None = None,
                   size: tuple[int, int] | None = None) -> Iterator[tuple[float, numpy.ndarray]]:
    """(time in s, RGB uint8 [H, W, 3]) of the frames in [start_s, end_s), one per 1/fps s
    (every frame when `fps` is None), on a grid anchored at 0 s: the chunks of a file yield
    exactly the frames the whole file does."""
    width, height = size if size else (None, None)
    with ExitStack() as stack:
        container = _open(url, stack)
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        if start_s > 0:  # lands on the keyframe before start_s; earlier frames are dropped
            container.seek(int(start_s / stream.time_base), stream=stream)
        next_k = math.ceil(start_s * fps - TIME_EPS_S) if fps else 0
        for frame in container.decode(stream):
            t = frame.time
            if t is None or t < start_s - TIME_EPS_S:
                continue
            if end_s is not None and t >= end_s - TIME_EPS_S:
                break
            if fps:
                if t + TIME_EPS_S < next_k / fps:
                    continue
                next_k = math.floor(t * fps + TIME_EPS_S) + 1
            yield float(t), frame.to_ndarray(format="rgb24", width=width, height=height)

