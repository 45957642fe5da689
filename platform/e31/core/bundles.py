"""Bundles: a job's code and uploaded data as content-addressed tars, and how specs name them.

A **bundle** is an uncompressed tar that the client packs (`e31.client.bundle`) and uploads
once under its sha256 (`PUT /v1/bundles/sha256:<hex>`); a spec names it by that hash:
`code: "sha256:<hex>"` for the job's code, and `inputs: {NAME: "bundle:sha256:<hex>/<entry>"}`
for a local file or directory the client uploaded as an input (the tar holds `<entry>`, the
file or the directory, at its top). Other inputs are URLs the worker reads (`file://`,
`s3://`, `http(s)://`). docs/jobs.md, "Bring your code, environment and data".

`tar_problems` is the one check of a tar's members, used where a bundle arrives (the API)
and again where it is unpacked (the worker, which also extracts with tarfile's `data` filter):
no absolute path, no `..`, no link that leaves the bundle, no hard link, no device or FIFO,
no sparse file (GNU or PAX `GNU.sparse.*`: a bundle has no use for one, and tarfile's parser of
their maps raises plain `ValueError`s on a malformed one). A header tarfile cannot read, whatever
error its parser raises, is a problem naming where it lies, never an exception to the caller.
"""

from __future__ import annotations

import posixpath
import re
import struct
import tarfile
from collections.abc import Sequence
from typing import IO, Annotated
from urllib.parse import unquote, urlsplit

from pydantic import AfterValidator

DIGEST = re.compile(r"^sha256:([0-9a-f]{64})$")
BUNDLE_SCHEME = "bundle"
URL_SCHEMES = ("file", "s3", "http", "https")   # inputs the worker reads itself, with fsspec
MAX_INPUTS = 64            # inputs of one job: more belong in one directory input
MAX_SOURCE_CHARS = 4096    # one input's URL
# An input's name is a file name in $E31_INPUT_DIR: no separator, not `.` or `..`, no
# leading dash (it would read as an option on a command line), printable ASCII.
INPUT_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_BUNDLE_INPUT = re.compile(r"^bundle:(sha256:[0-9a-f]{64})/(.+)$")
# Every output of an array's items, staged as `<name>/<item index>/<path>` (a fan-out's merge).
ARRAY_INPUT = re.compile(r"^array:(a-[0-9a-f]{20})/outputs$")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
TAR_MEMBER_KINDS = {tarfile.REGTYPE: "file", tarfile.AREGTYPE: "file", tarfile.DIRTYPE: "dir",
                    tarfile.SYMTYPE: "symlink"}


def check_digest(value: str) -> str:
    """`value` if it names a bundle: `sha256:` and 64 lower-case hex digits."""
    if not DIGEST.fullmatch(value):
        raise ValueError("must be a bundle's hash: 'sha256:' and 64 lower-case hex digits "
                         "(the client sets it from workdir)")
    return value


def check_input_name(value: str) -> str:
    """`value` if it is a safe file name for `$E31_INPUT_DIR/<name>`."""
    if not INPUT_NAME.fullmatch(value) or value in (".", ".."):
        raise ValueError(f"input name {value[:64]!r} must be a file name: letters, digits, "
                         "'_', '.', '-', not starting with '.' or '-', at most 128 characters")
    return value


def check_input_source(value: str) -> str:
    """`value` if it is an input the worker can stage: a URL of a known scheme, or an uploaded
    bundle entry. A local path never reaches the API: the client uploads it first."""
    if len(value) > MAX_SOURCE_CHARS:
        raise ValueError(f"longer than {MAX_SOURCE_CHARS} characters")
    if value.startswith(f"{BUNDLE_SCHEME}:"):
        parse_bundle_input(value)
        return value
    if value.startswith("array:"):
        parse_array_input(value)
        return value
    scheme = input_scheme(value)
    if scheme is None:
        raise ValueError(f"{value[:200]!r} is not a URL; a local path is uploaded by the client "
                         "(Client.submit, e31 submit), which names it bundle:sha256:…")
    if scheme not in URL_SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; known: {', '.join(URL_SCHEMES)}, and local "
                         "paths (uploaded by the client)")
    return value


def input_scheme(value: str) -> str | None:
    """The lower-cased scheme of a URL (`s3` of `s3://b/k`), or None when `value` is none."""
    m = _SCHEME.match(value)
    return m.group(1).lower() if m else None


def parse_bundle_input(value: str) -> tuple[str, str]:
    """(`sha256:<hex>`, entry) of an uploaded input `bundle:sha256:<hex>/<entry>`."""
    m = _BUNDLE_INPUT.fullmatch(value)
    if m is None or not _is_entry_name(m.group(2)):
        raise ValueError("an uploaded input must read bundle:sha256:<64 hex>/<file name>")
    return m.group(1), m.group(2)


def parse_array_input(value: str) -> str:
    """The array id of an input `array:<id>/outputs` (its items' outputs)."""
    m = ARRAY_INPUT.fullmatch(value)
    if m is None:
        raise ValueError("an array's outputs read array:a-<20 hex>/outputs")
    return m.group(1)


def bundle_input(digest: str, entry: str) -> str:
    """How a spec names `entry` at the top of the uploaded bundle `digest`."""
    return f"{BUNDLE_SCHEME}:{digest}/{entry}"


def file_input_path(url: str, roots: Sequence[str]) -> str:
    """The worker's path that a `file://` input names, if it lies beneath one of `roots`
    (settings `input_file_roots`); `ValueError` saying why not otherwise. The worker reads it
    with its own rights, so only directories an operator opened for every tenant qualify; the
    worker checks the resolved path again before it reads."""
    parts = urlsplit(url)
    path = unquote(parts.path)
    if parts.netloc not in ("", "localhost") or not path.startswith("/"):
        raise ValueError("a file:// input names an absolute path on the worker: file:///path")
    norm = posixpath.normpath(path)
    if not roots:
        raise ValueError("file:// inputs are off on this pool (input_file_roots names no "
                         "directory); give a local path, which the client uploads")
    if not any(beneath(norm, root) for root in roots):
        raise ValueError(f"{_shown(norm)} is not beneath a directory that file:// inputs may "
                         f"read (input_file_roots: {', '.join(roots)})")
    return norm


def beneath(path: str, root: str) -> bool:
    """Whether the normalised absolute `path` is `root` or lies below it."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def _is_entry_name(name: str) -> bool:
    return bool(name) and "/" not in name and name not in (".", "..") and name.isprintable()


CodeRef = Annotated[str, AfterValidator(check_digest)]
InputName = Annotated[str, AfterValidator(check_input_name)]
InputSource = Annotated[str, AfterValidator(check_input_source)]


def tar_problems(fileobj: IO[bytes], *, limit: int = 20) -> list[str]:
    """What makes the tar in `fileobj` unfit to unpack, at most `limit` lines (empty: fit)."""
    problems: list[str] = []
    tar: tarfile.TarFile | None = None
    offset = 0     # where the header being read starts
    try:
        tar = tarfile.open(fileobj=fileobj, mode="r:")   # reads the first header
        while (member := tar.next()) is not None:
            why = member_problem(member)
            if why is not None:
                problems.append(f"{_shown(member.name) or '(a member with no name)'}: {why}")
                if len(problems) >= limit:
                    break
            offset = tar.offset   # the next header's
    except MALFORMED as exc:   # a parser's error on hostile bytes: the member is malformed
        if tar is None and isinstance(exc, tarfile.ReadError):
            problems.append(f"not a tar: {exc}")
        else:
            problems.append(f"{_unreadable(fileobj, offset)}: a malformed header "
                            f"({type(exc).__name__}: {_shown(str(exc))})")
    finally:
        if tar is not None:
            tar.close()
    return problems


# What tarfile's header parsers raise on bytes they cannot read, besides its own TarError:
# int() and the sparse maps' unpacking raise ValueError (UnicodeDecodeError is one), a short
# block EOFError, a number field OverflowError, a PAX record IndexError or struct.error.
MALFORMED = (tarfile.TarError, ValueError, EOFError, OverflowError, IndexError, KeyError,
             struct.error)


def _unreadable(fileobj: IO[bytes], offset: int) -> str:
    """The member whose header at `offset` could not be read, named as its raw blocks name it:
    the name field of its header block or, behind a PAX extended header, its `path` record,
    else the name field of the block that follows the extended header."""
    try:
        name = _raw_name(fileobj, offset)
    except (OSError, ValueError):
        name = b""
    shown = _shown(name.decode("utf-8", "replace"))
    return f"the member at byte {offset}" + (f" ({shown})" if shown else "")


def _raw_name(fileobj: IO[bytes], offset: int) -> bytes:
    fileobj.seek(offset)
    block = fileobj.read(tarfile.BLOCKSIZE)
    if block[156:157] not in (tarfile.XHDTYPE, tarfile.XGLTYPE):
        return block[:100].split(b"\0", 1)[0]
    size = int(block[124:136].split(b"\0", 1)[0].strip() or b"0", 8)
    found = _PAX_PATH.search(fileobj.read(min(size, _PAX_READ_MAX)))
    if found:
        return found.group(1)
    fileobj.seek(offset + tarfile.BLOCKSIZE * (1 + -(-size // tarfile.BLOCKSIZE)))
    return fileobj.read(100).split(b"\0", 1)[0]


_PAX_PATH = re.compile(rb"(?:^|\n)[0-9]+ path=([^\n]*)\n")
_PAX_READ_MAX = 64 * 1024   # of an unreadable member's extended header, to find its path


def member_problem(member: tarfile.TarInfo) -> str | None:
    """Why one tar member may not be unpacked into a bundle's directory, or None."""
    name = member.name
    if member.type == tarfile.GNUTYPE_SPARSE or member.sparse is not None or any(
            key.startswith("GNU.sparse.") for key in member.pax_headers):
        return "a sparse file; a bundle holds plain files, directories and links inside it"
    if member.type not in TAR_MEMBER_KINDS:
        kind = "a hard link" if member.type == tarfile.LNKTYPE else "a device, FIFO or other " \
                                                                     "special file"
        return f"{kind}; a bundle holds files, directories and links inside it only"
    if "\x00" in name or name.startswith("/") or _escapes(name):
        return "its path escapes the bundle (absolute or through '..')"
    if member.type == tarfile.SYMTYPE:
        target = member.linkname
        if target.startswith("/") or _escapes(posixpath.join(posixpath.dirname(name), target)):
            return f"a link to {_shown(target)}, outside the bundle"
    return None


def _escapes(path: str) -> bool:
    norm = posixpath.normpath(path)
    return norm == ".." or norm.startswith("../") or norm.startswith("/")


def _shown(text: str) -> str:
    text = text[:200]
    return text if text.isprintable() else repr(text)
