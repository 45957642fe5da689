"""Forty hours of footage in one submit, in miniature: a directory of rendered clips fanned
out into chunk jobs and merged, through a real stack (docs/workloads.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from e31.core.errors import JobFailed

from .conftest import Stack

pytest.importorskip("torch")
pytest.importorskip("av")
pytestmark = pytest.mark.torch

WAIT_S = 180
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
CLIPS = {"a.mp4": 1, "b.mp4": 2, "c.mp4": 3}   # seconds each: 1 + 1 + 2 chunks of 2 s


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def frames(path: Path) -> list[tuple[str, float, str]]:
    return [(r["file"], r["t_s"], r["label"]) for r in rows(path)]


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from e31_worker.workloads.footage import render_test_video
    root = tmp_path_factory.mktemp("clips")
    for name, seconds in CLIPS.items():
        render_test_video(root / name, seconds=seconds, fps=10)
    return root


@pytest.fixture(scope="module")
def single(stack: Stack, clips: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The three clips through one footage job: what a fan-out must reproduce."""
    job = stack.client().submit(workload="footage", params={"path": "clips", "fps": 4},
                                inputs={"clips": str(clips)}, resources={"gpus": 0},
                                env=ONE_THREAD)
    job.wait(timeout=WAIT_S)
    out = tmp_path_factory.mktemp("single")
    job.download(out)
    return out


def test_a_directory_of_three_clips_fanned_out_and_merged_matches_one_job_frame_for_frame(
        stack: Stack, clips: Path, single: Path, tmp_path: Path) -> None:
    # When the directory is submitted as a source, in 2 s chunks
    job = stack.client().submit(workload="footage", name="yard",
                                params={"source": str(clips), "chunk_s": 2, "fps": 4},
                                resources={"gpus": 0}, env=ONE_THREAD)
    status = job.wait(timeout=WAIT_S)

    # Then the handle is the merge job's, after an array of four chunks
    [array_id] = status["after"]
    array = stack.client().get_array(array_id).status()
    assert array["total"] == 4 and array["succeeded"] == 4
    assert status["result"]["frames"] == 24 and status["result"]["chunks"] == 4
    assert status["progress"]["done"] == status["progress"]["total"]
    # And no chunk copied its video: each read it through a read-only bind of the source
    staged = [line for log in (stack.home / "logs").glob("*.log")
              for line in log.read_text().splitlines() if "input=m00.mp4" in line]
    assert len(staged) >= 4 and all("from=file-bound copied_bytes=0" in s for s in staged)
    # And its frames are the single job's, in the same order, none missing or repeated
    job.download(tmp_path)
    assert frames(tmp_path / "frames.jsonl") == frames(single / "frames.jsonl")
    one = json.loads((single / "summary.json").read_text())
    merged = json.loads((tmp_path / "summary.json").read_text())
    assert merged["class_counts"] == one["class_counts"] and merged["decoder"] == "cpu"
    # And each file's mean score is the single job's to the bit (the chunks' exact sums)
    assert [(f["file"], f["mean_score"]) for f in merged["files"]] == [
        (f["file"], f["mean_score"]) for f in one["files"]]
    for name, seconds in CLIPS.items():
        video = tmp_path / "videos" / name
        # the first of the clip's 10 frames a second at or after each quarter second
        assert [t for _, t, _ in frames(video / "frames.jsonl")] == [
            math.ceil(k * 10 / 4 - 1e-9) / 10 for k in range(seconds * 4)]
        summary = json.loads((video / "summary.json").read_text())
        assert summary["frames"] == seconds * 4 and summary["duration_s"] == pytest.approx(
            seconds)


def test_a_chunk_killed_mid_way_resumes_from_its_last_committed_frame_and_merges_the_same(
        stack: Stack, clips: Path, single: Path, tmp_path: Path) -> None:
    # Given a model whose process is SIGKILLed at its 3rd batch of 2 frames, on each chunk's
    # first attempt, with a commit every 2 frames
    params = {"source": str(clips), "chunk_s": 2, "fps": 4, "batch_size": 2,
              "checkpoint_every_frames": 2,
              "model": "footage_helpers:killed_once_frame_classifier",
              "model_kwargs": {"kill_at_call": 3}}

    # When the source is fanned out with one retry
    job = stack.client().submit(workload="footage", params=params, resources={"gpus": 0},
                                retries={"max": 1, "backoff_s": 0.2}, env=ONE_THREAD)
    status = job.wait(timeout=WAIT_S)

    # Then each chunk of 8 frames (4 batches) was killed once and resumed after 4 frames;
    # the shorter ones (a.mp4, c.mp4's last second: 4 frames, 2 batches) ran once
    manifest = stack.client().get_array(status["after"][0]).manifest()
    for item in manifest["items"]:
        attempts = stack.client().get(item["id"]).status()["attempts"]
        long = item["params"]["expected_frames"] == 8
        assert [a["reason"] for a in attempts] == (
            ["error", "succeeded"] if long else ["succeeded"]), item
        assert item["result"]["resumed_from"] == (4 if long else 0)
    assert sum(item["params"]["expected_frames"] == 8 for item in manifest["items"]) == 2
    # And the merge is still the single job's, frame for frame
    job.download(tmp_path)
    assert frames(tmp_path / "frames.jsonl") == frames(single / "frames.jsonl")


def test_an_array_with_failing_items_is_mended_with_retry_failed_and_the_merge_then_runs(
        stack: Stack, clips: Path, single: Path, shared_tmp: Path, tmp_path: Path) -> None:
    # Given chunks that fail while a file exists, and no automatic retry
    broken = shared_tmp / "broken"
    broken.write_text("")
    params = {"source": [str(clips / "a.mp4"), str(clips / "b.mp4")], "chunk_s": 2, "fps": 4,
              "model": "footage_helpers:frame_classifier_failing_while",
              "model_kwargs": {"path": str(broken)}}
    job = stack.client().submit(workload="footage", params=params, resources={"gpus": 0},
                                retries={"max": 0}, env=ONE_THREAD)

    # When the items fail, the merge waiting on them is cancelled as a dependency
    with pytest.raises(JobFailed):
        job.wait(timeout=WAIT_S)
    assert job.status()["reason"] == "dependency"
    [array_id] = job.status()["after"]
    assert stack.client().get_array(array_id).wait(timeout=WAIT_S)["failed"] == 2

    # And after the cause is mended, `e31 retry A-ID --failed` runs only the failed items
    broken.unlink()
    refused = stack.e31("retry", array_id)
    assert refused.returncode == 2 and "--failed" in refused.stderr
    done = stack.e31("retry", array_id, "--failed", "--json")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert len(answer["resubmitted"]) == 2 and answer["rearmed"] == [job.id]
    status = job.wait(timeout=WAIT_S)

    # Then the same jobs succeeded as their second attempt, and the merge ran once
    manifest = stack.client().get_array(array_id).manifest()
    assert {i["state"] for i in manifest["items"]} == {"succeeded"}
    assert sorted(i["id"] for i in manifest["items"]) == sorted(answer["resubmitted"])
    assert len(status["attempts"]) == 1 and status["state"] == "succeeded"
    job.download(tmp_path)
    assert frames(tmp_path / "frames.jsonl") == [
        f for f in frames(single / "frames.jsonl") if f[0] in ("a.mp4", "b.mp4")]
    # And a second retry finds nothing to do
    assert stack.client().get_array(array_id).retry_failed()["resubmitted"] == []


def test_images_go_through_the_same_fan_out_one_row_per_image(
        stack: Stack, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    import av
    import numpy

    # Given four images, one colour each
    root = tmp_path_factory.mktemp("images")
    colours = {"0.png": (255, 0, 0), "1.png": (0, 255, 0), "2.png": (0, 0, 255),
               "3.png": (250, 5, 5)}
    for name, rgb in colours.items():
        image = numpy.zeros((24, 32, 3), dtype=numpy.uint8)
        image[:] = rgb
        with av.open(str(root / name), "w") as out:
            stream = out.add_stream("png")
            stream.width, stream.height, stream.pix_fmt = 32, 24, "rgb24"
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)

    # When the directory is fanned out 2 images a job
    job = stack.client().submit(workload="footage", params={"source": str(root),
                                                            "chunk_images": 2},
                                resources={"gpus": 0}, env=ONE_THREAD)
    status = job.wait(timeout=WAIT_S)

    # Then 2 jobs labelled every image once, in order
    assert status["result"]["chunks"] == 2
    job.download(tmp_path)
    assert [(f, label) for f, _, label in frames(tmp_path / "frames.jsonl")] == [
        ("0.png", "red"), ("1.png", "green"), ("2.png", "blue"), ("3.png", "red")]


def test_a_source_outside_input_file_roots_is_refused_403_and_nothing_is_stored(
        stack: Stack) -> None:
    before = len(stack.client().list(limit=1000))
    done = stack.e31("submit", "-w", "footage", "--param", "source=/etc", "--gpus", "0")
    assert done.returncode == 2 and "params.source" in done.stderr, done.stderr
    assert len(stack.client().list(limit=1000)) == before


def test_the_forty_hours_walk_through_prints_what_the_workloads_page_shows(
        stack: Stack, tmp_path: Path) -> None:
    import os
    import sys

    from tests.docblocks import (
        console_steps,
        doc,
        output_matches,
        python_shown_output,
        run_command,
    )

    # Given the stack's address, its python and e31 first on PATH, in an empty directory
    # (beneath the stack's input_file_roots, as the page's `E31_INPUT_FILE_ROOTS=$PWD`)
    path = os.pathsep.join([str(Path(sys.executable).parent), stack.env.get("PATH", "")])
    env = dict(stack.env, PATH=path, E31_URL=stack.url, E31_TOKEN=stack.token)
    page = doc("docs/workloads.md")

    # When the Python walk-through runs, then the console one in the same directory
    [script] = page.run_blocks("forty-hours")
    ran = run_command(f"python3 - <<'PY'\n{script.text}PY", env=env, cwd=tmp_path,
                      timeout_s=WAIT_S)
    assert ran.returncode == 0, ran.output
    assert output_matches(python_shown_output(script), ran.output), ran.output
    [console] = page.run_blocks("forty-hours-cli")
    steps = console_steps(console)
    cli = run_command("\n".join(c for c, _ in steps), env=env, cwd=tmp_path, timeout_s=WAIT_S)

    # Then each prints what the page shows
    assert cli.returncode == 0, cli.output
    assert output_matches([line for _, shown in steps for line in shown], cli.output), cli.output
