"""Which decoder the footage workload used: the GPU's where PyAV and the driver can, else the
CPU, said in its summary and result; and a resumed run that writes what an uninterrupted one
writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
av = pytest.importorskip("av")

from e31_worker.workloads import footage, video  # noqa: E402
from tests.unit.workload_context import make_ctx, one_torch_thread  # noqa: E402, F401 (autouse)

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return footage.render_test_video(tmp_path_factory.mktemp("v") / "clip.mp4", seconds=3, fps=10)


def test_asking_for_nvdec_where_there_is_no_gpu_decodes_the_same_frames_on_the_cpu(
        clip: Path) -> None:
    # Given PyAV's CUDA acceleration, on a machine without a GPU (the open fails there)
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: NVDEC may decode")
    from av.codec.hwaccel import HWAccel
    cuda = HWAccel(device_type="cuda", allow_software_fallback=True)

    # When frames are sampled with it, and without
    used: list[str] = []
    with_gpu = [t for t, _ in video.sampled_frames(str(clip), fps=4, hwaccel=cuda, used=used)]
    plain = [t for t, _ in video.sampled_frames(str(clip), fps=4)]

    # Then the CPU decoded the same frames, and says so
    assert with_gpu == plain and used == ["cpu"]


def test_the_summary_and_result_say_the_cpu_decoded_on_a_cpu_job(clip: Path,
                                                                 tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path)
    result = footage.run(ctx, path=str(clip), fps=2)
    summary = json.loads((ctx.output_dir / "summary.json").read_text())
    assert result["decoder"] == summary["decoder"] == summary["files"][0]["decoder"] == "cpu"


def test_a_run_that_fails_mid_way_resumes_after_its_committed_frames_and_writes_the_same(
        clip: Path, tmp_path: Path) -> None:
    # Given the rows of an uninterrupted run, 2 frames a batch
    whole = make_ctx(tmp_path / "whole")
    footage.run(whole, path=str(clip), fps=4, batch_size=2)

    # And a run whose model fails at its 4th batch, committing every 2 frames
    calls = [0]

    def failing_hook(module: object, args: object) -> None:
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("killed")

    from e31_worker.workloads import models
    net = models.frame_classifier()
    net.register_forward_pre_hook(failing_hook)
    first = make_ctx(tmp_path / "job", attempt=1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(footage, "build_model", lambda *a, **k: net)
        with pytest.raises(RuntimeError, match="killed"):
            footage.run(first, path=str(clip), fps=4, batch_size=2, checkpoint_every_frames=2)

    # When the next attempt runs on the same checkpoints
    second = make_ctx(tmp_path / "job", attempt=2)
    result = footage.run(second, path=str(clip), fps=4, batch_size=2, checkpoint_every_frames=2)

    # Then it redid none of the 6 committed frames, and wrote what the whole run wrote
    assert result["resumed_from"] == 6
    assert (second.output_dir / "frames.jsonl").read_text() == \
        (whole.output_dir / "frames.jsonl").read_text()
    assert json.loads((second.output_dir / "summary.json").read_text()) == \
        json.loads((whole.output_dir / "summary.json").read_text())


@pytest.mark.parametrize("threads", [1, 3, 0])
def test_the_decoder_runs_on_the_threads_asked_and_decodes_the_same_frames(
        clip: Path, threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given the decoder that sampled_frames opens, recorded
    opened: list = []
    real_open = video._open

    def recording_open(*args: object, **kwargs: object) -> object:
        container = real_open(*args, **kwargs)
        opened.append(container.streams.video[0])
        return container
    monkeypatch.setattr(video, "_open", recording_open)
    one_thread = [(t, image.tobytes()) for t, image in video.sampled_frames(str(clip), fps=4)]

    # When the same frames are sampled on `threads` decode threads
    frames = video.sampled_frames(str(clip), fps=4, threads=threads)
    first = next(frames)
    stream = opened[-1]

    # Then its codec runs on that many (FFmpeg's own count for 0: at least one), with frame
    # threads only when more than one, and yields exactly the one-thread frames
    if threads == 1:
        assert stream.codec_context.thread_count == 1
    elif threads == 0:
        assert stream.codec_context.thread_count >= 1 and stream.thread_type.name == "AUTO"
    else:
        assert stream.codec_context.thread_count == threads and stream.thread_type.name == "AUTO"
    assert [(first[0], first[1].tobytes())] + [(t, i.tobytes()) for t, i in frames] == one_thread


def test_a_bad_decode_threads_is_refused_naming_the_param(clip: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="decode_threads"):
        footage.run(make_ctx(tmp_path), path=str(clip), decode_threads=-2)
