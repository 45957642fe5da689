"""Batch inference in-process on CPU, with a JobContext on temporary directories."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")


from e31_worker.workloads import batch_inference, training
from e31_worker.workloads.data import write_digits_jsonl
from e31_worker.workloads.models import digits_mlp
from tests.unit.workload_context import make_ctx, one_torch_thread  # noqa: F401 (autouse)

pytestmark = pytest.mark.torch
MLP = "e31_worker.workloads.models:digits_mlp"
_calls = {"n": 0, "stop_at": 0}


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def interrupted_mlp(stop_at_call: int) -> Any:
    """digits_mlp that stops its process (KeyboardInterrupt) at forward call `stop_at_call`."""
    _calls.update(n=0, stop_at=stop_at_call)
    model = digits_mlp()

    def hook(module: Any, args: Any) -> None:
        _calls["n"] += 1
        if _calls["n"] == _calls["stop_at"]:
            raise KeyboardInterrupt("the attempt dies here")

    model.register_forward_pre_hook(hook)
    return model


def test_bad_records_land_in_errors_and_the_rest_in_results(tmp_path: Path) -> None:
    # Given 40 digits records, one with a short input, then a broken line and one without an id
    src = tmp_path / "in.jsonl"
    ids = write_digits_jsonl(src, limit=40, bad_ids=["digit-7"])
    with open(src, "a") as f:
        f.write("{not json\n\n" + json.dumps({"input": [0.0] * 64}) + "\n")
    ctx = make_ctx(tmp_path)

    # When the workload runs in batches of 16
    result = batch_inference.run(ctx, path=str(src), model=MLP, batch_size=16)

    # Then every good record has a label and a score, and each bad one says why
    results = rows(ctx.output_dir / "results.jsonl")
    errors = rows(ctx.output_dir / "errors.jsonl")
    assert [r["custom_id"] for r in results] == [i for i in ids if i != "digit-7"]
    assert all(0 <= r["label"] < 10 and 0 < r["score"] <= 1 for r in results)
    assert [(e["custom_id"], e["where"]) for e in errors] == [
        ("digit-7", "in.jsonl:8"), (None, "in.jsonl:41"), (None, "in.jsonl:43")]
    assert "shape [63]" in errors[0]["error"] and "invalid JSON" in errors[1]["error"]
    assert result["total"] == 42 and result["succeeded"] == 39 and result["failed"] == 3
    assert json.loads((tmp_path / "progress.json").read_text()) == {"done": 42, "total": 42}


def test_a_retried_attempt_skips_the_committed_records_and_the_output_has_each_once(
        tmp_path: Path) -> None:
    # Given 100 records, commits every 20, and a first attempt that dies at its 4th batch of 10
    src = tmp_path / "in.jsonl"
    ids = write_digits_jsonl(src, limit=100)
    params: dict[str, Any] = {"path": str(src), "batch_size": 10, "checkpoint_every_records": 20}
    with pytest.raises(KeyboardInterrupt):
        batch_inference.run(make_ctx(tmp_path, 1), model=f"{__name__}:interrupted_mlp",
                            model_kwargs={"stop_at_call": 4}, **params)

    # When the second attempt runs with a fresh output dir and the job's checkpoints
    ctx = make_ctx(tmp_path, 2)
    result = batch_inference.run(ctx, model=MLP, **params)

    # Then it resumed after the 20 committed records (the 30th was never committed)
    assert result["resumed_from"] == 20
    assert [r["custom_id"] for r in rows(ctx.output_dir / "results.jsonl")] == ids
    assert result["succeeded"] == 100 and result["failed"] == 0


def test_a_directory_of_shards_reads_in_sorted_order_with_labels_and_raw_outputs(
        tmp_path: Path) -> None:
    # Given two JSONL shards in a directory
    (tmp_path / "in").mkdir()
    first = write_digits_jsonl(tmp_path / "in" / "b.jsonl", limit=5)
    lines = (tmp_path / "in" / "b.jsonl").read_text().replace("digit-", "a-")
    (tmp_path / "in" / "a.jsonl").write_text(lines)

    # When it runs once with label names and once with raw outputs
    named = batch_inference.run(make_ctx(tmp_path / "x"), path=str(tmp_path / "in"), model=MLP,
                                labels=list("abcdefghij"))
    raw_ctx = make_ctx(tmp_path / "y")
    batch_inference.run(raw_ctx, path=str(tmp_path / "in"), model=MLP, postprocess="raw")

    # Then a.jsonl comes first, labels are names, and raw rows carry the 10 logits
    out = rows(tmp_path / "x" / "output-1" / "results.jsonl")
    assert [r["custom_id"] for r in out] == [i.replace("digit-", "a-") for i in first] + first
    assert all(r["label"] in "abcdefghij" for r in out) and named["succeeded"] == 10
    assert all(len(r["output"]) == 10 for r in rows(raw_ctx.output_dir / "results.jsonl"))


def test_trained_weights_in_safetensors_classify_most_held_out_digits(tmp_path: Path) -> None:
    # Given an MLP trained for a few epochs on the digits' train split
    train_ctx = make_ctx(tmp_path / "train")
    training.run(train_ctx, model=MLP, dataset="e31_worker.workloads.data:digits", epochs=8,
                 batch_size=32, lr=3e-3, val_fraction=0.0)
    weights = train_ctx.output_dir / "model.safetensors"
    src = tmp_path / "test.jsonl"
    write_digits_jsonl(src, split="test", limit=200)

    # When batch inference loads those weights over the test split, on CPU with auto batch size
    ctx = make_ctx(tmp_path / "infer")
    result = batch_inference.run(ctx, path=str(src), model=MLP, weights=str(weights),
                                 auto_batch_size=True, batch_size=50)

    # Then most predictions match the labels, and on CPU the given batch size was kept
    truth = {r["custom_id"]: r["label"] for r in rows(src)}
    predicted = rows(ctx.output_dir / "results.jsonl")
    accuracy = sum(r["label"] == truth[r["custom_id"]] for r in predicted) / len(predicted)
    assert accuracy > 0.8
    assert result["batch_size"] == 50 and result["device"] == "cpu"


@pytest.mark.gpu
def test_on_cuda_the_batch_size_search_grows_the_batch_and_results_match_cpu(
        tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    # Given 300 records
    src = tmp_path / "in.jsonl"
    write_digits_jsonl(src, limit=300)

    # When the workload runs on the GPU with the search on, and on the CPU
    gpu = make_ctx(tmp_path / "gpu", gpus="0")
    on_gpu = batch_inference.run(gpu, path=str(src), model=MLP, auto_batch_size=True,
                                 batch_size=8, max_batch_size=256)
    cpu = make_ctx(tmp_path / "cpu")
    batch_inference.run(cpu, path=str(src), model=MLP, batch_size=8)

    # Then it ran on cuda with a bigger batch, and the labels agree with the CPU's
    assert on_gpu["device"] == "cuda" and on_gpu["batch_size"] == 256
    assert ([r["label"] for r in rows(gpu.output_dir / "results.jsonl")]
            == [r["label"] for r in rows(cpu.output_dir / "results.jsonl")])


def test_rows_are_the_json_that_json_dumps_writes_for_any_kind_of_id(tmp_path: Path) -> None:
    # Given records whose ids are plain, quoted, non-ASCII and integer
    src = tmp_path / "in.jsonl"
    ids: list[Any] = ["plain", 'say "hi"\\', "données-✓", 7]
    src.write_text("".join(json.dumps({"custom_id": i, "input": [0.5] * 64}) + "\n" for i in ids))
    ctx = make_ctx(tmp_path)

    # When they are classified with label names
    batch_inference.run(ctx, path=str(src), model=MLP, labels=[f"é{i}" for i in range(10)])

    # Then each line is exactly json.dumps of its row
    for line in (ctx.output_dir / "results.jsonl").read_text().splitlines():
        assert line == json.dumps(json.loads(line))
    assert [r["custom_id"] for r in rows(ctx.output_dir / "results.jsonl")] == ids


def test_lines_that_only_parse_together_are_each_an_error(tmp_path: Path) -> None:
    # Given a line with two objects and a line with a fragment: joined, they would parse
    src = tmp_path / "in.jsonl"
    good = json.dumps({"custom_id": "good", "input": [0.0] * 64})
    src.write_text(f'{good}\n{{"custom_id": "a", "input": [{{"k": 1}}\n'
                   f'{{"k": 2}}]}}\n{{"custom_id": "b"}}, {{"custom_id": "c"}}\n')
    ctx = make_ctx(tmp_path)

    # When they run
    result = batch_inference.run(ctx, path=str(src), model=MLP)

    # Then only the good record has a result; the three broken lines are errors
    assert [r["custom_id"] for r in rows(ctx.output_dir / "results.jsonl")] == ["good"]
    assert [e["where"] for e in rows(ctx.output_dir / "errors.jsonl")] == [
        "in.jsonl:2", "in.jsonl:3", "in.jsonl:4"]
    assert result["failed"] == 3


def test_the_batch_size_search_tries_copies_of_a_record_of_the_common_shape(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given records whose first one has a short input, and a device where 100 fit
    src = tmp_path / "in.jsonl"
    write_digits_jsonl(src, limit=20, bad_ids=["digit-0"])
    tried: list[tuple[int, ...]] = []

    def fits_up_to_100(net: Any, sample: Any, device: str) -> Any:
        tried.append(tuple(sample.shape))
        return lambda n: n <= 100

    monkeypatch.setattr(batch_inference, "cuda_batch_fits", fits_up_to_100)
    collator = batch_inference.Collator(input_key="input", input_shape=None,
                                        dtype=torch.float32, preprocess=None, pin=False)

    # When the search runs from 8 with a limit of 1000
    size = batch_inference._search(digits_mlp(), [str(src)], 0, 8, 1000, collator)

    # Then it doubled to 64 on a 64-value record, not on the short first one
    assert size == 64 and tried == [(64,)]
