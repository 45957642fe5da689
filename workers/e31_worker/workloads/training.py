"""Training and fine-tuning: a model and a dataset from factories, checkpoints, resume.

A checkpoint (`training.pt`: model, optimizer, grad scaler, epoch, step, RNG states, metric
history) goes through `ctx.save_checkpoint` every `checkpoint_every_steps` steps and at
every epoch's end; a retried or requeued attempt resumes from it, inside the epoch, with the
same batch order (each epoch's shuffle comes from `seed` and the epoch number), so a killed
run loses at most one interval. On CUDA the steps run under `torch.autocast` (float16) with a
`GradScaler`; on CPU in float32. Outputs: `metrics.json` (one entry per epoch) and the final
weights, `model.safetensors` (or `model.pt`).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from e31_worker.child.context import JobContext
from e31_worker.child.runner import load_entrypoint
from e31_worker.workloads.models import build_model, save_state_dict

CHECKPOINT = "training.pt"
OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "cross_entropy": nn.functional.cross_entropy, "mse": nn.functional.mse_loss}


def run(ctx: JobContext, model: str, dataset: str, model_kwargs: dict[str, Any] | None = None,
        dataset_kwargs: dict[str, Any] | None = None, weights: str | None = None,
        optimizer: str = "adam", lr: float = 1e-3, weight_decay: float = 0.0,
        epochs: int = 1, batch_size: int = 32, val_fraction: float = 0.1,
        loss: str = "cross_entropy", checkpoint_every_steps: int = 100, seed: int = 0,
        mixed_precision: bool = True, num_workers: int = 0,
        save_as: str = "model.safetensors") -> dict[str, Any]:
    """Train `model` on `dataset` (items are (input, target) pairs); returns the last metrics.

    `weights` starts from saved weights (fine-tuning; a relative path is one of the job's
    `inputs`). `val_fraction` of the dataset, drawn with `seed`, is held out for `val_loss`
    (and `val_accuracy` with `cross_entropy`).
    """
    started = time.monotonic()
    device = ctx.device
    amp = mixed_precision and device == "cuda"
    torch.manual_seed(seed)
    net = build_model(model, model_kwargs, weights and ctx.input_path(weights), device)
    data = load_entrypoint(dataset)(**(dataset_kwargs or {}))
    train_set, val_set = _split(data, val_fraction, seed)
    if optimizer not in OPTIMIZERS or loss not in LOSSES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)} and loss one of "
                         f"{sorted(LOSSES)}, not {optimizer!r} and {loss!r}")
    opt = OPTIMIZERS[optimizer](net.parameters(), lr=lr, weight_decay=weight_decay)
    scaler = _grad_scaler(amp)
    loss_fn = LOSSES[loss]
    steps_per_epoch = math.ceil(len(train_set) / batch_size)  # type: ignore[arg-type]
    state = ctx.load_checkpoint(CHECKPOINT)
    step, history = 0, []
    epoch_sum = epoch_count = 0.0
    if state is not None:
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        _set_rng(state["rng"])
        step, history = state["step"], state["history"]
        epoch_sum, epoch_count = state["epoch_loss_sum"], state["epoch_loss_count"]
        print(f"training_resumed job={ctx.job_id} attempt={ctx.attempt} step={step}", flush=True)
    resumed_from = step
    total_steps = steps_per_epoch * epochs

    def checkpoint() -> None:
        ctx.save_checkpoint({"model": net.state_dict(), "optimizer": opt.state_dict(),
                             "scaler": scaler.state_dict(), "rng": _get_rng(), "step": step,
                             "epoch": step // steps_per_epoch, "history": history,
                             "epoch_loss_sum": epoch_sum, "epoch_loss_count": epoch_count},
                            name=CHECKPOINT)

    while step < total_steps:
        epoch, first = divmod(step, steps_per_epoch)
        net.train()
        for inputs, targets in _loader(train_set, batch_size, seed, epoch, first, num_workers,
                                       device):
            with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
                batch_loss = loss_fn(net(inputs), targets)
            opt.zero_grad(set_to_none=True)
            scaler.scale(batch_loss).backward()
            scaler.step(opt)
            scaler.update()
            step += 1
            epoch_sum += float(batch_loss.detach()) * len(targets)
            epoch_count += len(targets)
            ctx.progress(step, total_steps)
            if step % checkpoint_every_steps == 0 and step % steps_per_epoch:
                checkpoint()
        history.append({"epoch": epoch + 1, "step": step,
                        "train_loss": epoch_sum / max(epoch_count, 1),
                        **_evaluate(net, val_set, batch_size, loss, device, amp)})
        print(f"epoch_done {json.dumps(history[-1])}", flush=True)
        epoch_sum = epoch_count = 0.0
        checkpoint()
    (ctx.output_dir / "metrics.json").write_text(json.dumps(history, indent=2))
    save_state_dict(net, str(ctx.output_dir / save_as))
    return {"steps": step, "epochs": epochs, "resumed_from_step": resumed_from,
            "device": device, "mixed_precision": amp, "weights": save_as,
            "metrics": history[-1] if history else {},
            "seconds": round(time.monotonic() - started, 3)}


def _split(data: Any, val_fraction: float, seed: int) -> tuple[Dataset[Any], Dataset[Any] | None]:
    n = len(data)
    n_val = int(n * val_fraction)
    if n_val == 0:
        return data, None
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return Subset(data, order[n_val:]), Subset(data, order[:n_val])


def _loader(data: Dataset[Any], batch_size: int, seed: int, epoch: int, first_batch: int,
            num_workers: int, device: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of one epoch from `first_batch` on, in an order fixed by (seed, epoch)."""
    n = len(data)  # type: ignore[arg-type]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    batches = [order[i:i + batch_size].tolist() for i in range(0, n, batch_size)][first_batch:]
    loader = DataLoader(data, batch_sampler=batches, num_workers=num_workers,
                        pin_memory=device == "cuda")
    for inputs, targets in loader:
        yield inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)


@torch.no_grad()
def _evaluate(net: nn.Module, data: Dataset[Any] | None, batch_size: int, loss: str,
              device: str, amp: bool) -> dict[str, float]:
    if data is None:
        return {}
    net.eval()
    total = correct = 0
    loss_sum = 0.0
    for inputs, targets in DataLoader(data, batch_size=batch_size):
        inputs, targets = inputs.to(device), targets.to(device)
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            out = net(inputs)
        loss_sum += float(LOSSES[loss](out.float(), targets, reduction="sum"))
        total += len(targets)
        if loss == "cross_entropy":
            correct += int((out.argmax(-1) == targets).sum())
    metrics = {"val_loss": loss_sum / max(total, 1)}
    if loss == "cross_entropy":
        metrics["val_accuracy"] = correct / max(total, 1)
    return metrics


def _grad_scaler(enabled: bool) -> Any:
    """A CUDA GradScaler (a no-op when disabled); torch < 2.3 has it under torch.cuda.amp."""
    if hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler("cuda", enabled=enabled)
    return torch.cuda.amp.GradScaler(enabled=enabled)


def _get_rng() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": numpy.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    numpy.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
