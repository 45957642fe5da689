"""Training in-process on CPU: outputs, checkpoints, and a resume that changes nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")
pytest.importorskip("safetensors")


from e31_worker.workloads import training
from e31_worker.workloads.models import digits_cnn, digits_mlp, load_state_dict
from tests.unit.workload_context import make_ctx, one_torch_thread  # noqa: F401 (autouse)

pytestmark = pytest.mark.torch
MLP = "e31_worker.workloads.models:digits_mlp"
DIGITS = "e31_worker.workloads.data:digits"
_calls = {"n": 0}


def interrupted_mlp(stop_at_call: int) -> Any:
    """digits_mlp that stops its process (KeyboardInterrupt) at forward call `stop_at_call`."""
    _calls["n"] = 0
    model = digits_mlp()

    def hook(module: Any, args: Any) -> None:
        _calls["n"] += 1
        if _calls["n"] == stop_at_call:
            raise KeyboardInterrupt("the attempt dies here")

    model.register_forward_pre_hook(hook)
    return model


# 320 digits in batches of 32: 10 steps an epoch
PARAMS: dict[str, Any] = {"dataset": DIGITS, "dataset_kwargs": {"limit": 320}, "epochs": 2,
                          "batch_size": 32, "val_fraction": 0.0, "checkpoint_every_steps": 4}


def test_training_writes_metrics_per_epoch_and_weights_a_fresh_model_can_load(
        tmp_path: Path) -> None:
    # Given a CNN on the digits as images, with a tenth held out
    ctx = make_ctx(tmp_path)

    # When it trains for two epochs
    result = training.run(ctx, model="e31_worker.workloads.models:digits_cnn", dataset=DIGITS,
                          dataset_kwargs={"image": True}, epochs=2, batch_size=64, lr=3e-3)

    # Then metrics.json has both epochs with losses and accuracy, and the weights load
    # (1437 train digits less a tenth: 1294, 21 batches of 64 an epoch)
    metrics = json.loads((ctx.output_dir / "metrics.json").read_text())
    assert [m["epoch"] for m in metrics] == [1, 2]
    assert metrics[1]["train_loss"] < metrics[0]["train_loss"]
    assert 0 <= metrics[1]["val_accuracy"] <= 1 and metrics[1]["val_loss"] > 0
    digits_cnn().load_state_dict(load_state_dict(str(ctx.output_dir / "model.safetensors")))
    assert result["steps"] == 2 * 21 and result["resumed_from_step"] == 0
    assert result["mixed_precision"] is False and result["device"] == "cpu"


def test_a_run_stopped_mid_epoch_resumes_at_its_last_checkpoint_and_ends_as_if_never_stopped(
        tmp_path: Path) -> None:
    # Given an uninterrupted reference run
    reference = make_ctx(tmp_path / "reference")
    training.run(reference, model=MLP, save_as="model.pt", **PARAMS)

    # And a run whose first attempt dies at its 7th step (checkpoints every 4 steps)
    with pytest.raises(KeyboardInterrupt):
        training.run(make_ctx(tmp_path / "run", 1), model=f"{__name__}:interrupted_mlp",
                     model_kwargs={"stop_at_call": 7}, save_as="model.pt", **PARAMS)

    # When the second attempt runs with the job's checkpoints
    ctx = make_ctx(tmp_path / "run", 2)
    result = training.run(ctx, model=MLP, save_as="model.pt", **PARAMS)

    # Then it resumed at step 4, finished all 20, and its weights and metrics equal the reference
    assert result["resumed_from_step"] == 4 and result["steps"] == 20
    ours, theirs = (torch.load(c.output_dir / "model.pt") for c in (ctx, reference))
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert ((ctx.output_dir / "metrics.json").read_text()
            == (reference.output_dir / "metrics.json").read_text())


def test_a_finished_run_retried_trains_no_further(tmp_path: Path) -> None:
    # Given a run that finished
    training.run(make_ctx(tmp_path, 1), model=MLP, **PARAMS)

    # When it runs again on the same checkpoints (a retry after a late failure)
    result = training.run(make_ctx(tmp_path, 2), model=MLP, **PARAMS)

    # Then it starts at the end and still writes its outputs
    assert result["resumed_from_step"] == 20 and result["steps"] == 20
    assert (tmp_path / "output-2" / "model.safetensors").is_file()


def test_an_unknown_optimizer_is_refused_before_any_step(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="optimizer must be one of"):
        training.run(make_ctx(tmp_path), model=MLP, optimizer="lion", **PARAMS)


@pytest.mark.gpu
def test_on_cuda_training_uses_mixed_precision_and_resumes_with_its_scaler(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    # Given a GPU job
    ctx = make_ctx(tmp_path, gpus="0")

    # When it trains
    result = training.run(ctx, model=MLP, **PARAMS)

    # Then it ran on cuda under autocast with a grad scaler saved in its checkpoint
    assert result["device"] == "cuda" and result["mixed_precision"] is True
    assert "scale" in ctx.load_checkpoint(training.CHECKPOINT)["scaler"]
