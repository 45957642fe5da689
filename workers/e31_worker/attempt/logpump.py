"""An attempt's log: its child's output, copied from the pipe into `attempt.log` up to the
attempt's cap (`AttemptPlan.log_limit`), with a line that says where and why it was cut.
"""

from __future__ import annotations

import os
import select
import threading
import time
from pathlib import Path

POLL_S = 0.1                  # the log pump's longest wait for output
LOG_CHUNK_BYTES = 64 * 1024
LOG_DRAIN_S = 2.0             # output still read after the attempt ends


def pump_log(fd: int, path: Path, max_bytes: int, cut_note: str,
             done: threading.Event) -> None:
    """Copy the child's output to the log up to `max_bytes`, then write `cut_note` and
    discard the rest.

    Reads until EOF, or until LOG_DRAIN_S after `done` (the attempt is over): a process that
    escaped the group and kept the pipe open must not keep this thread and its files alive.
    """
    written = 0
    cut = False
    drain_until: float | None = None
    poller = select.poll()  # not select.select: that fails for descriptors >= 1024
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    with open(path, "ab") as out:
        while True:
            if done.is_set() and drain_until is None:
                drain_until = time.monotonic() + LOG_DRAIN_S
            if drain_until is not None and time.monotonic() >= drain_until:
                return
            if not poller.poll(POLL_S * 1000):
                continue
            chunk = os.read(fd, LOG_CHUNK_BYTES)
            if not chunk:
                return
            if cut:
                continue
            room = max_bytes - written
            out.write(chunk[:room])
            written += min(len(chunk), room)
            if len(chunk) > room:
                out.write(cut_note.encode())
                cut = True
            out.flush()


def read_available(fd: int, max_bytes: int) -> str:
    """What a pipe holds now, up to `max_bytes` (the last ones), without waiting."""
    os.set_blocking(fd, False)
    data = b""
    try:
        while chunk := os.read(fd, 65536):
            data = (data + chunk)[-max_bytes:]
    except BlockingIOError:
        pass
    return data.decode(errors="replace")
