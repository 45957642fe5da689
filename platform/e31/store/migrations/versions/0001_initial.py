"""initial schema: tenants, api keys, jobs, attempts

Revision ID: 0001
Revises:
"""
import sqlalchemy as sa
from alembic import op

from e31.store.models import UTCDateTime

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("name", sa.String(100), nullable=False, unique=True),
        sa.Column("admin", sa.Boolean(), nullable=False),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant_id", sa.String(40), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("revoked_at", UTCDateTime(), nullable=True),
    )
    op.create_index("ix_api_keys_tenant_id", "api_keys", ["tenant_id"])
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant_id", sa.String(40), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("size_class", sa.String(32), nullable=False),
        sa.Column("queue", sa.String(64), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.String(32), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("submitted_at", UTCDateTime(), nullable=False),
        sa.Column("queued_since", UTCDateTime(), nullable=True),
        sa.Column("not_before", UTCDateTime(), nullable=True),
        sa.Column("started_at", UTCDateTime(), nullable=True),
        sa.Column("ended_at", UTCDateTime(), nullable=True),
        sa.Column("dispatched_at", UTCDateTime(), nullable=True),
        sa.Column("dispatch_count", sa.Integer(), nullable=False),
        sa.Column("attempts_used", sa.Integer(), nullable=False),
        sa.Column("lease_owner", sa.String(200), nullable=True),
        sa.Column("lease_token", sa.Integer(), nullable=False),
        sa.Column("lease_expires_at", UTCDateTime(), nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("progress_done", sa.Float(), nullable=True),
        sa.Column("progress_total", sa.Float(), nullable=True),
        sa.Column("gpu_seconds", sa.Float(), nullable=False),
        sa.Column("run_seconds", sa.Float(), nullable=False),
        sa.Column("queued_seconds", sa.Float(), nullable=False),
        sa.Column("outputs", sa.JSON(), nullable=True),
    )
    op.create_index("ix_jobs_dispatch", "jobs",
                    ["state", "queue", "dispatched_at", "priority", "submitted_at"])
    op.create_index("ix_jobs_tenant_submitted", "jobs", ["tenant_id", "submitted_at"])
    op.create_index("ix_jobs_state_lease", "jobs", ["state", "lease_expires_at"])
    op.create_table(
        "attempts",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id"), nullable=False),
        sa.Column("n", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(200), nullable=False),
        sa.Column("gpus", sa.String(100), nullable=False),
        sa.Column("gpu_count", sa.Integer(), nullable=False),
        sa.Column("started_at", UTCDateTime(), nullable=False),
        sa.Column("ended_at", UTCDateTime(), nullable=True),
        sa.Column("reason", sa.String(32), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("exit_code", sa.Integer(), nullable=True),
    )
    op.create_index("ix_attempts_job_id", "attempts", ["job_id"])


def downgrade() -> None:
    op.drop_table("attempts")
    op.drop_table("jobs")
    op.drop_table("api_keys")
    op.drop_table("tenants")
