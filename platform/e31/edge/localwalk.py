"""A job's local files, reached without following a link (docs/security.md).

A job decides what its directories hold, so a symbolic link (to `/proc/self/environ`, to the
store's database) or a hard link to a file outside must not make a worker upload, or the API
serve, the bytes of its target. Local files are therefore found with `lstat`, opened one
directory at a time with `O_NOFOLLOW`, and only a regular file with a single link is stored or
served (`refusal`); an opened file must also resolve beneath the directory it was looked up in.
The artifact store (`e31.edge.artifacts`) and the worker's shipping and inputs use these walks;
an object store has no links.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

from e31.core.errors import LinkRefused

log = logging.getLogger(__name__)

# Every local open passes NO_FOLLOW: a module attribute rather than a literal, so that a test
# can switch the protection off and show that its attack then succeeds.
NO_FOLLOW = os.O_NOFOLLOW
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO a job left behind must not hang the worker (it is refused after).
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC

SYMLINK = "symbolic link"
HARD_LINK = "hard link"
NOT_REGULAR = "not a regular file"
OUTSIDE = "resolves outside its directory"


def refusal(st: os.stat_result) -> str | None:
    """Why a file of this `lstat` status is neither stored nor served, or None when it may be:
    only a regular file with one link is a job's own file (a second link may be the store's
    database or a password file, hard-linked in by a job on the same filesystem)."""
    if stat.S_ISLNK(st.st_mode):
        return SYMLINK
    if not stat.S_ISREG(st.st_mode):
        return NOT_REGULAR
    if st.st_nlink > 1:
        return HARD_LINK
    return None


@dataclass(frozen=True)
class Refused:
    """A file of a job's directory that was not stored, and why."""

    path: str     # relative to the directory that was scanned
    reason: str   # SYMLINK, HARD_LINK, NOT_REGULAR, OUTSIDE

    def __str__(self) -> str:
        shown = self.path if self.path.isprintable() else repr(self.path)
        return f"{shown}: {self.reason}"


@dataclass
class TreeScan:
    """What a scan found: the files that may be stored or served (with their `lstat`), sorted
    by path, and what it refused."""

    files: dict[str, os.stat_result] = field(default_factory=dict)
    refused: list[Refused] = field(default_factory=list)


def scan_tree(local_dir: Path) -> TreeScan:
    """Every file under `local_dir`, found without following a link: a symbolic link (to a
    file or a directory), a hard link, a FIFO or a device is refused with its reason and never
    descended into. A missing directory is empty."""
    return scan_beneath(str(local_dir), "")


# -- the walk: one directory at a time, never through a link ------------------------

def _parts(rel: str) -> list[str]:
    return [p for p in rel.split("/") if p and p != "."]


def _open_dir_beneath(base: str, rel: str, *, make: bool = False) -> int:
    """A descriptor of the directory `base/rel`, each component below `base` opened with
    NO_FOLLOW relative to its parent (`base` itself is the operator's, and trusted); with
    `make`, missing components are created on the way."""
    fd = os.open(base, _DIR_FLAGS)
    try:
        for part in _parts(rel):
            if make:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, dir_fd=fd)
            try:
                child = os.open(part, _DIR_FLAGS | NO_FOLLOW, dir_fd=fd)
            except OSError as exc:
                _raise_if_link(exc, fd, part, rel)
                raise
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_beneath(base: str, rel: str) -> int:
    """A read-only descriptor of the file `base/rel`, reached without following a link below
    `base` and checked to be a regular file of one link that resolves beneath `base`;
    LinkRefused otherwise, FileNotFoundError when it is missing."""
    parts = _parts(rel)
    if not parts:
        raise LinkRefused(f"{rel!r}: {NOT_REGULAR}")
    dir_fd = _open_dir_beneath(base, "/".join(parts[:-1]))
    try:
        try:
            fd = os.open(parts[-1], _READ_FLAGS | NO_FOLLOW, dir_fd=dir_fd)
        except OSError as exc:
            _raise_if_link(exc, dir_fd, parts[-1], rel)
            raise
    finally:
        os.close(dir_fd)
    why = refusal(os.fstat(fd))
    if why is None and not _resolves_beneath(fd, base):
        why = OUTSIDE
    if why is not None:
        os.close(fd)
        raise LinkRefused(str(Refused(rel, why)))
    return fd


def create_beneath(base: str, rel: str) -> int:
    """A new file `base/rel` for writing (directories made as needed), created without
    following a link below `base`: an existing name is replaced, never written through."""
    parts = _parts(rel)
    fd = _open_dir_beneath(base, "/".join(parts[:-1]), make=True)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(parts[-1], dir_fd=fd)
        return os.open(parts[-1], _CREATE_FLAGS | NO_FOLLOW, 0o666, dir_fd=fd)
    finally:
        os.close(fd)


def remove_beneath(base: str, rel: str) -> None:
    """Remove the directory `base/rel` and all below it, reached without following a link
    below `base` (a link there is refused, and nothing is removed through it); the removal
    itself is `shutil.rmtree`'s descriptor-based walk, which unlinks a link and never
    descends into one. A missing directory is nothing to do."""
    parts = _parts(rel)
    try:
        parent = _open_dir_beneath(base, "/".join(parts[:-1]))
    except (FileNotFoundError, NotADirectoryError):
        return
    try:
        st = os.lstat(parts[-1], dir_fd=parent)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            os.unlink(parts[-1], dir_fd=parent)
        else:
            shutil.rmtree(parts[-1], dir_fd=parent)
    except FileNotFoundError:
        return
    finally:
        os.close(parent)


def _raise_if_link(exc: OSError, dir_fd: int, name: str, rel: str) -> None:
    """Turn the error of an O_NOFOLLOW open into LinkRefused when `name` is a link (ELOOP for
    a file, ENOTDIR for a directory); other errors are left to the caller."""
    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
        return
    try:
        is_link = stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
    except OSError:
        return
    if is_link:
        raise LinkRefused(str(Refused(rel, SYMLINK))) from exc


def _resolves_beneath(fd: int, base: str) -> bool:
    """The resolved-path check: the opened file's real path lies beneath `base`'s. Without
    /proc (not Linux) the descriptor walk above is the whole check."""
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return True
    root = os.path.realpath(base).rstrip("/")
    return real.startswith(root + "/")


def scan_beneath(base: str, rel: str) -> TreeScan:
    """`scan_tree` of `base/rel`, reaching `rel` without following a link below `base`; a
    missing directory, or one that is a link, is empty."""
    scan = TreeScan()
    try:
        fd = _open_dir_beneath(base, rel)
    except LinkRefused as exc:
        log.warning("artifact_refused %s", exc)
        return scan
    except (FileNotFoundError, NotADirectoryError):
        return scan
    try:
        _walk(fd, "", scan)
    finally:
        os.close(fd)
    scan.files = dict(sorted(scan.files.items()))
    return scan


def _walk(dir_fd: int, prefix: str, scan: TreeScan) -> None:
    with os.scandir(dir_fd) as entries:
        found = sorted(entries, key=lambda e: e.name)
    for entry in found:
        rel = prefix + entry.name
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:  # removed while we looked
            continue
        if stat.S_ISDIR(st.st_mode):
            try:
                child = os.open(entry.name, _DIR_FLAGS | NO_FOLLOW, dir_fd=dir_fd)
            except FileNotFoundError:
                continue
            except OSError:  # replaced by a link or a file since the lstat
                scan.refused.append(Refused(rel, SYMLINK))
                continue
            try:
                _walk(child, rel + "/", scan)
            finally:
                os.close(child)
            continue
        why = refusal(st)
        if why is None:
            scan.files[rel] = st
        else:
            scan.refused.append(Refused(rel, why))
