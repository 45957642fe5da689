"""Sending a call's bundles through the client's one bundle path (`e31.client.bundle`): the
code (the caller's local modules) and the call (the function's envelope and the items' calls).

Both are ordinary bundles, content-addressed: the same code or the same call again uploads
nothing (`HEAD` finds it). The items' calls go as few bundles as their size allows: one entry
`args.pkl` per bundle holding up to `CALL_BUNDLE_MAX_BYTES` of them, the first bundle also
holding `function.pkl`; so a map of 10,000 small items is one upload, and a job unpacks no
more than one group of its neighbours' arguments.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from e31.client.bundle import Packed, Sent, pack, upload
from e31.core.bundles import bundle_input
from e31.core.functioncalls import ARGS_FILE, FUNCTION_FILE
from e31.functions.calls import calls_file
from e31.functions.modules import Needs, staged

if TYPE_CHECKING:
    from e31.client.client import Client

# One bundle of calls: every job of its items unpacks it whole, so it stays small next to a
# job's own work; tiny items of a 10,000-item map still fit in one.
CALL_BUNDLE_MAX_BYTES = 8 * 1024 ** 2


@dataclass
class Sending:
    """What a call's jobs name: the code bundle, the envelope's input, and per item its
    calls' input and its index there; with every bundle it needed (`sent`)."""

    code: str | None = None
    function_source: str = ""
    item_sources: list[tuple[str, int]] = field(default_factory=list)
    sent: list[Sent] = field(default_factory=list)


def send_code(client: Client, needs: Needs, sending: Sending) -> None:
    """Pack and send the local modules, when there are any, as the jobs' code."""
    if not needs.files:
        return
    root = staged(needs.files)
    try:
        packed = pack(root, max_bytes=client.bundle_max_bytes, field_name="code",
                      ignore_files=False)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    sending.sent.append(_upload(client, packed, "code"))
    sending.code = packed.digest


def send_calls(client: Client, envelope: bytes, calls: Sequence[bytes],
               sending: Sending) -> None:
    """Pack and send the envelope and the items' calls, in groups (see the module)."""
    groups = _groups(calls)
    for number, (start, stop) in enumerate(groups):
        entries = {ARGS_FILE: calls_file(calls[start:stop])}
        if number == 0:
            entries[FUNCTION_FILE] = envelope
        digest = _send_entries(client, entries, sending)
        if number == 0:
            sending.function_source = bundle_input(digest, FUNCTION_FILE)
        source = bundle_input(digest, ARGS_FILE)
        sending.item_sources.extend((source, i) for i in range(stop - start))


def _groups(calls: Sequence[bytes]) -> list[tuple[int, int]]:
    """[start, stop) of each group of consecutive calls within CALL_BUNDLE_MAX_BYTES (a call
    bigger than that is a group of its own)."""
    groups: list[tuple[int, int]] = []
    start, size = 0, 0
    for i, call in enumerate(calls):
        if i > start and size + len(call) > CALL_BUNDLE_MAX_BYTES:
            groups.append((start, i))
            start, size = i, 0
        size += len(call)
    groups.append((start, len(calls)))
    return groups


def _send_entries(client: Client, entries: dict[str, bytes], sending: Sending) -> str:
    root = Path(tempfile.mkdtemp(prefix="e31-call-"))
    try:
        for name, data in entries.items():
            (root / name).write_bytes(data)
        packed = pack(root, max_bytes=client.bundle_max_bytes, field_name="call",
                      ignore_files=False)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    sending.sent.append(_upload(client, packed, "call"))
    return packed.digest


def _upload(client: Client, packed: Packed, field_name: str) -> Sent:
    try:
        return upload(client, packed, field_name)
    finally:
        packed.remove()
