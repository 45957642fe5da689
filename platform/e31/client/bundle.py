"""Packing a directory into a bundle, and sending a job's code and local inputs with it.

`pack` turns a directory into a deterministic, uncompressed tar: names sorted, every mtime,
owner and group fixed, modes reduced to 0644/0755, so the same tree always has the same
sha256 and a second job with the same tree uploads nothing. It honours `.gitignore` and
`.e31ignore` files (git's syntax, each applying below its own directory), skips `.git/`,
never follows a link: a link that resolves inside the directory is stored as a link, one that
leads out of it (or nowhere) is skipped with a warning, and a device, FIFO or socket is
refused. A tree bigger than the limit is refused with its biggest files named.

`prepare` does what `Client.submit` does with `workdir` and with inputs that are local paths:
pack each, upload it unless the API holds it already (`HEAD`, then `PUT`
/v1/bundles/sha256:<hex>), and put its hash in the spec (docs/jobs.md, "Bring your code,
environment and data").
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import tarfile
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import pathspec

from e31.core.bundles import BUNDLE_SCHEME, bundle_input, input_scheme
from e31.core.errors import ClientError, SpecError

if TYPE_CHECKING:
    from e31.client.client import Client

log = logging.getLogger(__name__)

DEFAULT_BUNDLE_MAX_BYTES = 100 * 1024 ** 2   # as the API's default (settings bundle_max_bytes)
BUNDLE_MAX_BYTES_VAR = "E31_BUNDLE_MAX_BYTES"
IGNORE_FILES = (".gitignore", ".e31ignore")
SKIPPED_DIRS = frozenset({".git"})
# A fixed mtime for every member (2000-01-01): a tree's hash must not depend on when its files
# were touched; a date rather than 0, which some tools read as "unknown".
BUNDLE_MTIME = 946684800
TAR_BLOCK = 512            # a tar header, and the unit a member's data is padded to
TAR_END = 2 * TAR_BLOCK    # two zero blocks close an archive (tarfile then pads to 10 KiB)
READ_CHUNK_BYTES = 1024 * 1024
BIGGEST_SHOWN = 5          # files named when a tree is over the limit


@dataclass(frozen=True)
class Packed:
    """A packed bundle: its tar in a temporary file, its hash, and what was left out."""

    path: Path
    digest: str              # sha256:<hex>
    size_bytes: int
    files: int
    skipped: list[str] = field(default_factory=list)   # links out: each with why

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


@dataclass(frozen=True)
class Sent:
    """One bundle a submission needed: which field named it, whether the API held it already
    (then nothing was sent) and whether it was uploaded now (never in a dry run)."""

    field: str
    digest: str
    size_bytes: int
    files: int
    held: bool
    uploaded: bool


def env_max_bytes() -> int:
    """The client's limit: `E31_BUNDLE_MAX_BYTES`, else 100 MiB."""
    text = os.environ.get(BUNDLE_MAX_BYTES_VAR, "")
    return int(text) if text.isdigit() else DEFAULT_BUNDLE_MAX_BYTES


# -- packing ------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Entry:
    rel: str                 # the member's name in the tar
    path: Path
    st: os.stat_result
    link: str | None = None  # a link's relative target


class _Ignores:
    """The ignore files of each directory walked so far, deepest consulted first."""

    def __init__(self, enabled: bool) -> None:
        self._enabled = enabled
        self._specs: dict[str, pathspec.GitIgnoreSpec] = {}   # directory (rel, "" = top) -> spec

    def load(self, rel_dir: str, directory: Path) -> None:
        if not self._enabled:
            return
        lines: list[str] = []
        for name in IGNORE_FILES:
            p = directory / name
            if p.is_file() and not p.is_symlink():
                lines += p.read_text(errors="replace").splitlines()
        if lines:
            self._specs[rel_dir] = pathspec.GitIgnoreSpec.from_lines(lines)

    def ignored(self, rel: str, is_dir: bool) -> bool:
        """Whether `rel` is ignored: the deepest ignore file with a rule for it decides."""
        parts = rel.split("/")
        for depth in range(len(parts) - 1, -1, -1):
            spec = self._specs.get("/".join(parts[:depth]))
            if spec is None:
                continue
            below = "/".join(parts[depth:]) + ("/" if is_dir else "")
            decided = spec.check_file(below).include
            if decided is not None:
                return bool(decided)
        return False


def _walk(root: Path, ignores: _Ignores, field_name: str) -> tuple[list[_Entry], list[str]]:
    """The members of the bundle of `root`, sorted, and the links skipped (with why)."""
    real_root = os.path.realpath(root)
    entries: list[_Entry] = []
    skipped: list[str] = []

    def visit(directory: Path, rel_dir: str) -> None:
        ignores.load(rel_dir, directory)
        with os.scandir(directory) as it:
            names = sorted(e.name for e in it)
        for name in names:
            rel = f"{rel_dir}/{name}" if rel_dir else name
            path = directory / name
            st = path.lstat()
            is_dir = stat.S_ISDIR(st.st_mode)
            if (is_dir and name in SKIPPED_DIRS) or ignores.ignored(rel, is_dir):
                continue
            if stat.S_ISLNK(st.st_mode):
                target = _link_inside(path, real_root)
                if target is None:
                    skipped.append(f"{rel}: a link to {os.readlink(path)!r}, which is not "
                                   "inside the directory (links are never followed out)")
                else:
                    entries.append(_Entry(rel, path, st, link=target))
            elif is_dir:
                entries.append(_Entry(rel, path, st))
                visit(path, rel)
            elif stat.S_ISREG(st.st_mode):
                entries.append(_Entry(rel, path, st))
            else:
                raise SpecError.one(field_name, f"{path} is a device, FIFO or socket; a bundle "
                                                "holds files, directories and links only")

    visit(root, "")
    return entries, skipped


def _link_inside(path: Path, real_root: str) -> str | None:
    """The target of the link `path` relative to the link's directory, when it resolves to
    something that exists inside `real_root`; None otherwise."""
    resolved = os.path.realpath(path)
    if not (resolved == real_root or resolved.startswith(real_root + os.sep)):
        return None
    if not os.path.lexists(resolved):
        return None
    return os.path.relpath(resolved, os.path.realpath(path.parent))


def _tar_bytes(entries: list[_Entry], prefix: str) -> int:
    """The size of the tar of `entries` before it is written (headers and padded data)."""
    total = TAR_END
    for e in entries:
        total += TAR_BLOCK * (1 + (len(prefix + e.rel) >= 100))   # a long name takes a header
        if e.link is None and stat.S_ISREG(e.st.st_mode):
            total += -(-e.st.st_size // TAR_BLOCK) * TAR_BLOCK
    return total


def _too_big(root: Path, entries: list[_Entry], size: int, max_bytes: int,
             field_name: str) -> SpecError:
    files = sorted((e for e in entries if e.link is None and stat.S_ISREG(e.st.st_mode)),
                   key=lambda e: (-e.st.st_size, e.rel))[:BIGGEST_SHOWN]
    biggest = ", ".join(f"{e.rel} ({_human(e.st.st_size)})" for e in files)
    return SpecError.one(field_name, (
        f"{root} packs to {_human(size)}, more than the limit of {_human(max_bytes)} "
        f"({BUNDLE_MAX_BYTES_VAR} here, bundle_max_bytes on the API); the biggest files: "
        f"{biggest}. Leave them out with .e31ignore or .gitignore, or pass big data as an "
        "s3:// or http(s):// input"))


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _info(entry: _Entry, name: str) -> tarfile.TarInfo:
    """The member's header with everything but its name, kind and size fixed."""
    info = tarfile.TarInfo(name)
    info.mtime = BUNDLE_MTIME
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if entry.link is not None:
        info.type, info.linkname, info.mode = tarfile.SYMTYPE, entry.link, 0o777
    elif stat.S_ISDIR(entry.st.st_mode):
        info.type, info.mode = tarfile.DIRTYPE, 0o755
    else:
        executable = entry.st.st_mode & 0o111
        info.type, info.mode = tarfile.REGTYPE, 0o755 if executable else 0o644
    return info


def _add_file(tar: tarfile.TarFile, info: tarfile.TarInfo, path: Path) -> None:
    """Add a regular file's bytes, opened without following a link that replaced it."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise SpecError.one("workdir", f"{path} changed while it was packed")
        info.size = st.st_size
        tar.addfile(info, _Exact(f, st.st_size, path))


class _Exact:
    """A file read as exactly `size` bytes: a file that shrinks while it is packed fails."""

    def __init__(self, f: IO[bytes], size: int, path: Path) -> None:
        self._f, self._left, self._path = f, size, path

    def read(self, n: int = -1) -> bytes:
        want = self._left if n < 0 else min(n, self._left)
        data = self._f.read(want)
        if len(data) < want:
            raise SpecError.one("workdir", f"{self._path} shrank while it was packed")
        self._left -= len(data)
        return data


def pack(source: Path, *, max_bytes: int | None = None, field_name: str = "workdir",
         ignore_files: bool = True, top: str | None = None) -> Packed:
    """Pack the directory (or, with `top`, the file or directory) `source` into a bundle.

    A directory's contents go at the top of the tar; with `top`, `source` itself goes there
    under that name (how a local input is packed: the tar holds `<top>` and, for a directory,
    everything under it). `max_bytes` defaults to `E31_BUNDLE_MAX_BYTES` or 100 MiB; a bigger
    tree is a `SpecError` naming `field_name` and the biggest files, before anything is
    written. Ignore files apply unless `ignore_files` is False (inputs are sent whole)."""
    limit = env_max_bytes() if max_bytes is None else max_bytes
    source = Path(source)
    try:
        st = source.stat()
    except OSError as exc:
        raise SpecError.one(field_name, f"{source}: {exc.strerror}") from exc
    ignores = _Ignores(ignore_files)
    prefix = f"{top}/" if top is not None else ""
    if stat.S_ISDIR(st.st_mode):
        entries, skipped = _walk(source, ignores, field_name)
        if top is not None:
            entries.insert(0, _Entry("", source, st))
    elif top is not None and stat.S_ISREG(st.st_mode):
        entries, skipped = [_Entry("", source, st)], []
    else:
        raise SpecError.one(field_name, f"{source} is not a directory")
    size = _tar_bytes(entries, prefix)
    if size > limit:
        raise _too_big(source, entries, size, limit, field_name)
    for why in skipped:
        log.warning("bundle_skipped %s", why)
    fd, name = tempfile.mkstemp(prefix="e31-bundle-", suffix=".tar")
    path = Path(name)
    try:
        with os.fdopen(fd, "wb") as out:
            with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
                for e in entries:
                    member = (prefix + e.rel).rstrip("/") if e.rel or top is None else top
                    info = _info(e, member)
                    if info.type == tarfile.REGTYPE:
                        _add_file(tar, info, e.path)
                    else:
                        tar.addfile(info)
        digest, written = _sha256(path)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    if written > limit:
        path.unlink(missing_ok=True)
        raise _too_big(source, entries, written, limit, field_name)
    files = sum(1 for e in entries if e.link is None and stat.S_ISREG(e.st.st_mode))
    return Packed(path=path, digest=digest, size_bytes=written, files=files, skipped=skipped)


def _sha256(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK_BYTES):
            h.update(chunk)
            size += len(chunk)
    return f"sha256:{h.hexdigest()}", size


# -- sending ------------------------------------------------------------------------------

def upload(client: Client, packed: Packed, field_name: str, *, send: bool = True) -> Sent:
    """Make sure the API holds `packed`: ask (`HEAD`), and unless it does, upload it (`PUT`),
    or with `send=False` (a dry run) only say that it would. A bundle over the API's limit is
    a `ClientError` with status 413 that names the limit."""
    path = f"/v1/bundles/{packed.digest}"
    try:
        client.request("HEAD", path)
        log.info("bundle_found field=%s bundle=%s: the API holds it, nothing uploaded",
                 field_name, packed.digest)
        return Sent(field_name, packed.digest, packed.size_bytes, packed.files, held=True,
                    uploaded=False)
    except ClientError as exc:
        if exc.status_code != 404:
            raise
    if send:
        with open(packed.path, "rb") as f:
            client.request("PUT", path, content=_chunks(f),
                           headers={"Content-Type": "application/x-tar",
                                    "Content-Length": str(packed.size_bytes)})
        log.info("bundle_uploaded field=%s bundle=%s bytes=%d", field_name, packed.digest,
                 packed.size_bytes)
    return Sent(field_name, packed.digest, packed.size_bytes, packed.files, held=False,
                uploaded=send)


def _chunks(f: IO[bytes]) -> Iterator[bytes]:
    while chunk := f.read(READ_CHUNK_BYTES):
        yield chunk


def is_local(source: str) -> bool:
    """Whether an input's source is a local path (the client uploads it), not a URL or an
    uploaded bundle entry."""
    return input_scheme(source) is None and not source.startswith(f"{BUNDLE_SCHEME}:")


def resolve_paths(body: dict[str, Any], base: Path) -> dict[str, Any]:
    """`body` with its `workdir` and local input paths taken relative to `base` (a spec
    file's directory)."""
    out = dict(body)
    if isinstance(out.get("workdir"), str):
        out["workdir"] = str(base / out["workdir"])
    inputs = out.get("inputs")
    if isinstance(inputs, Mapping):
        out["inputs"] = {k: str(base / v) if isinstance(v, str) and is_local(v) else v
                         for k, v in inputs.items()}
    return out


def prepare(client: Client, body: Mapping[str, Any], *, max_bytes: int | None = None,
            send: bool = True) -> tuple[dict[str, Any], list[Sent]]:
    """`body` as the API takes it: `workdir` packed, uploaded and replaced by `code`, each
    local input path packed, uploaded and replaced by `bundle:sha256:<hex>/<name>`; with the
    bundles it needed. A missing local path is a `SpecError` naming `inputs.<name>`."""
    out = dict(body)
    sent: list[Sent] = []
    inputs = out.get("inputs")
    local = {k: v for k, v in inputs.items() if isinstance(v, str) and is_local(v)} \
        if isinstance(inputs, Mapping) else {}
    for name, source in local.items():   # before anything is packed or sent
        if not Path(source).exists():
            raise SpecError.one(f"inputs.{name}", f"no such file or directory: {source}")
    workdir = out.pop("workdir", None)
    if workdir is not None:
        if out.get("code") is not None:
            raise SpecError.one("workdir", "give workdir or code, not both")
        packed = pack(Path(workdir).resolve(), max_bytes=max_bytes, field_name="workdir")
        sent.append(_send(client, packed, "workdir", send))
        out["code"] = packed.digest
    if local and isinstance(inputs, Mapping):
        staged = dict(inputs)
        for name, source in local.items():
            field_name = f"inputs.{name}"
            path = Path(source).resolve()    # the path named may be a link: the user chose it
            packed = pack(path, max_bytes=max_bytes, field_name=field_name,
                          ignore_files=False, top=path.name)
            sent.append(_send(client, packed, field_name, send))
            staged[name] = bundle_input(packed.digest, path.name)
        out["inputs"] = staged
    return out, sent


def _send(client: Client, packed: Packed, field_name: str, send: bool) -> Sent:
    try:
        return upload(client, packed, field_name, send=send)
    finally:
        packed.remove()
