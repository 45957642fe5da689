"""Outputs, logs and checkpoints of jobs over fsspec (`file://` by default, `s3://` etc.).

Layout under the store's root: `<tenant>/<job>/outputs/...`, `<tenant>/<job>/logs/attempt-N.log`,
`<tenant>/<job>/checkpoints/...` (checkpoints belong to the job, not the attempt).
"""

from __future__ import annotations

import contextlib
import posixpath
import re
import uuid
from pathlib import Path
from typing import IO, Any

import fsspec

from e31.errors import NotFound

_LOG_NAME = re.compile(r"^attempt-(\d+)\.log$")
TMP_PREFIX = ".e31-upload-"  # an upload in progress; never listed, never downloaded


class ArtifactStore:
    """A job-keyed file store; callers scope by tenant before they get here."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._fs, self._root = fsspec.core.url_to_fs(url)

    @property
    def url(self) -> str:
        return self._url

    def _path(self, tenant_id: str, job_id: str, *parts: str) -> str:
        return posixpath.join(self._root, tenant_id, job_id, *parts)

    # -- writing (workers) ---------------------------------------------------------------

    def put_file(self, local: Path, tenant_id: str, job_id: str, rel: str) -> None:
        """Upload atomically: to a temporary name beside the target, then renamed over it,
        so a reader (the next attempt loading a checkpoint) never sees half a file."""
        target = self._path(tenant_id, job_id, _safe(rel))
        parent = posixpath.dirname(target)
        self._fs.makedirs(parent, exist_ok=True)
        tmp = posixpath.join(parent, f"{TMP_PREFIX}{uuid.uuid4().hex[:12]}-{posixpath.basename(target)}")
        try:
            self._fs.put_file(str(local), tmp)
            self._fs.mv(tmp, target)
        except BaseException:
            with contextlib.suppress(Exception):
                self._fs.rm(tmp)
            raise

    def put_tree(self, local_dir: Path, tenant_id: str, job_id: str, prefix: str) -> list[dict[str, Any]]:
        """Copy every file under `local_dir` to `<prefix>/`; returns [{path, size}] sorted."""
        files: list[dict[str, Any]] = []
        for f in sorted(p for p in local_dir.rglob("*") if p.is_file()):
            rel = f.relative_to(local_dir).as_posix()
            self.put_file(f, tenant_id, job_id, f"{prefix}/{rel}")
            files.append({"path": rel, "size": f.stat().st_size})
        return files

    def get_tree(self, tenant_id: str, job_id: str, prefix: str, local_dir: Path) -> int:
        """Copy `<prefix>/` down into `local_dir`; returns the number of files."""
        base = self._path(tenant_id, job_id, prefix)
        if not self._fs.exists(base):
            return 0
        count = 0
        for remote in self._fs.find(base):
            if posixpath.basename(remote).startswith(TMP_PREFIX):
                continue  # an upload that never finished
            rel = posixpath.relpath(remote, base)
            target = local_dir / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            self._fs.get_file(remote, str(target))
            count += 1
        return count

    # -- reading (API) -------------------------------------------------------------------

    def list_outputs(self, tenant_id: str, job_id: str) -> list[dict[str, Any]]:
        base = self._path(tenant_id, job_id, "outputs")
        if not self._fs.exists(base):
            return []
        return [{"path": posixpath.relpath(p, base), "size": int(info.get("size") or 0)}
                for p, info in sorted(self._fs.find(base, detail=True).items())
                if not posixpath.basename(p).startswith(TMP_PREFIX)]

    def open_output(self, tenant_id: str, job_id: str, rel: str) -> IO[bytes]:
        path = self._path(tenant_id, job_id, "outputs", _safe(rel))
        if not self._fs.isfile(path):
            raise NotFound(f"job {job_id} has no output {rel!r}")
        return self._fs.open(path, "rb")

    def log_attempts(self, tenant_id: str, job_id: str) -> list[int]:
        base = self._path(tenant_id, job_id, "logs")
        if not self._fs.exists(base):
            return []
        found = (_LOG_NAME.match(posixpath.basename(p)) for p in self._fs.ls(base, detail=False))
        return sorted(int(m.group(1)) for m in found if m)

    def read_log(self, tenant_id: str, job_id: str, attempt: int, offset: int = 0) -> bytes:
        path = self._path(tenant_id, job_id, "logs", f"attempt-{attempt}.log")
        if not self._fs.exists(path):
            return b""
        with self._fs.open(path, "rb") as f:
            f.seek(offset)
            return f.read()


def log_name(attempt: int) -> str:
    return f"logs/attempt-{attempt}.log"


def _safe(rel: str) -> str:
    """A relative path that stays inside its job: no absolute paths, no `..`."""
    norm = posixpath.normpath(rel.replace("\\", "/"))
    if norm.startswith("/") or norm == ".." or norm.startswith("../"):
        raise NotFound(f"no such output {rel!r}")
    return norm
