"""Batches of requests to language models: models, files, batches, jobs.deadline_at; and
the index of an admin's list of every tenant's jobs

Revision ID: 0013
Revises: 0012
"""
import sqlalchemy as sa
from alembic import op

from e31.store.models import UTCDateTime

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable ADD COLUMN: when a job is due (a batch's window); NULL on every older job.
    op.add_column("jobs", sa.Column("deadline_at", UTCDateTime(), nullable=True))
    # An admin's list of every tenant's jobs, newest first (GET /v1/jobs?all_tenants=true).
    op.create_index("ix_jobs_submitted", "jobs", ["submitted_at"])
    op.create_table(
        "models",
        sa.Column("name", sa.String(100), primary_key=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("gpu_mem_gb", sa.Float(), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
    )
    op.create_table(
        "files",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant_id", sa.String(40), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("purpose", sa.String(16), nullable=False),
        sa.Column("filename", sa.String(255), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
    )
    op.create_index("ix_files_tenant_created", "files", ["tenant_id", "created_at"])
    stamps = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
              "cancelling_at", "cancelled_at")
    op.create_table(
        "batches",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant_id", sa.String(40), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("endpoint", sa.String(32), nullable=False),
        sa.Column("input_file_id", sa.String(40), nullable=False),
        sa.Column("completion_window", sa.String(8), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("errors", sa.JSON(), nullable=True),
        sa.Column("array_id", sa.String(40), nullable=True),
        sa.Column("shards", sa.JSON(), nullable=False),
        sa.Column("output_file_id", sa.String(40), nullable=True),
        sa.Column("error_file_id", sa.String(40), nullable=True),
        *(sa.Column(n, sa.Integer(), nullable=False) for n in
          ("request_total", "request_completed", "request_failed", "rejected")),
        *(sa.Column(n, sa.BigInteger(), nullable=False) for n in
          ("prompt_tokens", "completion_tokens")),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("expires_at", UTCDateTime(), nullable=False),
        *(sa.Column(n, UTCDateTime(), nullable=True) for n in stamps),
    )
    op.create_index("ix_batches_tenant_created", "batches", ["tenant_id", "created_at"])
    op.create_index("ix_batches_status", "batches", ["status"])


def downgrade() -> None:
    op.drop_table("batches")
    op.drop_table("files")
    op.drop_table("models")
    op.drop_index("ix_jobs_submitted", table_name="jobs")
    op.drop_column("jobs", "deadline_at")
