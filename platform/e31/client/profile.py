"""The local profile `e31 up` writes so that `Client()` and the CLI need no setup."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def default_home() -> Path:
    return Path(os.environ.get("E31_HOME") or "~/.e31").expanduser()


def read_profile(home: Path | None = None) -> dict[str, Any]:
    path = (home or default_home()) / "profile.json"
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def write_profile(home: Path, data: dict[str, Any]) -> Path:
    """Write atomically, readable by the owner only (it holds a token)."""
    home.mkdir(parents=True, exist_ok=True)
    path = home / "profile.json"
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)
    return path
