"""SQLAlchemy 2.0 typed models of the results store: tenants, API keys, arrays, jobs, their
dependencies, attempts, operators' drain requests."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Table,
    Text,
    text,
)
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
    weight: Mapped[float] = mapped_column(Float, default=1.0)  # fair share (docs/scheduling.md)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    # Size class -> most GPUs held at once; None or a missing class: no quota.
    quotas: Mapped[dict[str, int] | None] = mapped_column(JSON, nullable=True)
    # Decayed GPU-seconds (`e31.core.usage.UsageState`): the value as of `usage_at`. Every
    # attempt's bill is added in the transaction that ends it (`attempts.end_attempt`).
    usage_gpu_s: Mapped[float] = mapped_column(Float, default=0.0, server_default=text("0"))
    usage_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # Outputs (docs/security.md, "Limits and quotas"): the tenant's own cap (None: the pool's
    # `tenant_outputs_max_bytes`) and the bytes its jobs have stored, kept as a running total
    # by the worker that stores them and `e31 gc` that removes them (`store.quotas`).
    outputs_max_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    outputs_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))
    # Tenancy (docs/security.md): a disabled tenant's tokens are refused and its queued jobs
    # do not start; `limits` overrides the pool's per-tenant defaults by name (max_priority,
    # max_queued, max_array_items, max_request_bytes, submit_rate_per_s); None: defaults.
    disabled_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    limits: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class ApiKey(Base):
    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    # sha256 hex: the token itself is never stored
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # A tenant's tokens are named (unique among its live ones, checked by the store); `prefix`
    # is the token's first characters, shown by `e31 token list` to tell tokens apart.
    name: Mapped[str | None] = mapped_column(String(100), nullable=True)
    prefix: Mapped[str | None] = mapped_column(String(16), nullable=True)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class AuditEvent(Base):
    """Every admin action and token change: who (tenant and key), what, when, from where."""

    __tablename__ = "audit_log"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime)
    actor: Mapped[str] = mapped_column(String(100))   # tenant name, or "local" (CLI on the store)
    actor_key: Mapped[str | None] = mapped_column(String(40), nullable=True)   # api_keys.id
    action: Mapped[str] = mapped_column(String(64))          # e.g. token.create, tenant.disable
    target: Mapped[str] = mapped_column(String(200))         # e.g. tenant name, tenant/token
    source: Mapped[str | None] = mapped_column(String(100), nullable=True)     # client address
    detail: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)

    __table_args__ = (Index("ix_audit_log_at", "at"),)


class Secret(Base):
    """A tenant's named secret, Fernet-encrypted with the pool's key (`secrets_key`): the
    store alone does not reveal it."""

    __tablename__ = "secrets"
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    ciphertext: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)


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
    # When the work is due (a batch's completion window): within a tenant and a priority
    # band, the scheduler takes the earliest deadline first; NULL: none, after those that have.
    deadline_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)

    # Dispatch: set when the scheduler publishes, cleared when the job is queued again.
    dispatched_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    dispatch_count: Mapped[int] = mapped_column(Integer, default=0)
    # The publication's token, carried by its message: only a message with it claims the job.
    # The claim clears it and a new publication replaces it, so a hand-written, replayed or
    # superseded message runs nothing (docs/security.md, "The broker is not a trust boundary").
    dispatch_token: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # A gang dispatch (docs/scheduling.md, "Gangs on demand"): the host whose queue got the
    # message and the GPU indexes it gives the job ("0,1"); None for a class queue's message.
    dispatch_host: Mapped[str | None] = mapped_column(String(200), nullable=True)
    dispatch_gpus: Mapped[str | None] = mapped_column(String(64), nullable=True)

    # Lease of the running attempt: owner, fencing token, expiry.
    attempts_used: Mapped[int] = mapped_column(Integer, default=0)
    lease_owner: Mapped[str | None] = mapped_column(String(200), nullable=True)
    lease_token: Mapped[int] = mapped_column(Integer, default=0)
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    # Preemption (docs/scheduling.md): whether the scheduler may stop the job for another
    # (the spec's `preemptible`, resolved at submit), and when it asked the running attempt to
    # stop; cleared when the job is queued again.
    preemptible: Mapped[bool] = mapped_column(Boolean, default=False,
                                              server_default=text("false"))
    preempt_requested_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)

    progress_done: Mapped[float | None] = mapped_column(Float, nullable=True)
    progress_total: Mapped[float | None] = mapped_column(Float, nullable=True)
    gpu_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    run_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    queued_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    outputs: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    # When `e31 gc` removed the job's outputs, logs and checkpoints (the row stays).
    artifacts_removed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)

    # Set for an item of an array: the array and the item's 0-based index in it.
    array_id: Mapped[str | None] = mapped_column(ForeignKey("arrays.id"), nullable=True)
    array_index: Mapped[int | None] = mapped_column(Integer, nullable=True)

    # Scheduling: the spec's timeout_s (backfill's bound), how many dependencies
    # have not succeeded yet (the job is a candidate only at 0), and why it waits, as the
    # scheduler last judged it (written only when it changes).
    timeout_s: Mapped[float] = mapped_column(Float, server_default=text("86400"))
    deps_pending: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    pending_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    pending_detail: Mapped[str | None] = mapped_column(String(64), nullable=True)

    __table_args__ = (
        # The scheduler's candidate scan and the dispatch count per queue.
        Index("ix_jobs_dispatch", "state", "queue", "dispatched_at", "priority", "submitted_at"),
        # The scheduler's heads: each tenant's oldest runnable jobs per queue and band, one
        # index range each; also the skip-scan that finds which (queue, tenant) have work.
        Index("ix_jobs_heads", "state", "deps_pending", "queue", "tenant_id", "priority",
              "submitted_at"),
        # Whether an array still has live or failed items (dependencies on arrays).
        Index("ix_jobs_array_state", "array_id", "state"),
        Index("ix_jobs_tenant_submitted", "tenant_id", "submitted_at"),
        Index("ix_jobs_submitted", "submitted_at"),   # an admin's list of every tenant's
        Index("ix_jobs_state_lease", "state", "lease_expires_at"),
        # `e31 gc`: the ended jobs whose artifacts are still kept.
        Index("ix_jobs_ended", "ended_at"),
        # An array's items in index order; one row per (array, index).
        Index("ix_jobs_array", "array_id", "array_index", unique=True),
    )


class DrainRequest(Base):
    """An operator's drain of one worker node (`e31 worker --drain`): the authority behind the
    Redis key the node watches, which anyone holding the broker could write. The node's
    launcher deletes it when it starts again."""

    __tablename__ = "drain_requests"
    node: Mapped[str] = mapped_column(String(200), primary_key=True)
    requested_at: Mapped[datetime] = mapped_column(UTCDateTime)
    # Why: NULL for an operator's drain; the worker's own words when it took itself out of
    # service (a GPU's XID error).
    reason: Mapped[str | None] = mapped_column(String(500), nullable=True)


class JobDep(Base):
    """`job_id` waits for `dep_id` (a job `j-…` or an array `a-…`) to succeed. The row goes
    when the dependency succeeds (and `jobs.deps_pending` drops by one) or when the job ends."""

    __tablename__ = "job_deps"
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    dep_id: Mapped[str] = mapped_column(String(40), primary_key=True)

    __table_args__ = (Index("ix_job_deps_dep", "dep_id"),)


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
    # How the attempt ran, noted by its worker (`AttemptQueries.note_attempt`); NULL until then
    # and on attempts older than these columns.
    isolation: Mapped[str | None] = mapped_column(String(16), nullable=True)  # sandbox | process
    start: Mapped[str | None] = mapped_column(String(8), nullable=True)       # warm | cold
    start_ms: Mapped[float | None] = mapped_column(Float, nullable=True)      # child's start
    setup_s: Mapped[float | None] = mapped_column(Float, nullable=True)       # bundle, env, inputs
    gpu_mem_peak_gb: Mapped[float | None] = mapped_column(Float, nullable=True)
    gpu_util_mean: Mapped[float | None] = mapped_column(Float, nullable=True)  # 0..100 percent
    # Since when the running attempt's log, progress and GPUs have not moved, once that
    # lasted its idle_timeout_s (the watchdog); NULL while it moves (docs/jobs.md).
    idle_since: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # The size class an `oom` attempt sent its job on to (`resources.on_oom: next_class`);
    # NULL for every other attempt. Such an attempt is not counted against the retries.
    moved_to: Mapped[str | None] = mapped_column(String(32), nullable=True)
    # The limits it ran under (processes, memory, disk, network), noted before it started;
    # NULL on attempts older than the column (e31_worker.attempt.attemptlimits).
    limits: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)

    # Recent starts per queue: the rate behind a queued job's estimated start.
    __table_args__ = (Index("ix_attempts_started", "started_at"),)


class ServedModel(Base):
    """A language model an operator registered by name (`e31 model add`), which batches'
    requests name in `body.model`: a Hugging Face-format directory on a file system every
    worker reads, or in an object store; nothing is downloaded at run time."""

    __tablename__ = "models"
    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))         # chat | embed
    path: Mapped[str] = mapped_column(Text)               # file:///dir or s3://bucket/dir
    gpu_mem_gb: Mapped[float | None] = mapped_column(Float, nullable=True)  # its size class
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class BatchFile(Base):
    """A file of the OpenAI Files API: a tenant's upload (`purpose` batch) or a batch's output
    (`batch_output`), its bytes in the artifact store (`e31.edge.filestore`)."""

    __tablename__ = "files"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    purpose: Mapped[str] = mapped_column(String(16))
    filename: Mapped[str] = mapped_column(String(255))
    bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)

    __table_args__ = (Index("ix_files_tenant_created", "tenant_id", "created_at"),)


class Batch(Base):
    """A batch of the OpenAI Batch API: its input file's requests in shards, each shard a job
    of the `llm` workload, all of them one array (`array_id`); status, counts and tokens as
    its jobs move (`e31.api.services.batchends`)."""

    __tablename__ = "batches"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    endpoint: Mapped[str] = mapped_column(String(32))
    input_file_id: Mapped[str] = mapped_column(String(40))
    completion_window: Mapped[str] = mapped_column(String(8))
    meta: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON, nullable=True)
    status: Mapped[str] = mapped_column(String(16))
    errors: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    array_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    # Per shard (the array's item of the same index): its model and its request count.
    shards: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    output_file_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    error_file_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    request_total: Mapped[int] = mapped_column(Integer, default=0)
    request_completed: Mapped[int] = mapped_column(Integer, default=0)
    request_failed: Mapped[int] = mapped_column(Integer, default=0)
    rejected: Mapped[int] = mapped_column(Integer, default=0)   # lines of unknown models
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    in_progress_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    finalizing_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    failed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    expired_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    cancelling_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    cancelled_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)

    __table_args__ = (Index("ix_batches_tenant_created", "tenant_id", "created_at"),
                      Index("ix_batches_status", "status"))


# The tables of the job path's Core statements, built once and run on a bare connection
# (`Store._core`, issue 31)
JOBS = cast(Table, Job.__table__)
ATTEMPTS = cast(Table, Attempt.__table__)
TENANTS = cast(Table, Tenant.__table__)
