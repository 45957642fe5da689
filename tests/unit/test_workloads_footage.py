"""Footage in-process on CPU over a clip the test renders: sampling, chunks, summaries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("av")

from e31_worker.workloads import footage
from tests.unit.workload_context import make_ctx, one_torch_thread  # noqa: F401 (autouse)

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 s at 10 fps: red in second 0, green in 1, blue in 2."""
    return footage.render_test_video(tmp_path_factory.mktemp("video") / "clip.mp4", seconds=3,
                                     fps=10)


def test_frames_sampled_at_2_fps_are_labelled_by_colour_with_a_summary(clip: Path,
                                                                       tmp_path: Path) -> None:
    # Given the rendered clip
    ctx = make_ctx(tmp_path)

    # When the footage workload samples 2 frames a second, resized, in batches of 4
    result = footage.run(ctx, path=str(clip), fps=2, size=[32, 24], batch_size=4)

    # Then each second gives two frames of its colour
    lines = (ctx.output_dir / "frames.jsonl").read_text().splitlines()
    frames = [json.loads(line) for line in lines]
    assert [(f["t_s"], f["label"]) for f in frames] == [
        (0.0, "red"), (0.5, "red"), (1.0, "green"), (1.5, "green"), (2.0, "blue"), (2.5, "blue")]
    [summary] = json.loads((ctx.output_dir / "summary.json").read_text())["files"]
    assert summary["file"] == "clip.mp4" and summary["frames"] == 6
    assert summary["duration_s"] == pytest.approx(3.0)
    assert summary["class_counts"] == {"blue": 2, "green": 2, "red": 2}
    assert 0.5 < summary["mean_score"] <= 1
    assert result["frames"] == 6 and result["class_counts"] == summary["class_counts"]


def test_chunks_planned_from_a_file_cover_exactly_the_frames_of_the_whole_file(
        clip: Path, tmp_path: Path) -> None:
    # Given the whole-file result at 5 fps
    whole = footage.run(make_ctx(tmp_path / "whole"), path=str(clip), fps=5)

    # When the file is planned in 1.2 s chunks and each chunk runs as its own job
    items = footage.plan_chunks([str(clip)], chunk_s=1.2, fps=5)
    parts = [footage.run(make_ctx(tmp_path / f"part{i}"), **item) for i, item in enumerate(items)]

    # Then three half-open chunks add up to the same frames and classes
    assert [(i["start_s"], i["end_s"]) for i in items] == [(0.0, 1.2), (1.2, 2.4), (2.4, 3.0)]
    assert all(i["fps"] == 5 for i in items)
    assert sum(p["frames"] for p in parts) == whole["frames"] == 15
    assert {"red": 5, "green": 5, "blue": 5} == whole["class_counts"]


def test_planning_with_known_durations_reads_no_file() -> None:
    # Given durations for two files that do not exist
    durations = {"a.mp4": 10.0, "b.mp4": 4.0}

    # When they are planned in 5 s chunks, and whole
    chunked = footage.plan_chunks(["a.mp4", "b.mp4"], 5.0, durations=durations, fps=1)
    whole = footage.plan_chunks(["a.mp4", "b.mp4"], durations=durations)

    # Then a gives two chunks and b one, each with the common params
    assert chunked == [{"fps": 1, "path": "a.mp4", "start_s": 0.0, "end_s": 5.0},
                       {"fps": 1, "path": "a.mp4", "start_s": 5.0, "end_s": 10.0},
                       {"fps": 1, "path": "b.mp4", "start_s": 0.0, "end_s": 4.0}]
    assert [(w["path"], w["end_s"]) for w in whole] == [("a.mp4", 10.0), ("b.mp4", 4.0)]
