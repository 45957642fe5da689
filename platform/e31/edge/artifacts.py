"""Outputs, logs and checkpoints of jobs over fsspec (`file://` by default, `s3://` etc.).

Layout under the store's root: `<tenant>/<job>/outputs/...`, `<tenant>/<job>/logs/attempt-N.log`,
`<tenant>/<job>/checkpoints/...` (checkpoints belong to the job, not the attempt). A job's logs
are served as one range of bytes through `e31.edge.logview`.

Links are never followed (docs/security.md): on a local store every file is reached, listed
and removed through the walks of `e31.edge.localwalk`, which open one directory at a time
with `O_NOFOLLOW` and store or serve only a regular file of one link that resolves beneath
its directory. Object stores (`s3://`, ...) have no links.

On an object store (`s3://bucket/prefix`, through `s3fs`) the same guarantees hold by other
means: every key is built below `<prefix>/<tenant>/<job>/` from a path that `_safe` has
normalised and refused when absolute or climbing out with `..`, so no request names another
job's key, even to a server or proxy that would normalise it; files are read in ranged GETs
of REMOTE_BLOCK_BYTES (the API streams a download, never holds it whole); and listings are
not cached, so an API process sees what a worker on another node uploaded a moment ago.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import shutil
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from e31.core.errors import LinkRefused, NotFound
from e31.edge.localwalk import (
    create_beneath,
    open_beneath,
    remove_beneath,
    scan_beneath,
    scan_tree,
)
from e31.edge.logview import LOG_NAME, LogPart, LogView

log = logging.getLogger(__name__)

TMP_PREFIX = ".e31-upload-"  # an upload in progress; never listed, never downloaded
COPY_CHUNK_BYTES = 1024 * 1024  # one read and one write per MiB of a copied file
# An object store's file is fetched in ranged GETs of this many bytes (s3fs reads ahead one
# block): a module attribute so that a test can show what a whole-file read looks like.
REMOTE_BLOCK_BYTES = COPY_CHUNK_BYTES

# A tenant's outputs on an object store with no `tenant_outputs_max_bytes`: no cap (the
# store's own typo guard, e31.store.quotas.MAX_OUTPUTS_BYTES, is the same number).
NO_CAP_BYTES = 1 << 62


class ArtifactStore:
    """A job-keyed file store; callers scope by tenant before they get here."""

    def __init__(self, url: str, *, storage_options: Mapping[str, Any] | None = None) -> None:
        """`storage_options`: the fsspec file system's arguments (for `s3://`: endpoint_url,
        key, secret; see `e31.edge.wiring.storage_options`)."""
        self._url = url
        self._options = dict(storage_options or {})
        opts = dict(self._options)
        if not url.startswith("file:") and "://" in url:
            opts.setdefault("use_listings_cache", False)  # another node's uploads show at once
        self._fs, self._root = fsspec.core.url_to_fs(url, **opts)
        self._local = isinstance(self._fs, LocalFileSystem)

    @property
    def url(self) -> str:
        return self._url

    @property
    def storage_options(self) -> dict[str, Any]:
        """The arguments this store was opened with, for the bundles kept beside it."""
        return dict(self._options)

    def capacity_bytes(self) -> int | None:
        """The most this store can hold: a local store's file system's size (of its root, or
        of the nearest directory above it that exists yet); None for an object store, which
        sets no bound of its own."""
        if not self._local:
            return None
        path = Path(self._root)
        while not path.exists() and path != path.parent:
            path = path.parent
        return shutil.disk_usage(path).total

    def outputs_cap_bytes(self, setting: int | None) -> int:
        """The pool's cap of one tenant's stored outputs (a tenant's own cap wins over it):
        `setting` (`tenant_outputs_max_bytes`) when given, else what this store can hold,
        else (an object store) `NO_CAP_BYTES`."""
        if setting is not None:
            return setting
        capacity = self.capacity_bytes()
        return NO_CAP_BYTES if capacity is None else capacity

    def _path(self, tenant_id: str, job_id: str, *parts: str) -> str:
        return posixpath.join(self._root, tenant_id, job_id, *parts)

    def _rel(self, tenant_id: str, job_id: str, *parts: str) -> str:
        """A path below the root, for the local walks that start at the root."""
        return posixpath.join(tenant_id, job_id, *parts)

    # -- writing (workers) ---------------------------------------------------------------

    def put_file(self, local: Path, tenant_id: str, job_id: str, rel: str, *,
                 base: Path | None = None) -> int:
        """Upload `local` atomically: to a temporary name beside the target, then renamed over
        it, so a reader (the next attempt loading a checkpoint) never sees half a file.

        No link at or below `base` (the directory the job was given; default: the file's own
        directory) is followed: a link, or a file that is not a regular file of one link,
        raises LinkRefused. Returns the number of bytes stored."""
        target = self._path(tenant_id, job_id, _safe(rel))
        where = base if base is not None else local.parent
        fd = open_beneath(str(where), local.relative_to(where).as_posix())
        with os.fdopen(fd, "rb") as src:
            parent = posixpath.dirname(target)
            self._fs.makedirs(parent, exist_ok=True)
            tmp = posixpath.join(parent, f"{TMP_PREFIX}{uuid.uuid4().hex[:12]}-"
                                         f"{posixpath.basename(target)}")
            try:
                with self._fs.open(tmp, "wb") as dst:
                    size = _copy(src, dst)
                self._fs.mv(tmp, target)
            except BaseException:
                with contextlib.suppress(Exception):
                    self._fs.rm(tmp)
                raise
        return size

    def put_tree(self, local_dir: Path, tenant_id: str, job_id: str,
                 prefix: str) -> list[dict[str, Any]]:
        """Copy every file under `local_dir` to `<prefix>/`; returns [{path, size}] sorted.
        Links and other files `scan_tree` refuses are not copied (the worker says so in the
        attempt's log)."""
        scan = scan_tree(local_dir)
        for refused in scan.refused:
            log.warning("artifact_refused job=%s where=%s path=%r reason=%s", job_id, prefix,
                        refused.path, refused.reason)
        files: list[dict[str, Any]] = []
        for rel in scan.files:
            try:
                size = self.put_file(local_dir / rel, tenant_id, job_id, f"{prefix}/{rel}",
                                     base=local_dir)
            except LinkRefused as exc:  # replaced by a link since the scan
                log.warning("artifact_refused job=%s where=%s %s", job_id, prefix, exc)
                continue
            files.append({"path": rel, "size": size})
        return files

    def get_tree(self, tenant_id: str, job_id: str, prefix: str, local_dir: Path) -> int:
        """Copy `<prefix>/` down into `local_dir`; returns the number of files. A link in the
        store is skipped, and nothing is written through a link in `local_dir`."""
        count = 0
        for rel in self._stored_files(tenant_id, job_id, prefix):
            with self._open_stored(tenant_id, job_id, f"{prefix}/{rel}") as src:
                local_dir.mkdir(parents=True, exist_ok=True)
                fd = create_beneath(str(local_dir), rel)
                with os.fdopen(fd, "wb") as dst:
                    _copy(src, dst)
            count += 1
        return count

    # -- reading (API) -------------------------------------------------------------------

    def list_outputs(self, tenant_id: str, job_id: str) -> list[dict[str, Any]]:
        if self._local:
            scan = scan_beneath(self._root, self._rel(tenant_id, job_id, "outputs"))
            return [{"path": rel, "size": st.st_size} for rel, st in scan.files.items()
                    if not posixpath.basename(rel).startswith(TMP_PREFIX)]
        base = self._path(tenant_id, job_id, "outputs")
        if not self._fs.exists(base):
            return []
        return [{"path": posixpath.relpath(p, base), "size": int(info.get("size") or 0)}
                for p, info in sorted(self._fs.find(base, detail=True).items())
                if not posixpath.basename(p).startswith(TMP_PREFIX)]

    def open_output(self, tenant_id: str, job_id: str, rel: str) -> IO[bytes]:
        """The output's bytes; NotFound for a missing file and for anything refused (a link),
        so an answer never tells a link from an absent file."""
        safe = _safe(rel)
        try:
            return self._open_stored(tenant_id, job_id, f"outputs/{safe}")
        except (LinkRefused, FileNotFoundError, NotADirectoryError) as exc:  # all alike: 404
            raise NotFound(f"job {job_id} has no output {rel!r}") from exc

    def log_sizes(self, tenant_id: str, job_id: str) -> dict[int, int]:
        """Each attempt's stored log size in bytes, by attempt number (links left out)."""
        if self._local:
            scan = scan_beneath(self._root, self._rel(tenant_id, job_id, "logs"))
            sizes = {name: st.st_size for name, st in scan.files.items()}
        else:
            base = self._path(tenant_id, job_id, "logs")
            sizes = ({posixpath.basename(info["name"]): int(info.get("size") or 0)
                      for info in self._fs.ls(base, detail=True)}
                     if self._fs.exists(base) else {})
        found = ((LOG_NAME.match(name), size) for name, size in sizes.items())
        return dict(sorted((int(m.group(1)), size) for m, size in found if m))

    def log_view(self, tenant_id: str, job_id: str, attempt: int | None) -> LogView:
        """One attempt's log, or (`attempt` None) every attempt's log in order, each under a
        `=== attempt N ===` line, as one range of bytes of the size they have now."""
        sizes = self.log_sizes(tenant_id, job_id)
        parts: tuple[LogPart, ...]
        if attempt is not None:
            parts = (LogPart(attempt, b"", sizes.get(attempt, 0)),)
        else:
            parts = tuple(LogPart(n, f"=== attempt {n} ===\n".encode(), size)
                          for n, size in sizes.items())
        return LogView(self, tenant_id, job_id, parts)

    def read_range(self, tenant_id: str, job_id: str, rel: str, offset: int,
                     length: int) -> Iterator[bytes]:
        """Up to `length` bytes of a stored file from `offset`, in blocks of at most
        COPY_CHUNK_BYTES, never the whole file at once; stops early at its end, and yields
        nothing for a missing file or a link."""
        try:
            f = self._open_stored(tenant_id, job_id, rel)
        except (LinkRefused, FileNotFoundError, NotADirectoryError):
            return
        with f:
            f.seek(offset)
            while length > 0:
                block = f.read(min(length, COPY_CHUNK_BYTES))
                if not block:
                    return
                length -= len(block)
                yield block

    # -- retention (e31 gc) ----------------------------------------------------------------

    def footprint(self, tenant_id: str, job_id: str) -> Footprint:
        """What the job keeps in the store: files and bytes, and the bytes of its outputs."""
        files, total, outputs = 0, 0, 0
        for rel, size in self._sizes(tenant_id, job_id):
            files += 1
            total += size
            if rel.startswith("outputs/"):
                outputs += size
        return Footprint(files=files, bytes=total, outputs_bytes=outputs)

    def remove_job(self, tenant_id: str, job_id: str) -> Footprint:
        """Remove every artifact of the job (outputs, logs, checkpoints); returns what was
        there. A local store removes the job's directory without following a link in it (a
        link is removed, never its target)."""
        found = self.footprint(tenant_id, job_id)
        if self._local:
            remove_beneath(self._root, self._rel(tenant_id, job_id))
        else:
            path = self._path(tenant_id, job_id)
            if self._fs.exists(path):
                self._fs.rm(path, recursive=True)
        return found

    def _sizes(self, tenant_id: str, job_id: str) -> Iterator[tuple[str, int]]:
        """(path below the job, size) of each stored file of the job; on a local store, links
        and other refused entries count as files of their own (`lstat`) size."""
        if self._local:
            scan = scan_beneath(self._root, self._rel(tenant_id, job_id))
            yield from ((rel, st.st_size) for rel, st in scan.files.items())
            yield from ((r.path, 0) for r in scan.refused)
            return
        base = self._path(tenant_id, job_id)
        if self._fs.exists(base):
            for p, info in self._fs.find(base, detail=True).items():
                yield posixpath.relpath(p, base), int(info.get("size") or 0)

    # -- local and remote, one way ---------------------------------------------------------

    def _stored_files(self, tenant_id: str, job_id: str, prefix: str) -> Iterator[str]:
        """The stored files under `prefix`, relative to it, without uploads in progress."""
        if self._local:
            scan = scan_beneath(self._root, self._rel(tenant_id, job_id, prefix))
            rels: list[str] = list(scan.files)
        else:
            base = self._path(tenant_id, job_id, prefix)
            # A key is a name, not a path: one holding `..` (put there by hand) is no file
            # of the job's, and must not become a path that climbs out of `local_dir`.
            rels = [r for r in ([posixpath.relpath(p, base) for p in self._fs.find(base)]
                                if self._fs.exists(base) else [])
                    if posixpath.normpath(r) == r and not r.startswith("../")]
        return (r for r in rels if not posixpath.basename(r).startswith(TMP_PREFIX))

    def _open_stored(self, tenant_id: str, job_id: str, rel: str) -> IO[bytes]:
        """A stored file for reading; on a local store, reached without following a link
        from the store's root down (LinkRefused, FileNotFoundError)."""
        if self._local:
            return os.fdopen(open_beneath(self._root, self._rel(tenant_id, job_id, rel)), "rb")
        path = self._path(tenant_id, job_id, rel)
        if not self._fs.isfile(path):
            raise FileNotFoundError(path)
        opened: IO[bytes] = self._fs.open(path, "rb", block_size=REMOTE_BLOCK_BYTES,
                                          cache_type="readahead")
        return opened


@dataclass(frozen=True)
class Footprint:
    """What one job keeps in the artifact store."""

    files: int
    bytes: int
    outputs_bytes: int


def _safe(rel: str) -> str:
    """A relative path that stays inside its job: no absolute paths, no `..`."""
    norm = posixpath.normpath(rel.replace("\\", "/"))
    if norm.startswith("/") or norm == ".." or norm.startswith("../"):
        raise NotFound(f"no such output {rel!r}")
    return norm


def _copy(src: IO[bytes], dst: IO[bytes]) -> int:
    size = 0
    while chunk := src.read(COPY_CHUNK_BYTES):
        dst.write(chunk)
        size += len(chunk)
    return size
