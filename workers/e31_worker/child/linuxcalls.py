"""The Linux calls of the warm start that Python's `os` has no word for, made through libc.

`libc` is loaded once, when the warm process imports this module (before it forks anything);
`check` turns a call's -1 into an `OSError` naming the call and the errno's text.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable

# include/uapi/linux/prctl.h
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38

libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.syscall.restype = ctypes.c_long


def prctl(option: int, value: int) -> None:
    check(libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0), f"prctl({option})")


def check(result: int, what: str, *, context: str = "warm start") -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{context}: {what}: {os.strerror(err)}")


def join_cgroups(procs_files: Iterable[str | bytes]) -> None:
    """Move this process into each cgroup whose `cgroup.procs` file is given (one per
    hierarchy in cgroup v1: memory, pids). Raw writes: safe between a fork and an exec."""
    for path in procs_files:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)
