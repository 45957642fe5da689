"""`BundleStore`: the bundles each tenant uploaded, stored once under their sha256.

Beside the artifacts, in the same fsspec store (`artifacts_url`): `bundles/<tenant>/<hex>.tar`.
A bundle is kept per tenant, so a tenant can name only what it uploaded itself, and learns
nothing of another tenant's bundles. An upload is written under a temporary name and renamed
into place once its hash and its members have been checked, so a reader never sees half a
bundle and a refused one leaves nothing behind.

`used_bytes` is what a tenant's bundles take, for its quota (`tenant_bundle_gb`): the sizes
listed under its directory, its uploads in progress included. Each upload checks it after
its own bytes are written and before it is committed, so of two concurrent uploads the later
check counts the other's whole file: both cannot pass the quota together (both may be refused
while both are in flight, which the client's retry settles). An upload file untouched for
`STALE_UPLOAD_S` is one an API process left when it died, and no longer counts.
"""

from __future__ import annotations

import contextlib
import hashlib
import posixpath
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import IO, Any

import fsspec

from e31.core.bundles import DIGEST

PREFIX = "bundles"
TMP_PREFIX = ".upload-"   # an upload in progress: never a bundle
# An upload file not written to for this long belongs to no live upload (its API process
# died): it no longer counts toward its tenant's quota. A live upload writes every chunk and
# is checked within seconds of its last one.
STALE_UPLOAD_S = 600.0


@dataclass
class Upload:
    """A bundle being written: its bytes go to a temporary file while the hash is computed."""

    file: IO[bytes]
    tmp_path: str
    size_bytes: int = 0
    sha256: Any = field(default_factory=hashlib.sha256)

    def write(self, chunk: bytes) -> None:
        """Write `chunk` and count it into the size and the hash."""
        self.file.write(chunk)
        self.sha256.update(chunk)
        self.size_bytes += len(chunk)

    @property
    def digest(self) -> str:
        return f"sha256:{self.sha256.hexdigest()}"


class BundleStore:
    """Tenants' bundles over the fsspec store at `url` (the artifact store's)."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        """`storage_options`: the artifact store's (`ArtifactStore.storage_options`)."""
        self._fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self._root = posixpath.join(root, PREFIX)

    def _path(self, tenant_id: str, digest: str) -> str:
        m = DIGEST.fullmatch(digest)
        if m is None or "/" in tenant_id or tenant_id in ("", ".", ".."):
            raise ValueError(f"not a bundle: {tenant_id!r}/{digest!r}")
        return posixpath.join(self._root, tenant_id, f"{m.group(1)}.tar")

    def path(self, tenant_id: str, digest: str) -> str:
        """Where the bundle lies in the store (for the records and the tests)."""
        return self._path(tenant_id, digest)

    def size(self, tenant_id: str, digest: str) -> int | None:
        """The stored bundle's size in bytes, or None when the tenant has no such bundle."""
        path = self._path(tenant_id, digest)
        try:
            info = self._fs.info(path)
        except FileNotFoundError:
            return None
        return int(info.get("size") or 0) if info.get("type") == "file" else None

    def used_bytes(self, tenant_id: str, *, now_s: float | None = None) -> int:
        """The bytes the tenant's bundles take, with its uploads in progress (the module says
        why); read afresh from the store, never from a cached listing."""
        parent = posixpath.join(self._root, tenant_id)
        self._fs.invalidate_cache(parent)
        try:
            listed = self._fs.ls(parent, detail=True)
        except FileNotFoundError:
            return 0
        now_s = time.time() if now_s is None else now_s
        return sum(int(info.get("size") or 0) for info in listed
                   if info.get("type") == "file" and not (
                       posixpath.basename(info["name"]).startswith(TMP_PREFIX)
                       and now_s - _modified_s(info) > STALE_UPLOAD_S))

    def exists(self, tenant_id: str, digest: str) -> bool:
        return self.size(tenant_id, digest) is not None

    @contextlib.contextmanager
    def upload(self, tenant_id: str) -> Iterator[Upload]:
        """A temporary file of the tenant's to write a bundle into; `commit` moves it into
        place. Whatever is not committed when the block ends is removed."""
        parent = posixpath.join(self._root, tenant_id)
        self._fs.makedirs(parent, exist_ok=True)
        tmp = posixpath.join(parent, f"{TMP_PREFIX}{uuid.uuid4().hex}")
        upload = Upload(file=self._fs.open(tmp, "wb"), tmp_path=tmp)
        try:
            yield upload
        finally:
            upload.file.close()
            with contextlib.suppress(OSError):
                if self._fs.exists(tmp):
                    self._fs.rm(tmp)

    def open_upload(self, upload: Upload) -> IO[bytes]:
        """The written upload (closed here), for reading its members before it is committed."""
        upload.file.close()
        opened: IO[bytes] = self._fs.open(upload.tmp_path, "rb")
        return opened

    def commit(self, upload: Upload, tenant_id: str) -> str:
        """Move a checked upload into place under its hash; returns that hash."""
        upload.file.close()
        self._fs.mv(upload.tmp_path, self._path(tenant_id, upload.digest))
        return upload.digest

    def open(self, tenant_id: str, digest: str) -> IO[bytes]:
        """The stored bundle for reading (FileNotFoundError when there is none)."""
        path = self._path(tenant_id, digest)
        if not self._fs.isfile(path):
            raise FileNotFoundError(path)
        opened: IO[bytes] = self._fs.open(path, "rb")
        return opened


def _modified_s(info: Mapping[str, Any]) -> float:
    """When a listed file was last written, in seconds since 1970 (a local file's `mtime`, an
    object's `LastModified`); 0 when the store says nothing."""
    modified = info.get("mtime", info.get("LastModified", info.get("last_modified")))
    if isinstance(modified, datetime):
        return modified.timestamp()
    return float(modified or 0)
