"""Files and batches of the OpenAI-compatible API, and the models batches name.

`BatchStore` keeps the rows; the bytes of a file are in the artifact store
(`e31.edge.filestore`), and a batch's work is the array of its shards, whose jobs the store
already keeps (`shard_jobs` reads them for the batch's counts). A batch moves from status to
status by `move_batch`, a compare-and-set on the status it expects, so two API processes
settling the same batch cannot both finalise it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.exc import IntegrityError

from e31.core.batches import FINAL
from e31.core.errors import Conflict, NotFound
from e31.core.records import Actor
from e31.store import audit
from e31.store.base import Store
from e31.store.models import Batch, BatchFile, Job, ServedModel, Tenant

LIST_MAX = 100       # rows of one list answer


@dataclass(frozen=True)
class ModelRecord:
    """A registered model."""

    name: str
    kind: str
    path: str
    gpu_mem_gb: float | None
    created_at: datetime

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's model object, with where it lives and what it needs."""
        return {"id": self.name, "object": "model", "created": int(self.created_at.timestamp()),
                "owned_by": "e31", "kind": self.kind, "path": self.path,
                "gpu_mem_gb": self.gpu_mem_gb}


@dataclass(frozen=True)
class FileRecord:
    """A stored file, as the Files API shows it."""

    id: str
    tenant_id: str
    purpose: str
    filename: str
    bytes: int
    created_at: datetime

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes,
                "created_at": int(self.created_at.timestamp()), "filename": self.filename,
                "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


@dataclass(frozen=True)
class ShardJob:
    """A shard's job as a batch's counts need it."""

    index: int
    id: str
    state: str
    reason: str | None
    result: Any
    progress_done: float | None


class BatchStore(Store):
    """Models, files and batches."""

    # -- models ---------------------------------------------------------------------------

    def add_model(self, record: ModelRecord, *, replace: bool = False,
                  actor: Actor | None = None) -> ModelRecord:
        """Register a model by name (`Conflict` when the name is taken, unless `replace`),
        written to the audit log with `actor` (an admin's request) in the same transaction."""
        row = ServedModel(name=record.name, kind=record.kind, path=record.path,
                          gpu_mem_gb=record.gpu_mem_gb, created_at=record.created_at)
        try:
            with self._session(write=True) as s:
                if replace:
                    s.execute(delete(ServedModel).where(ServedModel.name == record.name))
                s.add(row)
                if actor is not None:
                    audit.write(s, actor, "model.add", record.name, now=record.created_at,
                                detail={"kind": record.kind, "path": record.path,
                                        "gpu_mem_gb": record.gpu_mem_gb, "replace": replace})
        except IntegrityError as exc:
            raise Conflict(f"a model named {record.name!r} is registered already "
                           "(e31 model add --replace replaces it)") from exc
        return record

    def models(self, names: Sequence[str] | None = None) -> dict[str, ModelRecord]:
        """The registered models (those of `names` only, when given), by name."""
        q = select(ServedModel).order_by(ServedModel.name)
        if names is not None:
            q = q.where(ServedModel.name.in_(list(names)))
        with self._session() as s:
            return {m.name: ModelRecord(m.name, m.kind, m.path, m.gpu_mem_gb, m.created_at)
                    for m in s.scalars(q)}

    def remove_model(self, name: str, *, now: datetime, actor: Actor | None = None) -> None:
        with self._session(write=True) as s:
            if not s.execute(delete(ServedModel).where(ServedModel.name == name)).rowcount:  # type: ignore[attr-defined]
                raise NotFound(f"no model named {name!r}")
            if actor is not None:
                audit.write(s, actor, "model.remove", name, now=now)

    # -- files ----------------------------------------------------------------------------

    def insert_file(self, record: FileRecord) -> FileRecord:
        with self._session(write=True) as s:
            s.add(BatchFile(id=record.id, tenant_id=record.tenant_id, purpose=record.purpose,
                            filename=record.filename, bytes=record.bytes,
                            created_at=record.created_at))
        return record

    def get_file(self, tenant_id: str, file_id: str) -> FileRecord:
        """The tenant's file `file_id` (`NotFound` for another tenant's, as for none)."""
        with self._session() as s:
            f = s.get(BatchFile, file_id)
            if f is None or f.tenant_id != tenant_id:
                raise NotFound(f"no file {file_id!r}")
            return _file(f)

    def list_files(self, tenant_id: str, *, purpose: str | None, limit: int,
                   after: str | None) -> list[FileRecord]:
        """The tenant's files, newest first; `after` a file id: those older than it."""
        q = select(BatchFile).where(BatchFile.tenant_id == tenant_id)
        if purpose is not None:
            q = q.where(BatchFile.purpose == purpose)
        with self._session() as s:
            q = _after(s, q, BatchFile, after)
            rows = s.scalars(q.order_by(BatchFile.created_at.desc(), BatchFile.id.desc())
                             .limit(min(limit, LIST_MAX)))
            return [_file(f) for f in rows]

    def delete_file(self, tenant_id: str, file_id: str) -> FileRecord:
        with self._session(write=True) as s:
            f = s.get(BatchFile, file_id)
            if f is None or f.tenant_id != tenant_id:
                raise NotFound(f"no file {file_id!r}")
            record = _file(f)
            s.delete(f)
            return record

    # -- batches --------------------------------------------------------------------------

    def insert_batch(self, row: Mapping[str, Any]) -> Batch:
        with self._session(write=True) as s:
            batch = Batch(**row)
            s.add(batch)
        return batch

    def get_batch(self, tenant_id: str | None, batch_id: str) -> Batch:
        with self._session() as s:
            b = s.get(Batch, batch_id)
            if b is None or (tenant_id is not None and b.tenant_id != tenant_id):
                raise NotFound(f"no batch {batch_id!r}")
            return b

    def list_batches(self, tenant_id: str, *, limit: int, after: str | None) -> list[Batch]:
        """The tenant's batches, newest first; `after` a batch id: those older than it."""
        with self._session() as s:
            q = _after(s, select(Batch).where(Batch.tenant_id == tenant_id), Batch, after)
            return list(s.scalars(q.order_by(Batch.created_at.desc(), Batch.id.desc())
                                  .limit(min(limit, LIST_MAX))))

    def open_batches(self) -> list[Batch]:
        """Every batch that has not reached a final status, oldest first: what settling
        visits."""
        with self._session() as s:
            return list(s.scalars(select(Batch).where(Batch.status.not_in(
                [str(f) for f in FINAL])).order_by(Batch.created_at)))

    def move_batch(self, batch_id: str, expect: Sequence[str], **fields: Any) -> bool:
        """Set `fields` on the batch if its status is one of `expect`; whether it was."""
        with self._session(write=True) as s:
            res = s.execute(update(Batch).where(Batch.id == batch_id,
                                                Batch.status.in_(list(expect))).values(**fields))
            return bool(res.rowcount)  # type: ignore[attr-defined]

    def shard_jobs(self, array_id: str) -> list[ShardJob]:
        """The jobs of a batch's array in shard order."""
        with self._session() as s:
            rows = s.execute(select(Job.array_index, Job.id, Job.state, Job.reason, Job.result,
                                    Job.progress_done).where(Job.array_id == array_id)
                             .order_by(Job.array_index))
            return [ShardJob(int(r[0]), r[1], r[2], r[3], r[4], r[5]) for r in rows]

    def batch_usage(self, tenant_id: str | None, *, limit: int) -> list[dict[str, Any]]:
        """The newest batches (of `tenant_id`, or everyone's): requests, tokens in and out,
        and the GPU-seconds their shards' jobs were billed."""
        gpu_s = (select(Job.array_id, func.sum(Job.gpu_seconds).label("gpu_seconds"))
                 .group_by(Job.array_id).subquery())
        q = (select(Batch, Tenant.name, gpu_s.c.gpu_seconds)
             .join(Tenant, Tenant.id == Batch.tenant_id)
             .outerjoin(gpu_s, gpu_s.c.array_id == Batch.array_id)
             .order_by(Batch.created_at.desc()).limit(limit))
        if tenant_id is not None:
            q = q.where(Batch.tenant_id == tenant_id)
        with self._session() as s:
            return [{"batch": b.id, "tenant": name, "status": b.status,
                     "requests": b.request_total, "completed": b.request_completed,
                     "failed": b.request_failed, "prompt_tokens": b.prompt_tokens,
                     "completion_tokens": b.completion_tokens,
                     "gpu_seconds": round(float(g or 0.0), 3)}
                    for b, name, g in s.execute(q)]


def _file(f: BatchFile) -> FileRecord:
    return FileRecord(f.id, f.tenant_id, f.purpose, f.filename, f.bytes, f.created_at)


def _after(s: Any, q: Any, model: type[Batch] | type[BatchFile], after: str | None) -> Any:
    """`q` limited to the rows listed after the row `after` (newest first: older ones)."""
    if not after:
        return q
    mark = s.get(model, after)
    if mark is None:
        return q.where(model.id.is_(None))   # an unknown cursor lists nothing
    return q.where((model.created_at < mark.created_at)
                   | ((model.created_at == mark.created_at) & (model.id < mark.id)))
