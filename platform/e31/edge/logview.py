"""A job's logs as one range of bytes: each attempt's stored log in order, each under a
`=== attempt N ===` line, served in bounded chunks (the API answers one per request).

Layout below the job: `logs/attempt-N.log` (`log_name`); `ArtifactStore.log_view` takes a
view of the sizes the logs have now.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from e31.edge.artifacts import ArtifactStore

LOG_NAME = re.compile(r"^attempt-(\d+)\.log$")   # a stored log's file name, below logs/


def log_name(attempt: int) -> str:
    """Where attempt `attempt`'s log is stored, below its job."""
    return f"logs/attempt-{attempt}.log"


@dataclass(frozen=True)
class LogPart:
    """One attempt's log within a `LogView`: the line put before it and its stored size."""

    attempt: int
    header: bytes
    size_bytes: int


@dataclass(frozen=True)
class LogView:
    """A job's logs as one range of bytes, sized when the view was taken: `read` serves any
    part of it, streamed from the store (the API answers one bounded chunk of it per request)."""

    store: ArtifactStore
    tenant_id: str
    job_id: str
    parts: tuple[LogPart, ...]

    @property
    def size_bytes(self) -> int:
        return sum(len(p.header) + p.size_bytes for p in self.parts)

    def read(self, offset: int, length: int) -> Iterator[bytes]:
        """The bytes [offset, offset + length) of the view, in blocks. Stops early if a log
        is shorter than it was (removed meanwhile): what was sent is then all there is."""
        end = min(offset + length, self.size_bytes)
        pos = 0
        for part in self.parts:
            head_end = pos + len(part.header)
            if offset < head_end and pos < end:
                yield part.header[max(0, offset - pos):end - pos]
            start, stop = max(offset, head_end), min(end, head_end + part.size_bytes)
            if start < stop:
                sent = 0
                for block in self.store.read_range(self.tenant_id, self.job_id,
                                                     log_name(part.attempt), start - head_end,
                                                     stop - start):
                    sent += len(block)
                    yield block
                if sent < stop - start:
                    return
            pos = head_end + part.size_bytes
            if pos >= end:
                return
