"""SQLAlchemy 2.0 typed models of the results store: tenants, API keys, arrays, jobs, attempts."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, Boolean, DateTime, Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes on every backend (SQLite keeps no zone, so reads are re-tagged)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the store; use an aware UTC datetime")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value


class Base(DeclarativeBase):
    pass


class Tenant(Base):
    __tablename__ = "tenants"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    admin: Mapped[bool] = mapped_column(Boolean, default=False)
    weight: Mapped[float] = mapped_column(Float, default=1.0)  # fair-share seam (scheduling)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class ApiKey(Base):
    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex; token never stored
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class Array(Base):
    """N jobs submitted together (a sweep): each job row points back with its index."""

    __tablename__ = "arrays"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    name: Mapped[str] = mapped_column(String(200))
    size: Mapped[int] = mapped_column(Integer)              # item count, fixed at submission
    submitted_at: Mapped[datetime] = mapped_column(UTCDateTime)

    __table_args__ = (Index("ix_arrays_tenant_submitted", "tenant_id", "submitted_at"),)


class Job(Base):
    __tablename__ = "jobs"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    name: Mapped[str] = mapped_column(String(200))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    size_class: Mapped[str] = mapped_column(String(32))
    queue: Mapped[str] = mapped_column(String(64))
    gpus: Mapped[int] = mapped_column(Integer)
    priority: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    result: Mapped[Any | None] = mapped_column(JSON, nullable=True)

    submitted_at: Mapped[datetime] = mapped_column(UTCDateTime)
    queued_since: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    not_before: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)

    # Dispatch: set when the scheduler publishes, cleared when the job is queued again.
    dispatched_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    dispatch_count: Mapped[int] = mapped_column(Integer, default=0)

    # Lease of the running attempt: owner, fencing token, expiry.
    attempts_used: Mapped[int] = mapped_column(Integer, default=0)
    lease_owner: Mapped[str | None] = mapped_column(String(200), nullable=True)
    lease_token: Mapped[int] = mapped_column(Integer, default=0)
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)

    progress_done: Mapped[float | None] = mapped_column(Float, nullable=True)
    progress_total: Mapped[float | None] = mapped_column(Float, nullable=True)
    gpu_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    run_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    queued_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    outputs: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)

    # Set for an item of an array: the array and the item's 0-based index in it.
    array_id: Mapped[str | None] = mapped_column(ForeignKey("arrays.id"), nullable=True)
    array_index: Mapped[int | None] = mapped_column(Integer, nullable=True)

    __table_args__ = (
        # The scheduler's candidate scan and the dispatch count per queue.
        Index("ix_jobs_dispatch", "state", "queue", "dispatched_at", "priority", "submitted_at"),
        Index("ix_jobs_tenant_submitted", "tenant_id", "submitted_at"),
        Index("ix_jobs_state_lease", "state", "lease_expires_at"),
        # An array's items in index order; one row per (array, index).
        Index("ix_jobs_array", "array_id", "array_index", unique=True),
    )


class Attempt(Base):
    __tablename__ = "attempts"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    n: Mapped[int] = mapped_column(Integer)
    worker: Mapped[str] = mapped_column(String(200))
    gpus: Mapped[str] = mapped_column(String(100))     # CUDA_VISIBLE_DEVICES of the attempt
    gpu_count: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
