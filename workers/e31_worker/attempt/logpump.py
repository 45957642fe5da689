"""An attempt's log: its child's output, copied from the pipe into `attempt.log` up to the
attempt's cap (`AttemptPlan.log_limit`), with a line that says where and why it was cut.

The pump is a thread of the worker process (one per running attempt). It must not die
alone: the child would block on a full pipe and look hung. A write to the log that fails
(a full disk's ENOSPC, or anything unexpected) is logged `log_pump_error` and that output
is dropped; the pump goes on reading the pipe (and writes again once it can), so the child
never blocks on its own output.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)

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
    failing = False   # the last write failed (said once per run of failures)
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
            data = chunk[:room] + (cut_note.encode() if len(chunk) > room else b"")
            try:
                _append(out, data)
            except Exception as exc:  # noqa: BLE001 - module docstring: read on, never die
                if not failing:
                    log.warning("log_pump_error log=%s: %s: %s; its output is dropped until "
                                "the log can be written again", path, type(exc).__name__, exc)
                failing = True
                continue
            failing = False
            written += min(len(chunk), room)
            cut = len(chunk) > room


def _append(out: BinaryIO, data: bytes) -> None:
    """Write `data` to the log and flush it (readers follow the file as it grows)."""
    out.write(data)
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
