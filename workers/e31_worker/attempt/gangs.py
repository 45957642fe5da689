"""A gang host's GPU ledger: which attempt holds which GPU, checked at every claim.

A gang worker (`e31 worker --gangs`, docs/scheduling.md "Gangs on demand") pins no GPU: the
scheduler's dispatch names the GPUs a job is given, and the worker takes them here before it
claims the job. The ledger is one small JSON file per host under the work directory, read
and written under an exclusive `flock`, so the worker processes of one host never hand a GPU
to two attempts at once, whatever the scheduler or the broker did (a stale dispatch, a
duplicated message). An entry whose process is gone is free: a worker that died holds
nothing (its job's process group is reaped by the `GroupRegistry`, as for any worker).
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class GpuLedger:
    """The ledger of one host's GPUs, shared by its gang worker processes."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = path.with_name(path.name + ".lock")

    def take(self, gpus: Sequence[str], job_id: str, pid: int | None = None) -> list[str]:
        """Hold `gpus` for `job_id` (by process `pid`, this one by default) if none of them is
        held by a live process; returns the GPUs that were held (nothing taken then), [] when
        taken."""
        pid = os.getpid() if pid is None else pid
        with self._locked() as entries:
            busy = [g for g in gpus if g in entries and _alive(entries[g]["pid"])]
            if not busy:
                for g in gpus:
                    entries[g] = {"job": job_id, "pid": pid}
            return busy

    def give_back(self, gpus: Sequence[str], job_id: str) -> None:
        """Free the GPUs `job_id` holds."""
        with self._locked() as entries:
            for g in gpus:
                if entries.get(g, {}).get("job") == job_id:
                    del entries[g]

    def holders(self) -> dict[str, str]:
        """GPU index -> the job holding it, live entries only."""
        with self._locked() as entries:
            return {g: e["job"] for g, e in entries.items() if _alive(e["pid"])}

    @contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._lock, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                try:
                    entries = json.loads(self._path.read_text() or "{}")
                except (FileNotFoundError, ValueError):
                    entries = {}
                entries = {g: e for g, e in entries.items() if _alive(e.get("pid", 0))}
                yield entries
                tmp = self._path.with_name(self._path.name + ".tmp")
                tmp.write_text(json.dumps(entries))
                os.replace(tmp, self._path)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ledger_for(work_dir: Path, host: str) -> GpuLedger:
    """The ledger of `host`'s GPUs under the workers' scratch space."""
    return GpuLedger(work_dir / ".groups" / f"gpus@{host}.json")
