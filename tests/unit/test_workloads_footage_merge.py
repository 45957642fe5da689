"""The footage merge in-process: chunk jobs' outputs of a rendered clip joined into what one
job over the whole clip writes, and the exact score sums that let it skip parsing rows."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("av")

from e31.core.footage import CHUNKS_INPUT
from e31_worker.workloads import footage
from e31_worker.workloads.footage import exact_parts
from e31_worker.workloads.footage_merge import ITEM_DIR, merge
from tests.unit.workload_context import make_ctx, one_torch_thread  # noqa: F401 (autouse)

FPS = 5


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 s at 10 fps: red, green, blue seconds."""
    return footage.render_test_video(tmp_path_factory.mktemp("video") / "clip.mp4", seconds=3,
                                     fps=10)


@pytest.fixture(scope="module")
def whole(clip: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One job over the whole clip: what the merge must reproduce."""
    ctx = make_ctx(tmp_path_factory.mktemp("whole"))
    footage.run(ctx, path=str(clip), fps=FPS)
    return ctx.output_dir


@pytest.fixture(scope="module")
def chunks(clip: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The clip in three chunk jobs of 1.2 s, each on its own directories."""
    root = tmp_path_factory.mktemp("chunks")
    items = footage.plan_chunks([str(clip)], chunk_s=1.2, fps=FPS)
    outs = []
    for i, item in enumerate(items):
        ctx = make_ctx(root / str(i))
        footage.run(ctx, **item)
        outs.append(ctx.output_dir)
    return outs


def run_merge(tmp_path: Path, chunk_dirs: list[Path], edit: Any = None) -> tuple[Path, Any]:
    """Stage `chunk_dirs` as the worker stages an array's outputs, let `edit(staged)` change
    them, merge; returns the merge's outputs and its result."""
    ctx = make_ctx(tmp_path)
    staged = [ctx.input_dir / CHUNKS_INPUT / ITEM_DIR.format(i) for i in range(len(chunk_dirs))]
    for src, dst in zip(chunk_dirs, staged, strict=True):
        shutil.copytree(src, dst)
    if edit is not None:
        edit(staged)
    files = [{"name": "clip.mp4", "kind": "video", "url": "file:///clip.mp4", "duration_s": 3.0,
              "items": list(range(len(chunk_dirs)))}]
    return ctx.output_dir, merge(ctx, files=files, total_frames=15, fps=FPS)


def summary(path: Path) -> dict[str, Any]:
    [file] = json.loads((path / "summary.json").read_text())["files"]
    return dict(file)


def test_merged_chunks_are_the_whole_clip_byte_for_byte_with_the_same_exact_mean(
        whole: Path, chunks: list[Path], tmp_path: Path) -> None:
    # When the three chunks are merged
    out, result = run_merge(tmp_path, chunks)

    # Then the rows are the single job's, byte for byte, here and in the video's own file
    assert (out / "frames.jsonl").read_bytes() == (whole / "frames.jsonl").read_bytes()
    assert (out / "videos" / "clip.mp4" / "frames.jsonl").read_bytes() == \
        (whole / "frames.jsonl").read_bytes()
    # And the summary's counts, times and mean are the single job's, the mean to the bit
    one, merged = summary(whole), summary(out)
    for key in ("frames", "class_counts", "mean_score", "first_t_s", "last_t_s"):
        assert merged[key] == one[key], key
    assert math.fsum(merged["score_sum_parts"]) == math.fsum(one["score_sum_parts"])
    assert result["frames"] == 15 and merged["chunks"] == 3


def test_chunks_without_score_parts_are_read_row_by_row_to_the_same_result(
        whole: Path, chunks: list[Path], tmp_path: Path) -> None:
    # Given chunk summaries as an older worker wrote them: no parts, no times
    def older(staged: list[Path]) -> None:
        for chunk in staged:
            data = json.loads((chunk / "summary.json").read_text())
            for f in data["files"]:
                for key in ("score_sum_parts", "first_t_s", "last_t_s"):
                    del f[key]
            (chunk / "summary.json").write_text(json.dumps(data))

    # When they are merged
    out, _ = run_merge(tmp_path, chunks, older)

    # Then the result is the same
    assert (out / "frames.jsonl").read_bytes() == (whole / "frames.jsonl").read_bytes()
    assert summary(out)["mean_score"] == summary(whole)["mean_score"]


def test_a_chunk_repeated_at_a_border_is_refused(chunks: list[Path], tmp_path: Path) -> None:
    # Given the first chunk's rows where the second chunk's should be
    with pytest.raises(ValueError, match="overlap or are out of order"):
        run_merge(tmp_path, [chunks[0], chunks[0], chunks[2]])


def test_a_chunk_missing_a_row_is_refused(chunks: list[Path], tmp_path: Path) -> None:
    # Given a chunk whose frames.jsonl lost its last row
    def truncate(staged: list[Path]) -> None:
        rows = (staged[1] / "frames.jsonl").read_text().splitlines(keepends=True)
        (staged[1] / "frames.jsonl").write_text("".join(rows[:-1]))

    # Then the merge says which item, and how many rows it expected
    with pytest.raises(ValueError, match=r"item 1: 6 frames of clip.mp4 in its summary, 5 rows"):
        run_merge(tmp_path, chunks, truncate)


@given(st.lists(st.floats(min_value=0.0, max_value=1.0), max_size=200),
       st.data())
def test_the_parts_of_any_split_add_up_to_the_exact_sum_of_the_whole(
        scores: list[float], data: st.DataObject) -> None:
    # Given scores split into consecutive chunks at random places
    cuts = sorted(data.draw(st.lists(st.integers(0, len(scores)), max_size=5)))
    pieces = [scores[a:b] for a, b in zip([0, *cuts], [*cuts, len(scores)], strict=True)]

    # Then fsum over the parts of every chunk is fsum over every score: the same float
    assert math.fsum(p for piece in pieces for p in exact_parts(piece)) == math.fsum(scores)
    # And the parts stay few (what a summary carries per file)
    assert len(exact_parts(scores)) <= 40
