"""The language models of the pool, by name (`/v1/models` for every tenant, `/v1/admin/models`
for admins; `e31 model add|list|remove`).

A model is a Hugging Face-format directory the workers read: on a file system beneath the
models' directory (`models_dir`) or `input_file_roots`, or an `s3://` prefix; it is staged
into each shard's inputs like any input, and nothing is downloaded at run time. What it is for
(`chat`: /v1/chat/completions and /v1/completions; `embed`: /v1/embeddings) is given, or read
from the directory: its `e31_model.json` (the built-in models have one), else its
`config.json` (an architecture `…ForCausalLM` is a chat model).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from e31.api.services.tenants import admin_only
from e31.core.batches import MODEL_KINDS, MODEL_MARKER
from e31.core.bundles import file_input_path
from e31.core.clock import utcnow
from e31.core.errors import SpecConflict, SpecError, SpecForbidden
from e31.core.names import check_name
from e31.core.records import Actor, TenantRecord
from e31.edge.settings import Settings
from e31.store import Repo
from e31.store.batches import ModelRecord

log = logging.getLogger(__name__)



class ModelService:
    """Register, list and remove models."""

    def __init__(self, *, settings: Settings, repo: Repo) -> None:
        self._settings = settings
        self._repo = repo

    def add(self, caller: TenantRecord, name: str, path: str, *, kind: str | None,
            gpu_mem_gb: float | None, replace: bool = False,
            actor: Actor | None = None) -> ModelRecord:
        """Register `name` for the model at `path` (admins only)."""
        admin_only(caller)
        try:
            check_name(name, "a model name")
        except ValueError as exc:
            raise SpecError.one("name", str(exc)) from exc
        url, local = self._where(path)
        kind = kind or (model_kind(Path(local)) if local else None)
        if kind not in MODEL_KINDS:
            raise SpecConflict.one("kind", "say what the model is for: one of "
                                        f"{', '.join(MODEL_KINDS)} (none could be read from "
                                        "its directory)")
        record = self._repo.add_model(ModelRecord(name, kind, url, gpu_mem_gb, utcnow()),
                                      replace=replace, actor=actor)
        log.info("model_added model=%s kind=%s path=%s by=%s", name, kind, url, caller.name)
        return record

    def _where(self, path: str) -> tuple[str, str | None]:
        """The model's URL as inputs name it, and its local directory when it has one."""
        if path.startswith("s3://"):
            return path, None
        if path.startswith("file://"):
            local = path
        elif os.path.isabs(path):
            local = "file://" + os.path.normpath(path)
        else:
            raise SpecError.one("path", "give an absolute directory or an s3:// or file:// URL")
        try:
            resolved = file_input_path(local, self._settings.file_roots)
        except ValueError as exc:
            raise SpecForbidden.one("path", f"{exc}; put the model beneath models_dir "
                                            f"({self._settings.resolved_models_dir})") from exc
        if not Path(resolved).is_dir():
            raise SpecConflict.one("path", f"{resolved} is not a directory on the API's host")
        return "file://" + resolved, resolved

    def list(self) -> list[ModelRecord]:
        return list(self._repo.models().values())

    def remove(self, caller: TenantRecord, name: str, *, actor: Actor | None = None) -> None:
        admin_only(caller)
        self._repo.remove_model(name, now=utcnow(), actor=actor)
        log.info("model_removed model=%s by=%s", name, caller.name)


def model_kind(directory: Path) -> str | None:
    """What the model in `directory` is for, as the module says; None when it cannot tell."""
    try:
        marker = json.loads((directory / MODEL_MARKER).read_text())
        if marker.get("kind") in MODEL_KINDS:
            return str(marker["kind"])
    except (OSError, ValueError, AttributeError):
        pass
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    archs = config.get("architectures") or [] if isinstance(config, dict) else []
    return "chat" if any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in archs) \
        else "embed" if archs else None
