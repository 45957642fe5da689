"""Entrypoints of the environment tests (on the workers' PYTHONPATH): each imports a package
that only the job's own environment holds."""

from __future__ import annotations

import sys
from typing import Any


def toml_of(ctx: Any, data: dict[str, Any]) -> dict[str, Any]:
    """`data` as TOML, written by tomli-w, and the environment it ran in."""
    import tomli_w  # not in the worker's environment: only in the job's own

    return {"toml": tomli_w.dumps(data), "prefix": sys.prefix}
