"""`GroupRegistry`: the job process groups a worker process has running, on disk.

The job's child dies with its worker (PDEATHSIG), but what the job started — data loader
workers, a `torchrun`, a shell's children — lives on in the job's process group, holding
its GPU. Each group is recorded in a file named for its id while it runs; a worker process
that starts and finds files left by a predecessor under the same node name kills those
groups, but only processes that still carry that job's `E31_JOB_ID` (a recycled process
group id of some other program is never touched).
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
from pathlib import Path

log = logging.getLogger(__name__)

PROC = Path("/proc")


class NodeLock:
    """An exclusive `flock` on `<node>.lock`, held by one worker process for its whole life.

    The kernel drops it when the process dies, however it dies, so a second process for the
    same node name is refused exactly while the first lives (draining included), and
    reaping a predecessor's groups is safe once the lock is ours.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._fd: int | None = None

    def acquire(self) -> int | None:
        """Take the lock; None when taken, else the pid of the process that holds it."""
        self._path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip()
            os.close(fd)
            return int(holder) if holder.isdigit() else 0
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        # A worker process never closes `fd`: the kernel releases the lock when it ends.
        self._fd = fd
        return None

    def release(self) -> None:
        """Give the lock back (a launcher that held it for a moment, to settle a dead worker
        process's node: e31_worker.node.release)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class GroupRegistry:
    def __init__(self, directory: Path) -> None:
        self._dir = directory

    def add(self, pgid: int, job_id: str) -> None:
        self._dir.mkdir(parents=True, exist_ok=True)
        (self._dir / str(pgid)).write_text(job_id)

    def remove(self, pgid: int) -> None:
        (self._dir / str(pgid)).unlink(missing_ok=True)

    def reap(self) -> int:
        """Kill what is left of groups recorded by a dead predecessor; returns processes killed.

        Call it only while holding the node's `NodeLock`: then no live process of this node
        can own a recorded group.
        """
        if not self._dir.is_dir():
            return 0
        killed = 0
        for entry in self._dir.iterdir():
            try:
                pgid, job_id = int(entry.name), entry.read_text().strip()
            except (ValueError, OSError):
                entry.unlink(missing_ok=True)
                continue
            here = 0
            for pid in _members(pgid, job_id):
                try:
                    os.kill(pid, signal.SIGKILL)
                    here += 1
                except ProcessLookupError:
                    pass
            if here:
                log.warning("orphans_killed job=%s pgid=%d processes=%d", job_id, pgid, here)
            killed += here
            entry.unlink(missing_ok=True)
        return killed


def _members(pgid: int, job_id: str) -> list[int]:
    """Live processes of group `pgid` whose environment names `job_id`."""
    marker = f"E31_JOB_ID={job_id}".encode()
    found = []
    for d in PROC.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
            if int(fields[2]) != pgid or fields[0] == "Z":
                continue
            if marker in (d / "environ").read_bytes().split(b"\0"):
                found.append(int(d.name))
        except (OSError, ValueError, IndexError):
            continue
    return found
