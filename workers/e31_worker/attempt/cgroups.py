"""A memory and a pids cgroup per job attempt, where the worker may create them (Linux, v1
or v2).

They give what a process group cannot: the kernel's OOM kills are counted per job (so an
attempt the OOM killer ended is reported as `oom`, not as a mystery SIGKILL), the job's host
memory is capped (`resources.mem_gb`, else the pool's default: e31_worker.attempt.attemptlimits),
its processes and threads are capped (`pids.max` = `attempt_pids_max`: a fork past it fails
with EAGAIN inside the job, nothing else on the host notices), and every process of the job
— including one that left its process group with `setsid` — is found and killed at the end.

Where: v1 has one hierarchy per controller, so an attempt has two directories,
`<memory>/<worker's memory cgroup>/e31-<node>-<place>/<job>-a<n>` and the same under the pids
hierarchy (the worker's pids cgroup); its processes join both (`procs_files`). v2 has one
directory with `memory` and `pids` enabled in the node directory's `cgroup.subtree_control`.
`<place>` names where the node's worker keeps its work (a hash of its `work_dir`): a worker
that starts again reaps what its predecessor left in its own directory, and never the live
jobs of another stack on the same host whose node has the same name (two `e31 up` on one
machine both serve `cpu0@<host>`).

Without permission to create cgroups (an unprivileged worker, a cgroup v2 tree without
delegation) `JobCgroups.create` returns None and jobs run as before, in their process group;
without a pids controller the attempt gets a memory cgroup only (said once in the log, and
its recorded limits show `pids_max` null).
"""

from __future__ import annotations

import contextlib
import hashlib
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
REMOVE_FIRST_PAUSE_S, REMOVE_MAX_PAUSE_S = 0.001, 0.05   # `remove`'s pauses between tries
_OOM_KILL = re.compile(r"^oom_kill (\d+)$", re.MULTILINE)
_PIDS_MAX_HIT = re.compile(r"^max (\d+)$", re.MULTILINE)   # pids.events: forks refused
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True)
class Layout:
    """Where job cgroups go: `parent` (the worker's own memory cgroup), `pids_parent` (its
    pids cgroup: v1 another hierarchy, v2 the same directory; None without the controller)
    and the file names."""

    parent: Path
    version: int              # 1 or 2
    pids_parent: Path | None = None

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
    v1 = {}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for name in ("memory", "pids"):
            if name in controllers.split(",") and (root / name).is_dir():
                v1[name] = root / name / path.lstrip("/")
    if "memory" in v1:
        return Layout(parent=v1["memory"], version=1, pids_parent=v1.get("pids"))
    for line in lines:
        if line.startswith("0::") and (root / "cgroup.controllers").is_file():
            parent = root / line[3:].lstrip("/")
            return Layout(parent=parent, version=2, pids_parent=parent)
    return None


class JobCgroup:
    """One attempt's cgroup: its memory directory `path` and, in v1, its pids directory
    `pids_path` (v2: the same directory). `memory_max_bytes` and `pids_max` are the limits
    that were written (None: not applied)."""

    def __init__(self, path: Path, layout: Layout, *, pids_path: Path | None = None,
                 memory_max_bytes: int | None = None, pids_max: int | None = None) -> None:
        self.path = path
        self.pids_path = pids_path
        self.memory_max_bytes = memory_max_bytes
        self.pids_max = pids_max
        self._layout = layout

    @property
    def procs_files(self) -> list[Path]:
        """The `cgroup.procs` files a process of the attempt joins (one per hierarchy)."""
        dirs = [self.path] + ([self.pids_path] if self.pids_path not in (None, self.path) else [])
        return [d / "cgroup.procs" for d in dirs if d is not None]

    def add(self, pid: int) -> None:
        for procs in self.procs_files:
            procs.write_text(str(pid))

    def forks_refused(self) -> int:
        """Forks of this job the kernel refused at its `pids.max`."""
        if self.pids_path is None:
            return 0
        try:
            match = _PIDS_MAX_HIT.search((self.pids_path / "pids.events").read_text())
        except OSError:
            return 0
        return int(match.group(1)) if match else 0

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
        """Kill what is left and delete the cgroup (both directories in v1)."""
        deadline = time.monotonic() + KILL_WAIT_S
        for path in [p.parent for p in self.procs_files]:
            pause = REMOVE_FIRST_PAUSE_S
            while True:
                self.kill_all()
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:  # busy until the killed processes are reaped
                    if time.monotonic() >= deadline:
                        log.warning("cgroup_remove_failed path=%s: %s", path, exc)
                        break
                    # Usually a process that ended with the job and is reaped a millisecond
                    # or two later: a fixed 50 ms pause cost every job up to 50 ms of its
                    # slot. v1 has no event for "empty" to wait on.
                    time.sleep(pause)
                    pause = min(2 * pause, REMOVE_MAX_PAUSE_S)


def stack_place(work_dir: Path) -> str:
    """What tells a node's cgroup directory from another stack's node of the same name on the
    host (two `e31 up` homes both name theirs `cpu0@host`): a hash of the stack's work_dir, so
    that reaping one never kills the other's jobs."""
    return hashlib.sha256(str(work_dir).encode()).hexdigest()[:8]


class JobCgroups:
    """Creates the job cgroups of one worker node, under a directory named for it."""

    def __init__(self, layout: Layout, node: str, *, place: str = "") -> None:
        self._layout = layout
        name = f"e31-{_UNSAFE.sub('_', node)}" + (f"-{_UNSAFE.sub('_', place)}" if place else "")
        self._base = layout.parent / name
        # Where the attempts' pids cgroups go; None until `for_node` enabled the controller.
        self._pids_base: Path | None = None
        self._pids_candidate = (layout.pids_parent / name if layout.pids_parent is not None
                                else None)

    @classmethod
    def for_node(cls, node: str, layout: Layout | None = None, *,
                 place: str = "") -> JobCgroups | None:
        """The node's cgroups where this process may create them, else None (said once in the
        log); under `layout`, else this process's own cgroups (`detect`); `place` tells this
        node's directory from another stack's node of the same name (the module says how)."""
        layout = layout or detect()
        if layout is None:
            log.info("cgroups_unavailable node=%s: no memory cgroup; jobs run in process groups "
                     "only", node)
            return None
        groups = cls(layout, node, place=place)
        try:
            groups._base.mkdir(exist_ok=True)
            if layout.version == 2:
                (groups._base / "cgroup.subtree_control").write_text("+memory")
        except OSError as exc:
            log.info("cgroups_unavailable node=%s path=%s: %s; jobs run in process groups only",
                     node, groups._base, exc)
            return None
        groups._enable_pids(node)
        return groups

    @property
    def caps_pids(self) -> bool:
        """Whether the attempts' processes can be capped (a pids controller was found)."""
        return self._pids_base is not None

    def _enable_pids(self, node: str) -> None:
        candidate = self._pids_candidate
        try:
            if candidate is None:
                raise OSError("no pids controller")
            if self._layout.version == 1:
                candidate.mkdir(exist_ok=True)
            else:
                (candidate / "cgroup.subtree_control").write_text("+pids")
        except OSError as exc:
            log.info("pids_cgroup_unavailable node=%s: %s; attempts' processes are not capped",
                     node, exc)
            return
        self._pids_base = candidate

    def create(self, job_id: str, attempt: int, *, memory_max_bytes: int | None,
               pids_max: int | None = None) -> JobCgroup | None:
        """The attempt's cgroup with its limits written; None when even its memory directory
        cannot be made. A pids limit that cannot be applied leaves `pids_max` None."""
        name = f"{_UNSAFE.sub('_', job_id)}-a{attempt}"
        path = self._base / name
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
        pids_path = None
        if pids_max is not None and self._pids_base is not None:
            pids_path = self._pids_base / name if self._layout.version == 1 else path
            try:
                pids_path.mkdir(exist_ok=True)
                (pids_path / "pids.max").write_text(str(pids_max))
            except OSError as exc:
                log.warning("pids_cgroup_failed job=%s path=%s: %s; its processes are not "
                            "capped", job_id, pids_path, exc)
                if pids_path != path:
                    with contextlib.suppress(OSError):
                        pids_path.rmdir()
                pids_path = None
        return JobCgroup(path, self._layout, pids_path=pids_path,
                         memory_max_bytes=memory_max_bytes,
                         pids_max=pids_max if pids_path is not None else None)

    def reap(self) -> int:
        """Kill the processes of job cgroups a dead predecessor left behind, and remove them."""
        count = 0
        bases = [b for b in (self._base, self._pids_base) if b is not None and b.is_dir()]
        left = sorted(p for b in dict.fromkeys(bases) for p in b.iterdir() if p.is_dir())
        for path in left:
            group = JobCgroup(path, self._layout)
            if group.pids():
                log.warning("cgroup_orphans path=%s pids=%s: killed", path, group.pids())
            group.remove()
            count += 1
        return count
