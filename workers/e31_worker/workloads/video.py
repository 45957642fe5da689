"""Video files with PyAV: a rendered test clip, durations, and frames sampled at a rate.

Which frames a span keeps is `e31.core.footage.Sampler`'s rule (shared with the planner). On a
GPU, `open_decoder` asks PyAV for NVDEC (`hwaccel` cuda) and falls back to the CPU where the
build or the driver cannot; the decoder used is reported (`decoder`: "cpu" or "cuda").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import av
import fsspec
import numpy

from e31.core.footage import (
    IMAGE_SUFFIXES,
    SEEK_MARGIN_S,
    TIME_EPS_S,
    VIDEO_SUFFIXES,
    Sampler,
    is_image,
)

__all__ = ["IMAGE_SUFFIXES", "TIME_EPS_S", "VIDEO_SUFFIXES", "image_frame", "list_videos",
           "render_test_video", "sampled_frames", "video_duration_s"]

TEST_COLOURS = ((255, 0, 0), (0, 255, 0), (0, 0, 255))  # red, green, blue: one per second
# A remote video is read in ranged requests of this size (fsspec's `block_size`; s3fs's own
# default is 50 MiB, which would fetch all of a smaller file for every chunk of it): about a
# second of 30 Mbit/s footage, a few requests a chunk's decode asks for beyond what it needs.
REMOTE_BLOCK_BYTES = 4 * 1024 * 1024


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
    """The video and image files under `path` (itself when it is a file), in sorted order."""
    fs, root = fsspec.core.url_to_fs(path)
    if not fs.isdir(root):
        return [path]
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    found = sorted(p for p in fs.find(root) if p.lower().endswith(VIDEO_SUFFIXES + IMAGE_SUFFIXES))
    return found if protocol in ("file", "local") else [f"{protocol}://{p}" for p in found]


def _open(url: str, stack: ExitStack, hwaccel: Any = None) -> Any:
    """A PyAV container for a local path or any fsspec URL."""
    fs, local = fsspec.core.url_to_fs(url)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    source: Any = (local if protocol in ("file", "local") else
                   stack.enter_context(fs.open(local, "rb", block_size=REMOTE_BLOCK_BYTES)))
    if hwaccel is not None:
        try:
            return stack.enter_context(av.open(source, hwaccel=hwaccel))
        except av.error.FFmpegError:  # no such device, or the driver refuses: the CPU decodes
            if not isinstance(source, str):
                source.seek(0)
    return stack.enter_context(av.open(source))


def cuda_decoder() -> Any:
    """PyAV's NVDEC acceleration, or None where this PyAV build has no CUDA device type."""
    try:
        from av.codec.hwaccel import HWAccel, hwdevices_available
    except ImportError:
        return None
    if "cuda" not in hwdevices_available():
        return None
    return HWAccel(device_type="cuda", allow_software_fallback=True)


def image_frame(url: str, size: tuple[int, int] | None = None) -> numpy.ndarray:
    """An image file (any format FFmpeg reads) as RGB uint8 [H, W, 3], resized to `size`."""
    width, height = size if size else (None, None)
    with ExitStack() as stack:
        container = _open(url, stack)
        frame = next(container.decode(video=0))
        return frame.to_ndarray(format="rgb24", width=width, height=height)


def video_duration_s(url: str) -> float:
    """The duration of the first video stream (else of the container), in seconds; 0 for
    an image."""
    if is_image(url):
        return 0.0
    with ExitStack() as stack:
        container = _open(url, stack)
        stream = container.streams.video[0]
        if stream.duration is not None and stream.time_base is not None:
            return float(stream.duration * stream.time_base)
        if container.duration is not None:
            return float(container.duration / av.time_base)
    raise ValueError(f"{url}: the duration is unknown")


def sampled_frames(url: str, *, fps: float | None, start_s: float = 0.0,
                   end_s: float | None = None, size: tuple[int, int] | None = None,
                   after_s: float | None = None, hwaccel: Any = None,
                   used: list[str] | None = None,
                   threads: int = 1) -> Iterator[tuple[float, numpy.ndarray]]:
    """(time in s, RGB uint8 [H, W, 3]) of the frames in [start_s, end_s), one per 1/fps s
    (every frame when `fps` is None), on a grid anchored at 0 s: the chunks of a file yield
    exactly the frames the whole file does. `after_s`: only those after a frame already
    taken at that time (a resumed chunk). Frames are resized while converted (`size`).
    `used` gets "cuda" appended when the GPU decoded them, "cpu" otherwise. `threads`: the
    CPU decoder's threads (FFmpeg frame and slice threads when more than one), and the
    resize's (libswscale); 0 lets FFmpeg choose (one per core it may run on). FFmpeg's own
    choice costs a frame of 320x240 nearly four times one thread's time on 2 free cores:
    libswscale splits each small frame across threads (docs/performance.md, "Footage")."""
    width, height = size if size else (None, None)
    sampler = Sampler(fps, start_s, end_s, after_s)
    with ExitStack() as stack:
        container = _open(url, stack, hwaccel)
        stream = container.streams.video[0]
        if threads != 1:
            stream.thread_type = "AUTO"
            stream.codec_context.thread_count = threads   # 0: FFmpeg's own count
        else:
            stream.codec_context.thread_count = 1
        if used is not None:
            used.append("cuda" if hwaccel is not None and stream.codec_context.is_hwaccel
                        else "cpu")
        seek_s = max(start_s, after_s or 0.0) - SEEK_MARGIN_S
        if seek_s > 0:  # lands on the keyframe before seek_s; the sampler drops earlier frames
            container.seek(int(seek_s / stream.time_base), stream=stream)
        for frame in container.decode(stream):
            t = frame.time
            if t is None:
                continue
            if sampler.past_end(t):
                break
            if sampler.keep(t):
                yield float(t), frame.to_ndarray(format="rgb24", width=width, height=height,
                                                 threads=threads)
