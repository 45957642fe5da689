"""Data set factories that ship with the packages (no downloads): scikit-learn's 8x8 digits.

`digits` is a dataset factory for `training:run`; `write_digits_jsonl` writes batch-inference
input (`{"custom_id": ..., "input": [64 floats]}` per line) for docs, tests and demos.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy
import torch
from torch.utils.data import TensorDataset

DIGITS_MAX_PIXEL = 16.0  # sklearn's digits are integers 0..16
TEST_FRACTION = 0.2      # `split="test"`: the last fifth, in sklearn's order
DIGITS_FILE = "digits.csv.gz"  # in sklearn/datasets/data: 64 pixels and the label per row


def digits_arrays(split: str = "all") -> tuple[torch.Tensor, torch.Tensor]:
    """Pixels [N, 64] scaled to [0, 1] and labels [N] of sklearn's digits (1797 in all)."""
    pixels, labels = _load_digits()
    x = torch.tensor(pixels, dtype=torch.float32) / DIGITS_MAX_PIXEL
    y = torch.tensor(labels, dtype=torch.long)
    cut = int(len(x) * (1 - TEST_FRACTION))
    if split == "train":
        return x[:cut], y[:cut]
    if split == "test":
        return x[cut:], y[cut:]
    if split != "all":
        raise ValueError(f"split must be train, test or all, not {split!r}")
    return x, y


def _load_digits() -> tuple[Any, Any]:
    """(pixels [1797, 64], labels [1797]) as numpy arrays, from the file scikit-learn ships.

    Read directly: importing sklearn.datasets takes ~1.7 s (it imports SciPy), reading the
    file ~20 ms, and every job that uses the digits pays it. `load_digits` is the fallback.
    """
    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "datasets" / "data" / DIGITS_FILE
        if path.is_file():
            table = numpy.loadtxt(path, delimiter=",")
            return table[:, :-1], table[:, -1].astype(numpy.int64)
    from sklearn.datasets import load_digits

    bunch: Any = load_digits()
    return bunch.data, bunch.target


def digits(split: str = "train", image: bool = False, limit: int | None = None) -> TensorDataset:
    """sklearn's digits as a dataset of (pixels, label): flat [64] or `image=True` [1, 8, 8]."""
    x, y = digits_arrays(split)
    if limit is not None:
        x, y = x[:limit], y[:limit]
    if image:
        x = x.reshape(-1, 1, 8, 8)
    return TensorDataset(x, y)


def write_digits_jsonl(path: str | Path, *, split: str = "test", limit: int | None = None,
                       bad_ids: Iterable[str] = ()) -> list[str]:
    """Write digits as batch-inference records, one per line; returns the custom_ids.

    Each record is `{"custom_id": "digit-<i>", "input": [64 floats], "label": <int>}`; a
    custom_id in `bad_ids` gets an input of the wrong length (to show errors.jsonl).
    """
    x, y = digits_arrays(split)
    n = len(x) if limit is None else min(limit, len(x))
    bad = set(bad_ids)
    ids = [f"digit-{i}" for i in range(n)]
    with open(path, "w") as f:
        for i, cid in enumerate(ids):
            pixels = [round(v, 4) for v in x[i].tolist()]
            f.write(json.dumps({"custom_id": cid, "input": pixels[:-1] if cid in bad else pixels,
                                "label": int(y[i])}) + "\n")
    return ids
