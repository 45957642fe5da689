"""The Linux calls of the warm start that Python's `os` has no word for, made through libc.

`libc` is loaded once, when the warm process imports this module (before it forks anything);
`check` turns a call's -1 into an `OSError` naming the call and the errno's text.
"""

from __future__ import annotations

import ctypes
import os

# include/uapi/linux/prctl.h
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38

libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.syscall.restype = ctypes.c_long


def prctl(option: int, value: int) -> None:
    check(libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0), f"prctl({option})")


def check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"warm start: {what}: {os.strerror(err)}")
