"""`EnvCache`: one host's built job environments, each built once and shared by every worker
process of the host, held while a job uses it, and evicted least recently used first.

Layout of the cache's directory (`<work_dir>/.envs`, docs/operations.md):
  <key>/               a built environment, with its record `e31-env.json`
  <key>.lock           flock: exclusive while it is built or removed, shared while a job uses it
  .build-<key>-<rand>/ a build in progress; its `env` is renamed to <key> when complete
  .trash-<key>-<pid>/  an evicted environment on its way out

An environment seen complete under the shared lock stays until that lock is dropped: removal
takes the exclusive lock. A build happens under the exclusive lock, in a private directory
renamed into place whole, so no process ever sees half an environment, and two processes
asking for the same key build it once. What and how to build is the caller's (`build`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

RECORD = "e31-env.json"        # in a built environment: what it holds, when it was built
LOCK_POLL_S = 0.2              # how often a wait for another process's build looks again

Beat = Callable[[], None]      # called every beat while setup waits; raises to stop it
# Builds an environment into `<scratch>/env` and returns its record (what it holds).
Build = Callable[[Path], dict[str, Any]]


@dataclass
class JobEnv:
    """A built environment a job uses: held (a shared lock) until `release`."""

    key: str
    path: Path
    built: bool                          # built for this job; False: reused from the cache
    record: dict[str, Any]
    _fd: int | None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)           # drops the shared lock: the cache may remove it now
            self._fd = None


class EnvCache:
    """The environments in `root`, at most `max_bytes` of them beyond those in use."""

    def __init__(self, root: Path, *, max_bytes: int, beat_s: float) -> None:
        self._root = root
        self._max_bytes = max_bytes
        self._beat_s = beat_s

    def acquire(self, key: str, build: Build, *, beat: Beat) -> JobEnv:
        """The environment `key`, built with `build` unless the cache holds it, and held until
        released. `beat` is called while this waits for another process's build of it."""
        self._root.mkdir(parents=True, exist_ok=True, mode=0o755)
        path = self._root / key
        built = False
        fd = self._open_lock(key)
        try:
            while True:
                self._lock(fd, fcntl.LOCK_SH, beat)
                if (path / RECORD).is_file():
                    os.utime(path)       # its last use: the cache evicts the oldest first
                    break
                fcntl.flock(fd, fcntl.LOCK_UN)
                self._lock(fd, fcntl.LOCK_EX, beat)
                if not (path / RECORD).is_file():   # nobody built it while this waited
                    self._build(key, build)
                    built = True
                fcntl.flock(fd, fcntl.LOCK_UN)      # and take it shared, as any user does
        except BaseException:
            os.close(fd)
            raise
        env = JobEnv(key=key, path=path, built=built, record=read_record(path), _fd=fd)
        if built:
            self.evict(keep=key)
        return env

    def evict(self, *, keep: str | None = None) -> list[str]:
        """Remove the least recently used environments no job holds, and what dead builds
        left, until the cache fits in `max_bytes`; returns the keys removed."""
        entries: list[tuple[float, str, int]] = []
        for path in self._root.iterdir():
            if path.name.startswith((".build-", ".trash-")) and path.is_dir():
                with self._free(path.name.split("-")[1]) as free:
                    if free:
                        shutil.rmtree(path, ignore_errors=True)
            elif path.is_dir() and (path / RECORD).is_file():
                size = int(read_record(path).get("size_bytes") or 0)
                entries.append((path.stat().st_mtime, path.name, size))
        total = sum(size for _, _, size in entries)
        removed: list[str] = []
        for _, key, size in sorted(entries):
            if total <= self._max_bytes:
                break
            if key == keep:
                continue
            with self._free(key) as free:
                if free and (self._root / key / RECORD).is_file():
                    trash = self._root / f".trash-{key}-{os.getpid()}"
                    os.rename(self._root / key, trash)  # gone at once, however long rmtree takes
                    shutil.rmtree(trash, ignore_errors=True)
                    total -= size
                    removed.append(key)
                    log.info("env_evicted key=%s size_bytes=%d", key, size)
        return removed

    def _open_lock(self, key: str) -> int:
        return os.open(self._root / f"{key}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)

    @contextlib.contextmanager
    def _free(self, key: str) -> Iterator[bool]:
        """Whether `key`'s exclusive lock could be taken at once (no job uses it, no build)."""
        fd = self._open_lock(key)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)

    def _lock(self, fd: int, kind: int, beat: Beat) -> None:
        """Take `kind` on `fd`, beating while another process builds."""
        next_beat = time.monotonic() + self._beat_s
        while True:
            try:
                fcntl.flock(fd, kind | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= next_beat:
                    beat()
                    next_beat = time.monotonic() + self._beat_s
                time.sleep(LOCK_POLL_S)

    def _build(self, key: str, build: Build) -> None:
        """Build `key` in a private directory, then rename it into place whole."""
        scratch = Path(tempfile.mkdtemp(prefix=f".build-{key}-", dir=self._root))
        try:
            record = build(scratch)
            env = scratch / "env"
            _make_readable(env)
            record.update(key=key, size_bytes=disk_bytes(env))
            (env / RECORD).write_text(json.dumps(record, indent=1) + "\n")
            os.rename(env, self._root / key)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def read_record(path: Path) -> dict[str, Any]:
    """The record of the environment at `path`; empty when it has none."""
    try:
        data = json.loads((path / RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def disk_bytes(root: Path) -> int:
    """The disk space under `root`, each file once, links not followed."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def _make_readable(root: Path) -> None:
    """Everyone may read and run the environment (a sandboxed job runs as another user);
    nobody but the worker may change it."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                continue
            extra = stat.S_IRGRP | stat.S_IROTH
            if stat.S_ISDIR(st.st_mode) or st.st_mode & stat.S_IXUSR:
                extra |= stat.S_IXGRP | stat.S_IXOTH
            os.chmod(path, (stat.S_IMODE(st.st_mode) | extra) & ~(stat.S_IWGRP | stat.S_IWOTH))
    os.chmod(root, 0o755)
