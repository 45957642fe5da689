"""A footage chunk over a remote video reads byte ranges of it, not the object
(`e31_worker.workloads.video`): on a real S3 server (moto, recording every request's Range)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.integration.conftest import S3Server

pytest.importorskip("av")
video = pytest.importorskip("e31_worker.workloads.video")


def bytes_asked(s3: S3Server, key: str) -> int:
    """The bytes the GETs of `key` since the last take asked for (a GET without a Range:
    the whole object, counted as a huge number)."""
    total = 0
    for request in s3.take():
        if request.method != "GET" or request.key != key:
            continue
        found = re.fullmatch(r"bytes=(\d+)-(\d+)", request.range or "")
        total += int(found[2]) - int(found[1]) + 1 if found else 1 << 40
    return total


def noise_clip(path: Path, seconds: int, fps: int) -> Path:
    """A clip of random frames: as many bytes a second as real footage has, unlike
    `render_test_video`'s few (whose file is then mostly the container's fixed reads)."""
    import av
    import numpy
    rng = numpy.random.default_rng(18)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 160, 120, "yuv420p"
        for _ in range(seconds * fps):
            image = rng.integers(0, 256, (120, 160, 3), dtype=numpy.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(stream.encode())
    return path


@pytest.fixture
def remote_clip(s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, int]:
    """A 30 s clip in the bucket, and fsspec pointed at the server for s3:// URLs."""
    import fsspec
    clip = noise_clip(tmp_path / "cam.mp4", seconds=30, fps=5)
    key = f"footage-{tmp_path.name}/cam.mp4"
    s3.client().put_object(Bucket=s3.bucket, Key=key, Body=clip.read_bytes())
    monkeypatch.setitem(fsspec.config.conf, "s3", {**s3.options, "skip_instance_cache": True})
    return key, clip.stat().st_size


@pytest.mark.parametrize("block_bytes, most", [(16 * 1024, 0.5), (1 << 30, None)])
def test_a_chunk_of_a_remote_video_asks_only_for_ranges_around_its_span(
        s3: S3Server, remote_clip: tuple[str, int], monkeypatch: pytest.MonkeyPatch,
        block_bytes: int, most: float | None) -> None:
    # Given a 30 s clip in S3, read in blocks of `block_bytes`
    key, size = remote_clip
    monkeypatch.setattr(video, "REMOTE_BLOCK_BYTES", block_bytes)
    s3.take()

    # When a chunk decodes seconds [20, 25) of it at 1 frame a second
    frames = list(video.sampled_frames(f"s3://{s3.bucket}/{key}", fps=1, start_s=20,
                                       end_s=25, size=(64, 48)))

    # Then it got its 5 frames, asking for under half the object (the index and the span);
    # with one block larger than the file (the control) it fetched all of it
    assert [t for t, _ in frames] == pytest.approx([20, 21, 22, 23, 24])
    asked = bytes_asked(s3, key)
    if most is not None:
        assert 0 < asked < most * size, (asked, size)
    else:
        assert asked >= size, (asked, size)
