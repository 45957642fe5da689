"""The built-in models `e31 up` registers: `e31-tiny-chat` and `e31-tiny-embed`.

Random weights and a tokenizer built in code (`e31_worker.workloads.tinymodels`, a few MB,
the same files each build), written once under the models' directory, so that the demo, the
tests and a newcomer's first batch run without any download. They are built in a process of
their own (transformers is the workers' dependency, `.[llm]`, not the control plane's); where
it is missing, `e31 up` says so and registers none. A build is kept in the user's cache
(`$XDG_CACHE_HOME/e31/models`, or `E31_MODEL_CACHE`) and copied from there into every new
home, so a second stack on the machine does not build them again.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

from e31.core.batches import MODEL_MARKER  # written last by a build: a whole model
from e31.core.clock import utcnow
from e31.edge.settings import Settings
from e31.store import Repo
from e31.store.batches import ModelRecord

log = logging.getLogger(__name__)

BUILTIN = {"e31-tiny-chat": "chat", "e31-tiny-embed": "embed"}
BUILD_TIMEOUT_S = 300.0


def register_builtin_models(settings: Settings, repo: Repo) -> list[str]:
    """Build (once) and register the built-in models; returns the names registered."""
    registered = []
    for name, kind in BUILTIN.items():
        directory = settings.resolved_models_dir / name
        if not (directory / MODEL_MARKER).is_file() and not _build(directory, kind):
            continue
        repo.add_model(ModelRecord(name, kind, f"file://{directory}", None, utcnow()),
                       replace=True)
        registered.append(name)
    return registered


def cache_dir() -> Path:
    """Where built models are kept for every home of this user."""
    if os.environ.get("E31_MODEL_CACHE"):
        return Path(os.environ["E31_MODEL_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "e31" / "models"


def _build(directory: Path, kind: str) -> bool:
    """Copy the model into `directory` from the cache, building it there first if needed."""
    cached = cache_dir() / directory.name
    if not (cached / MODEL_MARKER).is_file() and not _build_into(cached, kind):
        return False
    staging = _staging(directory)
    shutil.copytree(cached, staging)
    _into_place(staging, directory)
    return True


def _staging(directory: Path) -> Path:
    """A fresh name beside `directory` to write it under before it is put in place."""
    return directory.with_name(f".{directory.name}-{uuid.uuid4().hex[:8]}")


def _into_place(staging: Path, directory: Path) -> None:
    """`staging` becomes `directory`: whole, or not there (another stack may write it too)."""
    shutil.rmtree(directory, ignore_errors=True)
    staging.rename(directory)


def _build_into(directory: Path, kind: str) -> bool:
    if importlib.util.find_spec("transformers") is None:
        log.warning("builtin_model_skipped model=%s: transformers is not installed (install "
                    "e31-batch[llm] for the built-in models)", directory.name)
        return False
    staging = _staging(directory)
    staging.parent.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run([sys.executable, "-m", "e31_worker.workloads.tinymodels",
                               str(staging), "--kind", kind], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("builtin_model_skipped model=%s: %s", directory.name, exc)
        return False
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        log.warning("builtin_model_skipped model=%s: %s (install e31-batch[llm] for the "
                    "built-in models)", directory.name, why)
        shutil.rmtree(staging, ignore_errors=True)
        return False
    _into_place(staging, directory)
    return True
