"""One file of a bundle, read from the tar without unpacking it: what the API reads of a job's
code at submit (its requirements file, `e31.api.services.requirements`), bounded in size.

The file is found as the worker's unpacked copy would show it: the path normalised, each link
of the tar on the way (a directory's or the file's) followed inside the tar, never out of it.
"""

from __future__ import annotations

import posixpath
import struct
import tarfile
from typing import IO

LINK_HOPS_MAX = 40    # links followed to find one member: the kernel's own bound (ELOOP)
# What tarfile raises on hostile bytes besides its own TarError (as e31.core.bundles notes).
_MALFORMED = (tarfile.TarError, ValueError, EOFError, OverflowError, IndexError, KeyError,
              struct.error)


def read_member(fileobj: IO[bytes], path: str, *, max_bytes: int) -> bytes:
    """The content of the regular file `path` (relative, as a spec names a file of its code)
    of the tar in `fileobj`; at most `max_bytes` are read. `FileNotFoundError` when the tar
    holds no such file (or only a link out of it), `ValueError` when it is no regular file,
    is larger than `max_bytes`, or the tar cannot be read."""
    try:
        with tarfile.open(fileobj=fileobj, mode="r:") as tar:
            members: dict[str, tarfile.TarInfo] = {}
            while (member := tar.next()) is not None:
                members[posixpath.normpath(member.name)] = member   # the last one wins
            found = _resolve(members, path)
            if found is None:
                raise FileNotFoundError(path)
            if found.isreg() and found.size <= max_bytes:
                data = tar.extractfile(found)
                return data.read(max_bytes) if data is not None else b""
    except _MALFORMED as exc:
        raise ValueError(f"the bundle cannot be read: {type(exc).__name__}") from exc
    if not found.isreg():
        raise ValueError("is not a regular file")
    raise ValueError(f"is larger than {max_bytes} bytes")

def _resolve(members: dict[str, tarfile.TarInfo], path: str) -> tarfile.TarInfo | None:
    """The member at `path`, links on the way followed inside the tar; None when there is
    none, a link leads out, or links loop."""
    todo = [p for p in path.split("/") if p not in ("", ".")]
    done: list[str] = []
    hops = 0
    member: tarfile.TarInfo | None = None
    while todo:
        part = todo.pop(0)
        if part == "..":
            if not done:
                return None            # out of the bundle
            done.pop()
            member = None
            continue
        name = "/".join([*done, part])
        member = members.get(name)
        if member is not None and member.issym():
            hops += 1
            if hops > LINK_HOPS_MAX or member.linkname.startswith("/"):
                return None
            todo = [p for p in member.linkname.split("/") if p not in ("", ".")] + todo
            continue                   # the target, relative to the link's directory
        done.append(part)
    return member if done else None
