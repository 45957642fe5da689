"""The code stage: fetch a job's bundle once per machine, unpack it read-only.

Bundles are cached per host under `<work_dir>/.bundles/<hex>.tar`, shared by every worker
process of the host and bounded by `bundle_cache_max_bytes` (least recently used evicted
first: a use touches the file's mtime). A fetch downloads to a temporary name, checks the
hash and renames it into place, and the cache's index is changed only under an exclusive
`flock` of `.lock`, so two processes fetching at once never see half a bundle. A fetched
bundle is handed out as an open file: evicting it meanwhile cannot pull it from under a
reader.

`unpack` extracts with tarfile's `data` filter after `e31.core.bundles.tar_problems` (no path out,
no link out, no device), then takes the write bits off everything (`chmod a-w`), so the job's
code is read-only; `remove_tree` gives them back to a directory tree before removing it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import stat
import tarfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from e31.core.bundles import DIGEST, tar_problems
from e31.core.errors import SetupError, SetupTransient
from e31.core.records import Claim
from e31.edge.bundlestore import BundleStore
from e31.edge.settings import Settings
from e31_worker.attempt.plan import AttemptPlan
from e31_worker.attempt.services import AttemptServices
from e31_worker.attempt.stages import Attempt, Stage
from e31_worker.attempt.transient import is_transient

log = logging.getLogger(__name__)

CACHE_DIR = ".bundles"
LOCK_FILE = ".lock"
TMP_PREFIX = ".fetch-"
COPY_CHUNK_BYTES = 1024 * 1024
WRITE_BITS = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH


class CodeStage(Stage):
    """The code stage: the job's code bundle, if its spec names one, unpacked read-only into
    the attempt's `code` directory, where the job starts."""

    def setup(self, attempt: Attempt) -> None:
        stage_code(attempt.svc, attempt.claim, attempt.plan)


def stage_code(svc: AttemptServices, claim: Claim, plan: AttemptPlan) -> None:
    """Unpack the job's code bundle, if its spec names one, read-only into `plan.code_dir`
    (`SetupError` when it cannot be fetched or is refused)."""
    digest = claim.spec.code
    if digest is None:
        return
    store = BundleStore(svc.artifacts.url, svc.artifacts.storage_options)
    f, cached = cache_for(svc.settings).open(store, claim.tenant_id,
                                             digest)
    with f:
        unpack(f, plan.code_dir)
    log.info("code_staged job=%s attempt=%d bundle=%s cached=%s", claim.job_id, claim.attempt,
             digest, cached)


def cache_for(settings: Settings) -> BundleCache:
    """This host's bundle cache, as `settings` place and bound it."""
    return BundleCache(settings.resolved_work_dir / CACHE_DIR,
                       max_bytes=settings.bundle_cache_max_bytes)


class BundleCache:
    """One host's cache of bundles in `root`, at most `max_bytes` (0: keep none)."""

    def __init__(self, root: Path, *, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)   # releases the lock

    def _path(self, digest: str) -> Path:
        m = DIGEST.fullmatch(digest)
        if m is None:
            raise SetupError(f"not a bundle hash: {digest!r}")
        return self.root / f"{m.group(1)}.tar"

    def open(self, store: BundleStore, tenant_id: str, digest: str) -> tuple[IO[bytes], bool]:
        """The bundle `digest` of `tenant_id`, open for reading, and whether the cache held it
        (False: fetched from the store now)."""
        path = self._path(digest)
        with self._locked():
            held = _open_if_present(path)
        if held is not None:
            log.info("bundle_cache_hit bundle=%s", digest)
            return held, True
        tmp = self.root / f"{TMP_PREFIX}{uuid.uuid4().hex}"
        try:
            size = _download(store, tenant_id, digest, tmp)
            with self._locked():
                os.replace(tmp, path)
                opened = open(path, "rb")   # handed to the caller, who closes it
                self._evict(keep=path)
        finally:
            tmp.unlink(missing_ok=True)
        log.info("bundle_fetched bundle=%s bytes=%d", digest, size)
        return opened, False

    def _evict(self, *, keep: Path) -> None:
        """Remove the least recently used bundles until the cache is within its bound."""
        found = []
        for entry in os.scandir(self.root):
            if entry.name.endswith(".tar") and entry.is_file(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                found.append((st.st_mtime, entry.path, st.st_size))
        total = sum(size for _, _, size in found)
        for _, path, size in sorted(found):
            if total <= self.max_bytes:
                break
            if path == str(keep):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                total -= size
                log.info("bundle_evicted path=%s bytes=%d", path, size)


def _open_if_present(path: Path) -> IO[bytes] | None:
    """`path` open for reading, its use recorded (mtime: the eviction order); None if absent."""
    try:
        f = open(path, "rb")   # handed to the caller, who closes it
    except FileNotFoundError:
        return None
    os.utime(f.fileno())
    return f


def _download(store: BundleStore, tenant_id: str, digest: str, tmp: Path) -> int:
    """Copy the stored bundle to `tmp`, checking that its bytes have the hash they are kept
    under; returns its size."""
    h = hashlib.sha256()
    size = 0
    try:
        with store.open(tenant_id, digest) as src, open(tmp, "wb") as dst:
            while chunk := src.read(COPY_CHUNK_BYTES):
                h.update(chunk)
                dst.write(chunk)
                size += len(chunk)
    except FileNotFoundError as exc:
        raise SetupError(f"bundle {digest} is not in the store (removed since the job was "
                          "submitted?)") from exc
    except Exception as exc:   # the artifact store's (the pool's), of any backend
        if not is_transient(exc):
            raise
        raise SetupTransient(f"bundle {digest} cannot be fetched for now: {exc}") from exc
    if f"sha256:{h.hexdigest()}" != digest:
        raise SetupError(f"bundle {digest} in the store has another hash: refused")
    return size


def unpack(bundle: IO[bytes], dest: Path, *, read_only: bool = True) -> None:
    """Extract the open bundle into the new directory `dest`, then take every write bit off
    (`read_only`). A member that escapes `dest`, a link out, a hard link or a device refuses
    the whole bundle (`SetupError`) before anything is written."""
    problems = tar_problems(bundle)
    if problems:
        raise SetupError("bundle refused: " + "; ".join(problems))
    bundle.seek(0)
    dest.mkdir(parents=True, exist_ok=False)
    try:
        with tarfile.open(fileobj=bundle, mode="r:") as tar:
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise SetupError(f"bundle cannot be unpacked: {exc}") from exc
    if read_only:
        _chmod_tree(dest, lambda mode: mode & ~WRITE_BITS)


def remove_tree(root: Path) -> None:
    """Remove `root` and everything in it, read-only directories (an unpacked bundle)
    included; a missing `root` is fine."""
    if not root.exists():
        return
    with contextlib.suppress(OSError):
        _chmod_tree(root, lambda mode: mode | stat.S_IWUSR, dirs_only=True)
    shutil.rmtree(root, ignore_errors=True)


def _chmod_tree(root: Path, change: Callable[[int], int], *, dirs_only: bool = False) -> None:
    """Apply `change` (old mode -> new mode) to `root` and everything below it, never
    through a link. Directories are changed after their contents, so taking the write bit
    off a directory does not stop the walk."""
    for parent, dirs, files in os.walk(root, topdown=False):
        for name in (files if not dirs_only else []) + dirs:
            path = os.path.join(parent, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                continue
            os.chmod(path, change(stat.S_IMODE(st.st_mode)))
    st = os.lstat(root)
    os.chmod(root, change(stat.S_IMODE(st.st_mode)))
