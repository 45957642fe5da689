"""Model factories (`module:fn`) and the one loader every workload uses.

The tiny models here need no download: `digits_mlp` and `digits_cnn` take the 8x8 digits of
scikit-learn (`e31_worker.workloads.data:digits`), `frame_classifier` labels a video frame by
its dominant colour (it pairs with `footage.render_test_video`). They are public so that docs,
tests and demos can name them as `e31_worker.workloads.models:digits_mlp`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import fsspec
import torch
from torch import nn

from e31_worker.child.runner import load_entrypoint

DIGITS_FEATURES = 64      # 8x8 pixels of sklearn's digits
DIGITS_CLASSES = 10
FRAME_LABELS = ("red", "green", "blue")
FRAME_LOGIT_SCALE = 20.0  # turns channel means in [0, 1] into confident logits


def _seeded(seed: int, build: Any) -> nn.Module:
    """Build a module with its initial weights drawn from `seed`; the global RNG is left as is."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module: nn.Module = build()
    return module


def digits_mlp(hidden: int = 64, seed: int = 0) -> nn.Module:
    """An MLP for flat digits: input [N, 64] floats in [0, 1], output [N, 10] logits."""
    return _seeded(seed, lambda: nn.Sequential(
        nn.Linear(DIGITS_FEATURES, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, DIGITS_CLASSES)))


def digits_cnn(channels: int = 16, seed: int = 0) -> nn.Module:
    """A small CNN for digits images: input [N, 1, 8, 8], output [N, 10] logits."""
    return _seeded(seed, lambda: nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(),
        nn.Conv2d(channels, channels * 2, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2),                                     # 8x8 -> 4x4
        nn.Flatten(), nn.Linear(channels * 2 * 16, DIGITS_CLASSES)))


class FrameClassifier(nn.Module):
    """Labels RGB frames [N, 3, H, W] in [0, 1] by their dominant colour (`labels`).

    A linear layer over the channel means, initialised to pick the largest channel: it works
    without training on `render_test_video`'s footage, and it can still be fine-tuned.
    """

    def __init__(self, labels: tuple[str, ...] = FRAME_LABELS) -> None:
        super().__init__()
        self.labels = list(labels)
        self.head = nn.Linear(3, len(labels))
        with torch.no_grad():
            self.head.weight.copy_(torch.eye(len(labels), 3) * FRAME_LOGIT_SCALE)
            self.head.bias.zero_()

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.head(frames.mean(dim=(2, 3)))
        return result


def frame_classifier() -> nn.Module:
    """A frame model for `footage`: dominant colour of each frame, labels red/green/blue."""
    return FrameClassifier()


def build_model(factory: str, kwargs: Mapping[str, Any] | None = None, weights: str | None = None,
                device: str = "cpu") -> nn.Module:
    """`factory(**kwargs)`, then the `weights` file (safetensors or a torch state dict, a path or
    an fsspec URL) when given, moved to `device`. Never downloads from a model hub."""
    model = load_entrypoint(factory)(**dict(kwargs or {}))
    if not isinstance(model, nn.Module):
        raise TypeError(f"{factory} returned {type(model).__name__}, not a torch.nn.Module")
    if weights:
        model.load_state_dict(load_state_dict(weights))
    return model.to(device)


def load_state_dict(url: str) -> dict[str, torch.Tensor]:
    """A state dict from a `.safetensors` file, else from `torch.save` (weights only)."""
    with fsspec.open(url, "rb") as f:
        if url.endswith(".safetensors"):
            from safetensors.torch import load
            return load(f.read())
        obj = torch.load(f, map_location="cpu", weights_only=True)
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]  # the common {"state_dict": ...} wrapper
    if not isinstance(obj, dict):
        raise TypeError(f"{url} does not hold a state dict")
    return obj


def save_state_dict(model: nn.Module, path: str) -> None:
    """Write `model`'s weights as safetensors (`.safetensors`) or with `torch.save` (else)."""
    # copies: safetensors refuses tensors that share storage (tied weights)
    state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
    if path.endswith(".safetensors"):
        from safetensors.torch import save_file
        save_file(state, path)
    else:
        torch.save(state, path)
