"""`FileStore`: the bytes of the OpenAI-compatible files, beside the artifacts.

In the artifact store's file system (`artifacts_url`): `files/<tenant>/<file id>`, written under
a temporary name and renamed into place once whole, so a reader never sees half a file. A
tenant names only its own files (the rows in `files` say whose each is; the path has the
tenant in it besides). A batch's notes that are not files of the API (the error lines of the
requests that named an unknown model) lie beside them as `<batch id>.<name>`.
"""

from __future__ import annotations

import contextlib
import posixpath
import re
import uuid
from collections.abc import Iterator, Mapping
from typing import IO, Any

import fsspec

PREFIX = "files"
TMP_PREFIX = ".upload-"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,80}$")


class FileStore:
    """Tenants' files over the fsspec store at `url` (the artifact store's)."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self._fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self._root = posixpath.join(root, PREFIX)

    def _path(self, tenant_id: str, name: str) -> str:
        if not _NAME.fullmatch(name) or not _NAME.fullmatch(tenant_id) \
                or name.startswith(".") or tenant_id.startswith("."):
            raise ValueError(f"not a file: {tenant_id!r}/{name!r}")
        return posixpath.join(self._root, tenant_id, name)

    @contextlib.contextmanager
    def writing(self, tenant_id: str, name: str) -> Iterator[IO[bytes]]:
        """A file to write `name` into; it is in place when the block ends without an error,
        and nowhere otherwise."""
        final = self._path(tenant_id, name)
        parent = posixpath.dirname(final)
        self._fs.makedirs(parent, exist_ok=True)
        tmp = posixpath.join(parent, f"{TMP_PREFIX}{uuid.uuid4().hex}")
        try:
            with self._fs.open(tmp, "wb") as f:
                yield f
            self._fs.mv(tmp, final)
        finally:
            with contextlib.suppress(OSError):
                if self._fs.exists(tmp):
                    self._fs.rm(tmp)

    def open(self, tenant_id: str, name: str) -> IO[bytes]:
        """The stored file for reading (FileNotFoundError when there is none)."""
        path = self._path(tenant_id, name)
        if not self._fs.isfile(path):
            raise FileNotFoundError(path)
        opened: IO[bytes] = self._fs.open(path, "rb")
        return opened

    def exists(self, tenant_id: str, name: str) -> bool:
        return bool(self._fs.isfile(self._path(tenant_id, name)))

    def remove(self, tenant_id: str, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm(self._path(tenant_id, name))
