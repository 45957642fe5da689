"""The limits an attempt runs under: processes, memory, disk (docs/jobs.md, "Limits").

- Processes: the attempt's pids cgroup (`e31_worker.attempt.cgroups`) with `pids.max` =
  `attempt_pids_max`. Kernel-enforced: a fork or a thread past it fails with EAGAIN inside the
  job only; other jobs and the worker never notice.
- Memory: its memory cgroup's limit, `resources.mem_gb`, else the pool's `default_mem_gb`,
  else the host's memory (`/proc/meminfo` MemTotal) divided among its job slots: the worker
  processes `e31 worker` started on the host (one per GPU or GPU group, plus `--cpu-slots`).
  Kernel-enforced: past it the OOM killer ends the job (reason `oom`). The sandbox's `/tmp`
  and `/dev/shm` are tmpfs, whose pages the kernel charges to the cgroup of the process that
  wrote them: a job that fills them is out of memory, not of disk.
- Disk: what the job writes in its attempt's directory — `work` (scratch), `output`,
  `checkpoints`, and what it adds to `inputs` beyond what the pool staged there — at most
  `resources.disk_gb`, else the pool's `attempt_disk_gb` (`attempt_disk_max_gb` bounds what a
  job may ask; the API refuses more at submit). Watched (`DiskWatch`): the supervisor walks
  those trees every `DISK_CHECK_INTERVAL_S` or so, counting allocated blocks; past the limit
  the attempt is stopped like a timeout with reason `disk_quota`, and what it wrote is removed
  unshipped (`discard_writes`).

Which of them held for one attempt (`AttemptLimits`) is noted on the attempt by the isolation
stage (`attempts.limits`: `e31 status`, the API's `attempts[]`; e31_worker.attempt.isolation).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e31.core.spec import JobSpec
from e31.edge.settings import Settings

BYTES_PER_GB = 1024 ** 3
BLOCK_BYTES = 512                 # st_blocks counts 512-byte units, whatever the filesystem
MEMINFO = Path("/proc/meminfo")
DISK_CHECK_INTERVAL_S = 3.0       # between two walks of a running attempt's trees
DISK_WALK_COST_FACTOR = 20        # a walk that took t s waits at least 20 t (<= 5 % of a core)
DISK_WALK_MAX_ENTRIES = 1_000_000  # files and directories one attempt may hold: a walk stops
#                                    there, and an attempt past it is over its disk quota too


@dataclass(frozen=True)
class AttemptLimits:
    """The limits of one attempt; None: not applied (no cgroup, no such controller)."""

    pids_max: int | None = None
    mem_gb: float | None = None
    disk_gb: float | None = None
    network: str | None = None     # the job's network as the sandbox set it up; None: unknown

    @property
    def memory_max_bytes(self) -> int | None:
        return int(self.mem_gb * BYTES_PER_GB) if self.mem_gb else None

    @property
    def disk_max_bytes(self) -> int | None:
        return int(self.disk_gb * BYTES_PER_GB) if self.disk_gb else None

    def to_dict(self) -> dict[str, Any]:
        """As `attempts.limits` holds it; `network` only where known."""
        out: dict[str, Any] = {"pids_max": self.pids_max, "mem_gb": self.mem_gb,
                               "disk_gb": self.disk_gb}
        if self.network is not None:
            out["network"] = self.network
        return out


def host_memory_gb(meminfo: Path = MEMINFO) -> float | None:
    """The host's memory (MemTotal), or None where it cannot be read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / BYTES_PER_GB
    except (OSError, ValueError, IndexError):
        pass
    return None


def default_mem_gb(settings: Settings, host_slots: int, meminfo: Path = MEMINFO) -> float | None:
    """The memory of an attempt that asks no `resources.mem_gb`: the pool's `default_mem_gb`,
    else the host's memory shared evenly by its `host_slots` job slots (None: unknown)."""
    if settings.default_mem_gb is not None:
        return settings.default_mem_gb
    total = host_memory_gb(meminfo)
    return round(total / max(1, host_slots), 3) if total is not None else None


def attempt_limits(settings: Settings, spec: JobSpec, *, default_mem: float | None,
                   network: str | None = None) -> AttemptLimits:
    """The limits an attempt of `spec` is to run under on this worker (`default_mem`: its
    `default_mem_gb`, resolved once at start). A `disk_gb` over the pool's maximum (asked
    before an operator lowered it) gets the maximum."""
    asked = spec.resources.disk_gb
    return AttemptLimits(
        pids_max=settings.attempt_pids_max,
        mem_gb=spec.resources.mem_gb or default_mem,
        disk_gb=min(asked, settings.attempt_disk_max_gb) if asked else settings.attempt_disk_gb,
        network=network)


def tree_usage(root: Path, max_entries: int = DISK_WALK_MAX_ENTRIES) -> tuple[int, int]:
    """(bytes allocated, entries) under `root`, never through a link, stopping after
    `max_entries`; what vanishes or cannot be read during the walk counts nothing."""
    used, entries = 0, 0
    stack = [str(root)]
    while stack and entries < max_entries:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    entries += 1
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    used += st.st_blocks * BLOCK_BYTES
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(entry.path)
                    if entries >= max_entries:
                        break
        except OSError:
            continue
    return used, entries


class DiskWatch:
    """How much an attempt wrote to its writable trees, measured at most every
    `interval_s` (longer when the walk is slow); `over()` says when it passed `max_bytes`.
    `staged` are trees the pool filled before the start (its inputs): only what grows there
    beyond their size at the start counts."""

    def __init__(self, *, trees: Sequence[Path], staged: Sequence[Path], max_bytes: int,
                 interval_s: float = DISK_CHECK_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._trees, self._staged = list(trees), list(staged)
        self._max_bytes = max_bytes
        self._interval_s = interval_s
        self._clock = clock
        self._baseline = sum(tree_usage(t)[0] for t in self._staged)
        self._next = clock()
        self.used_bytes = 0
        self.entries = 0

    def over(self) -> bool:
        """Measure if it is time to; True when the attempt wrote more than its limit."""
        now = self._clock()
        if now < self._next:
            return False
        used, entries = self.measure()
        cost = self._clock() - now
        self._next = self._clock() + max(self._interval_s, cost * DISK_WALK_COST_FACTOR)
        return used > self._max_bytes or entries >= DISK_WALK_MAX_ENTRIES

    def measure(self) -> tuple[int, int]:
        used, entries = 0, 0
        for tree in self._trees:
            tree_used, tree_entries = tree_usage(tree, DISK_WALK_MAX_ENTRIES - entries)
            used, entries = used + tree_used, entries + tree_entries
        staged = 0
        for tree in self._staged:
            tree_used, tree_entries = tree_usage(tree, max(1, DISK_WALK_MAX_ENTRIES - entries))
            staged, entries = staged + tree_used, entries + tree_entries
        self.used_bytes = used + max(0, staged - self._baseline)
        self.entries = entries
        return self.used_bytes, entries


def discard_writes(trees: Sequence[Path]) -> None:
    """Remove everything in `trees` (an attempt over its disk quota: its scratch, outputs and
    checkpoints are not shipped) and leave them empty; a directory the job made read-only is
    made writable first, never through a link."""
    for tree in trees:
        if not tree.is_dir() or tree.is_symlink():
            continue
        for parent, dirs, _ in os.walk(tree):
            for name in dirs:
                path = os.path.join(parent, name)
                with contextlib.suppress(OSError):
                    if not os.path.islink(path):
                        os.chmod(path, stat.S_IMODE(os.lstat(path).st_mode) | stat.S_IRWXU)
        for entry in list(tree.iterdir()):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    entry.unlink()
