"""Sweeps and arrays, the pure part: a sweep file into items, defaults merged under each item.

A sweep file holds either a `grid` (every combination of the listed values, first key
slowest) or a `list` (one mapping of params per item), and optionally a `base` spec:

    base: {entrypoint: e31_worker.examples:sleep, resources: {gpus: 0}}
    grid: {seconds: [0.1, 0.2], steps: [1, 2]}          # 4 items

Each item is `{"params": {...}}`; `merge_item` lays it over the base (item wins, `params`
and `env` merged key by key). No I/O but reading the file; `JobSpec.parse` validates later.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e31.core.errors import SpecError
from e31.core.spec import load_spec_file

# One array is one request and one transaction; 10,000 items insert in about a second
# (docs/jobs.md). Bigger sweeps are several arrays.
MAX_ARRAY_ITEMS = 10_000
MERGED_FIELDS = ("params", "env")   # mappings merged key by key; every other field: item wins
SWEEP_KEYS = ("grid", "list")


@dataclass(frozen=True)
class Sweep:
    """A parsed sweep file: the params of each item, and the base spec it may carry."""

    params: list[dict[str, Any]]
    base: dict[str, Any] = field(default_factory=dict)

    def items(self) -> list[dict[str, Any]]:
        """The array items to submit over the base: `{"params": ...}` each."""
        return [{"params": p} for p in self.params]


def is_sweep(data: Mapping[str, Any]) -> bool:
    """Whether a loaded file is a sweep file rather than a job spec (no spec has these keys)."""
    return any(key in data for key in SWEEP_KEYS)


def merge_item(defaults: Mapping[str, Any], item: Any) -> Any:
    """`item` over `defaults`: the item's fields win; `params` and `env` merge key by key."""
    if not isinstance(item, Mapping):
        return item  # validation names it
    merged = {**defaults, **item}
    for key in MERGED_FIELDS:
        under, over = defaults.get(key), item.get(key)
        if isinstance(under, Mapping) and isinstance(over, Mapping):
            merged[key] = {**under, **over}
    return merged


def parse_sweep(data: Any, *, max_items: int = MAX_ARRAY_ITEMS) -> Sweep:
    """Validate a sweep mapping; `SpecError` naming the field (`sweep.grid.lr`) and why."""
    if not isinstance(data, Mapping):
        raise SpecError.one("sweep", "must be a mapping with grid or list")
    unknown = [k for k in data if k not in (*SWEEP_KEYS, "base")]
    if unknown:
        raise SpecError.one(f"sweep.{unknown[0]}", "unknown field (a sweep has grid or list, "
                                                    "and optionally base)")
    given = [k for k in SWEEP_KEYS if k in data]
    if len(given) != 1:
        raise SpecError.one("sweep", "give exactly one of grid or list")
    base = data.get("base") or {}
    if not isinstance(base, Mapping):
        raise SpecError.one("sweep.base", "must be a mapping of spec fields")
    params = _grid(data["grid"], max_items) if given == ["grid"] else _list(data["list"], max_items)
    return Sweep(params=params, base=dict(base))


def load_sweep_file(path: str | Path, *, max_items: int = MAX_ARRAY_ITEMS) -> Sweep:
    """Read and validate a sweep file (YAML or JSON)."""
    try:
        data = load_spec_file(path)
    except SpecError as exc:
        raise SpecError([{**e, "field": "sweep"} for e in exc.errors]) from exc
    return parse_sweep(data, max_items=max_items)


def _grid(grid: Any, max_items: int) -> list[dict[str, Any]]:
    if not isinstance(grid, Mapping) or not grid:
        raise SpecError.one("sweep.grid", "must be a non-empty mapping of param: [values]")
    for key, values in grid.items():
        if not isinstance(key, str):
            raise SpecError.one(f"sweep.grid.{key}", "a param name must be text")
        if not isinstance(values, list) or not values:
            raise SpecError.one(f"sweep.grid.{key}", "must be a non-empty list of values "
                                                     "(a constant goes in the base params)")
    size = math.prod(len(v) for v in grid.values())
    if size > max_items:
        raise SpecError.one("sweep.grid", f"{size} combinations; at most {max_items} items "
                                          "per array (split the sweep)")
    keys = list(grid)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*grid.values())]


def _list(entries: Any, max_items: int) -> list[dict[str, Any]]:
    if not isinstance(entries, list) or not entries:
        raise SpecError.one("sweep.list", "must be a non-empty list of params mappings")
    if len(entries) > max_items:
        raise SpecError.one("sweep.list", f"{len(entries)} items; at most {max_items} items "
                                          "per array (split the sweep)")
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise SpecError.one(f"sweep.list[{i}]", "must be a mapping of params")
        bad = next((k for k in entry if not isinstance(k, str)), None)
        if bad is not None:
            raise SpecError.one(f"sweep.list[{i}].{bad}", "a param name must be text")
    return [dict(e) for e in entries]
