"""The footage fan-out's planning, pure: chunk borders, sampling, resume points, sources."""

from __future__ import annotations

import bisect
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from e31.core.errors import SpecError, SpecForbidden
from e31.core.footage import SEEK_MARGIN_S, Sampler, chunk_bounds, frames_in
from e31.ops.fanout import plan


def kept(times: list[float], fps: float | None, start: float, end: float | None,
         after: float | None = None) -> list[float]:
    """The frame times a span keeps, as `sampled_frames` walks decoded frames: from the
    latest point its seek may land on (`SEEK_MARGIN_S` before the span or the resume)."""
    sampler = Sampler(fps, start, end, after)
    seek = max(start, after or 0.0) - SEEK_MARGIN_S
    out = []
    for t in times[bisect.bisect_left(times, seek) if seek > 0 else 0:]:
        if sampler.past_end(t):
            break
        if sampler.keep(t):
            out.append(t)
    return out


clips = st.tuples(
    st.floats(min_value=0.1, max_value=120.0),                     # duration in s
    st.sampled_from([5.0, 10.0, 24.0, 25.0, 29.97, 30.0, 60.0]),  # the video's frame rate
    st.floats(min_value=0.05, max_value=50.0),                     # chunk_s
    st.one_of(st.none(), st.floats(min_value=0.1, max_value=40.0)))   # sampling fps


@settings(max_examples=200, deadline=None)
@given(clips)
def test_chunks_keep_every_frame_of_the_whole_file_once_in_order(clip: tuple) -> None:
    # Given a video's frame times and its chunks
    duration, rate, chunk_s, fps = clip
    times = [k / rate for k in range(int(duration * rate))]
    spans = chunk_bounds(duration, chunk_s)

    # When each chunk keeps its frames
    joined = [t for start, end in spans for t in kept(times, fps, start, end)]

    # Then together they are exactly the whole file's frames: none missing, none twice
    assert joined == kept(times, fps, 0.0, duration)
    assert spans[0][0] == 0.0 and spans[-1][1] == pytest.approx(duration, abs=1e-6)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))


@settings(max_examples=200, deadline=None)
@given(clips, st.data())
def test_a_chunk_resumed_after_any_kept_frame_keeps_what_the_uninterrupted_one_kept(
        clip: tuple, data: st.DataObject) -> None:
    # Given a chunk's frames and any frame it committed before it was killed
    duration, rate, chunk_s, fps = clip
    times = [k / rate for k in range(int(duration * rate))]
    start, end = data.draw(st.sampled_from(chunk_bounds(duration, chunk_s)))
    whole = kept(times, fps, start, end)
    if not whole:
        return
    cut = data.draw(st.integers(min_value=0, max_value=len(whole) - 1))

    # When it resumes after that frame
    rest = kept(times, fps, start, end, after=whole[cut])

    # Then the committed frames and the resumed ones are the uninterrupted chunk's
    assert whole[:cut + 1] + rest == whole


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=0, max_value=1000), st.floats(min_value=1.0, max_value=100),
       st.floats(min_value=0.1, max_value=60))
def test_planned_frame_counts_add_up_to_the_whole_file(duration: float, chunk_s: float,
                                                       fps: float) -> None:
    spans = chunk_bounds(duration, chunk_s)
    assert sum(frames_in(a, b, fps) for a, b in spans) == frames_in(0.0, spans[-1][1], fps)


def test_a_source_outside_input_file_roots_is_forbidden_and_the_same_one_inside_plans(
        tmp_path: Path) -> None:
    # Given a video under a directory, and a probe that knows its length
    (tmp_path / "cams").mkdir()
    (tmp_path / "cams" / "a.mp4").write_bytes(b"")
    probe = {f"file://{tmp_path}/cams/a.mp4": 25.0}.__getitem__

    # When it is planned with the pool's roots elsewhere, then with its own directory
    with pytest.raises(SpecForbidden) as refused:
        plan({"source": str(tmp_path / "cams")}, roots=("/srv/footage",), probe=probe)
    planned = plan({"source": str(tmp_path / "cams"), "chunk_s": 10, "fps": 2},
                   roots=(str(tmp_path),), probe=probe)

    # Then outside is refused naming the field, inside gives 3 chunks staged as inputs
    assert refused.value.errors[0]["field"] == "params.source"
    assert [(i["params"]["start_s"], i["params"]["end_s"]) for i in planned.items] == [
        (0.0, 10.0), (10.0, 20.0), (20.0, 25.0)]
    assert all(i["inputs"] == {"m00.mp4": f"file://{tmp_path}/cams/a.mp4"} for i in planned.items)
    assert [i["params"]["expected_frames"] for i in planned.items] == [20, 20, 10]
    assert planned.merge["params"]["total_frames"] == 50
    assert planned.files[0]["items"] == [0, 1, 2] and planned.files[0]["name"] == "a.mp4"


def test_a_link_out_of_the_roots_is_forbidden(tmp_path: Path) -> None:
    # Given a link beneath the roots to a directory outside them
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "b.mp4").write_bytes(b"")
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "link").symlink_to(outside)

    # Then planning it is refused
    with pytest.raises(SpecForbidden):
        plan({"source": str(tmp_path / "root" / "link")}, roots=(str(tmp_path / "root"),),
             probe=lambda url: 1.0)


def test_images_go_in_groups_through_the_same_fan_out(tmp_path: Path) -> None:
    for i in range(5):
        (tmp_path / f"{i}.png").write_bytes(b"")
    planned = plan({"source": str(tmp_path), "chunk_images": 2}, roots=(str(tmp_path),),
                   probe=lambda url: pytest.fail("an image is not probed"))
    assert [i["params"]["names"] for i in planned.items] == [["0.png", "1.png"],
                                                            ["2.png", "3.png"], ["4.png"]]
    assert [f["kind"] for f in planned.files] == ["image"] * 5


@pytest.mark.parametrize("params,field", [
    ({"source": []}, "params.source"),
    ({"source": "relative/dir"}, "params.source"),
    ({"source": "/x", "chunk_s": 0}, "params.chunk_s"),
    ({"source": "/x", "fps": -1}, "params.fps"),
    ({"source": "/x", "path": "a.mp4"}, "params.path"),
    ({"source": "/x", "decode_threads": -1}, "params.decode_threads"),
    ({"source": "/x", "decode_threads": 1.5}, "params.decode_threads"),
])
def test_bad_fan_out_params_are_refused_naming_the_field(params: dict, field: str) -> None:
    with pytest.raises(SpecError) as refused:
        plan(params, roots=("/",), probe=lambda url: 1.0)
    assert refused.value.errors[0]["field"] == field


def test_videos_are_probed_at_once_and_the_first_unreadable_in_source_order_is_named(
        tmp_path: Path) -> None:
    # Given four videos and a probe that returns only once two probes wait together
    for name in ("a.mp4", "b.mp4", "c.mp4", "d.mp4"):
        (tmp_path / name).write_bytes(b"")
    together = threading.Barrier(2, timeout=10)

    def probe(url: str) -> float:
        together.wait()   # one probe at a time would break the barrier: "cannot read"
        if url.endswith(("b.mp4", "d.mp4")):
            raise ValueError("moov atom not found")
        return 5.0

    # When the directory is planned
    with pytest.raises(SpecError) as refused:
        plan({"source": str(tmp_path)}, roots=(str(tmp_path),), probe=probe)

    # Then the probes overlapped, and the error names b.mp4, the first in source order
    assert refused.value.errors == [{"field": "params.source",
                                     "reason": "cannot read b.mp4: moov atom not found"}]


@pytest.mark.parametrize("source", ["http://127.0.0.1:9/clips/", "http://localhost:9/a.mp4",
                                    "https://169.254.169.254/latest/a.mp4",
                                    "http://[::1]:9/a.mp4"])
def test_the_api_reads_no_source_on_the_pools_own_addresses(source: str) -> None:
    # Given a footage source on this machine's loopback or the metadata address
    # When the API plans its fan-out (which lists and probes the files itself)
    with pytest.raises(SpecForbidden) as refused:
        plan({"source": source}, roots=[])

    # Then it is refused before anything is read, naming the field and why
    assert refused.value.errors[0]["field"] == "params.source"
    assert "refused" in refused.value.errors[0]["reason"]
    assert "input_allowed_networks" in refused.value.errors[0]["reason"]


def test_a_source_on_a_network_the_operator_allows_is_read() -> None:
    # Given the same loopback source, its network allowed by the operator
    # When the API plans it: it tries to list it (nothing listens on port 9: it cannot)
    with pytest.raises(SpecError) as failed:
        plan({"source": "http://127.0.0.1:9/a.mp4"}, roots=[], allowed=["127.0.0.0/8"])

    # Then the address was not what stopped it
    assert "refused" not in failed.value.errors[0]["reason"]
