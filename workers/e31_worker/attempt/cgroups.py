"""A memory cgroup per job attempt, where the worker may create one (Linux, v1 or v2).

It gives three things a process group cannot: the kernel's OOM kills are counted per job
(so an attempt the OOM killer ended is reported as `oom`, not as a mystery SIGKILL), the
job's host memory can be capped (`resources.mem_gb`), and every process of the job —
including one that left its process group with `setsid` — is found and killed at the end.

Without permission to create cgroups (an unprivileged worker, a cgroup v2 tree without
delegation) `JobCgroups.create` returns None and jobs run as before, in their process group.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
KILL_WAIT_S = 2.0          # how long `remove` waits for killed processes to leave the cgroup
_OOM_KILL = re.compile(r"^oom_kill (\d+)$", re.MULTILINE)
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True)
class Layout:
    """Where job cgroups go: `parent` (the worker's own memory cgroup) and the file names."""

    parent: Path
    version: int              # 1 or 2

    @property
    def limit_file(self) -> str:
        return "memory.limit_in_bytes" if self.version == 1 else "memory.max"

    @property
    def events_file(self) -> str:
        return "memory.oom_control" if self.version == 1 else "memory.events"


def detect(root: Path = CGROUP_ROOT,
           proc_cgroup: Path = Path("/proc/self/cgroup")) -> Layout | None:
    """The memory cgroup this process lives in, or None where there is none to use."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(",") and (root / "memory").is_dir():
            return Layout(parent=root / "memory" / path.lstrip("/"), version=1)
    for line in lines:
        if line.startswith("0::") and (root / "cgroup.controllers").is_file():
            return Layout(parent=root / line[3:].lstrip("/"), version=2)
    return None


class JobCgroup:
    """One attempt's cgroup."""

    def __init__(self, path: Path, layout: Layout) -> None:
        self.path = path
        self._layout = layout

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def oom_kills(self) -> int:
        """Processes of this job the kernel's OOM killer ended."""
        try:
            match = _OOM_KILL.search((self.path / self._layout.events_file).read_text())
        except OSError:
            return 0
        return int(match.group(1)) if match else 0

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def kill_all(self) -> None:
        """SIGKILL every process still in the cgroup, wherever its process group is."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def remove(self) -> None:
        """Kill what is left and delete the cgroup."""
        deadline = time.monotonic() + KILL_WAIT_S
        while True:
            self.kill_all()
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as exc:  # busy until the killed processes are reaped
                if time.monotonic() >= deadline:
                    log.warning("cgroup_remove_failed path=%s: %s", self.path, exc)
                    return
                time.sleep(0.05)


class JobCgroups:
    """Creates the job cgroups of one worker node, under a directory named for it."""

    def __init__(self, layout: Layout, node: str) -> None:
        self._layout = layout
        self._base = layout.parent / f"e31-{_UNSAFE.sub('_', node)}"

    @classmethod
    def for_node(cls, node: str) -> JobCgroups | None:
        """The node's cgroups where this process may create them, else None (said once in the
        log)."""
        layout = detect()
        if layout is None:
            log.info("cgroups_unavailable node=%s: no memory cgroup; jobs run in process groups "
                     "only", node)
            return None
        groups = cls(layout, node)
        try:
            groups._base.mkdir(exist_ok=True)
            if layout.version == 2:
                (groups._base / "cgroup.subtree_control").write_text("+memory")
        except OSError as exc:
            log.info("cgroups_unavailable node=%s path=%s: %s; jobs run in process groups only",
                     node, groups._base, exc)
            return None
        return groups

    def create(self, job_id: str, attempt: int, *,
               memory_max_bytes: int | None) -> JobCgroup | None:
        path = self._base / f"{_UNSAFE.sub('_', job_id)}-a{attempt}"
        try:
            path.mkdir(exist_ok=True)
            if memory_max_bytes is not None:
                (path / self._layout.limit_file).write_text(str(memory_max_bytes))
                if self._layout.version == 1:  # v1 caps swap separately; without it, no OOM kill
                    try:
                        (path / "memory.memsw.limit_in_bytes").write_text(str(memory_max_bytes))
                    except OSError:
                        pass
        except OSError as exc:
            log.warning("cgroup_create_failed job=%s path=%s: %s", job_id, path, exc)
            return None
        return JobCgroup(path, self._layout)

    def reap(self) -> int:
        """Kill the processes of job cgroups a dead predecessor left behind, and remove them."""
        count = 0
        left = sorted(p for p in self._base.iterdir() if p.is_dir()) if self._base.is_dir() else []
        for path in left:
            group = JobCgroup(path, self._layout)
            if group.pids():
                log.warning("cgroup_orphans path=%s pids=%s: killed", path, group.pids())
            group.remove()
            count += 1
        return count
