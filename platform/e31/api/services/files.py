"""A tenant's files of the OpenAI-compatible Files API (`/v1/files`; the routes are
`e31.api.routes.files`): uploads for batches, and the batches' output and error files.

An upload is copied into the file store (`e31.edge.filestore`) while its bytes and lines are
counted: past `batch_file_max_bytes` or `batch_max_requests` lines it is refused with 413 naming
the limit, and nothing is kept. Whether its lines make a batch is checked when a batch names
it (`e31.core.batchlines`), as OpenAI does.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import IO

from e31.core.batches import new_file_id
from e31.core.clock import utcnow
from e31.core.errors import NotFound, SpecError, TooLarge
from e31.core.records import TenantRecord
from e31.edge.filestore import FileStore
from e31.edge.settings import Settings
from e31.store import Repo
from e31.store.batches import FileRecord

log = logging.getLogger(__name__)

COPY_CHUNK_BYTES = 1024 * 1024
PURPOSES_TAKEN = ("batch",)   # what a tenant may upload; batch_output files are the pool's


class FileService:
    """Each tenant's files: upload, list, read, delete."""

    def __init__(self, *, settings: Settings, repo: Repo, store: FileStore) -> None:
        self._settings = settings
        self._repo = repo
        self._store = store

    @property
    def store(self) -> FileStore:
        return self._store

    def upload(self, tenant: TenantRecord, source: IO[bytes], *, filename: str,
               purpose: str) -> FileRecord:
        """Store `source` as a new file of the tenant's, counted and bounded as the module
        says."""
        if purpose not in PURPOSES_TAKEN:
            raise SpecError.one("purpose", f"{purpose!r} is not taken here; upload files for "
                                           "batches with purpose 'batch'")
        file_id = new_file_id()
        size = self._copy_in(tenant.id, file_id, source)
        record = FileRecord(id=file_id, tenant_id=tenant.id, purpose=purpose,
                            filename=filename[:255] or "upload.jsonl", bytes=size,
                            created_at=utcnow())
        try:
            self._repo.insert_file(record)
        except Exception:
            self._store.remove(tenant.id, file_id)
            raise
        log.info("file_stored tenant=%s file=%s bytes=%d", tenant.name, file_id, size)
        return record

    def _copy_in(self, tenant_id: str, file_id: str, source: IO[bytes]) -> int:
        max_bytes = self._settings.batch_file_max_bytes
        max_lines = self._settings.batch_max_requests
        size = lines = 0
        with self._store.writing(tenant_id, file_id) as out:
            while chunk := source.read(COPY_CHUNK_BYTES):
                size += len(chunk)
                lines += chunk.count(b"\n")
                if size > max_bytes:
                    raise TooLarge(f"the file is larger than {max_bytes} bytes (the setting "
                                   "batch_file_max_bytes)", limit_bytes=max_bytes)
                if lines > max_lines:
                    raise TooLarge(f"the file holds more than {max_lines} requests, the most a "
                                   "batch holds (the setting batch_max_requests)",
                                   limit_bytes=max_bytes)
                out.write(chunk)
        return size

    def add_output(self, tenant_id: str, file_id: str, filename: str,
                   lines: Iterator[bytes]) -> FileRecord:
        """Store `lines` as a batch's output or error file `file_id` (a batch's finalising;
        written again, it replaces the file and its row)."""
        size = 0
        with self._store.writing(tenant_id, file_id) as out:
            for line in lines:
                out.write(line)
                size += len(line)
        record = FileRecord(id=file_id, tenant_id=tenant_id, purpose="batch_output",
                            filename=filename, bytes=size, created_at=utcnow())
        try:
            self._repo.delete_file(tenant_id, file_id)
        except NotFound:
            pass
        return self._repo.insert_file(record)

    def get(self, tenant: TenantRecord, file_id: str) -> FileRecord:
        return self._repo.get_file(tenant.id, file_id)

    def list(self, tenant: TenantRecord, *, purpose: str | None, limit: int,
             after: str | None) -> list[FileRecord]:
        return self._repo.list_files(tenant.id, purpose=purpose, limit=limit, after=after)

    def open(self, tenant: TenantRecord, file_id: str) -> IO[bytes]:
        """The file's bytes (`NotFound` for none of the tenant's)."""
        record = self._repo.get_file(tenant.id, file_id)
        try:
            return self._store.open(tenant.id, record.id)
        except FileNotFoundError as exc:
            raise NotFound(f"file {file_id} has no content") from exc

    def delete(self, tenant: TenantRecord, file_id: str) -> FileRecord:
        record = self._repo.delete_file(tenant.id, file_id)
        self._store.remove(tenant.id, file_id)
        log.info("file_deleted tenant=%s file=%s", tenant.name, file_id)
        return record
