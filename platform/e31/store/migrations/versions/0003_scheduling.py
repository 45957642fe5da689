"""scheduling: tenants' quotas and decayed usage; jobs' timeout_s, dependencies, pending reason

Revision ID: 0003
Revises: 0002
"""
import sqlalchemy as sa
from alembic import op

from e31.store.models import UTCDateTime

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN on every backend (SQLite too: batch mode would copy `jobs`, see 0002).
    op.add_column("tenants", sa.Column("quotas", sa.JSON(), nullable=True))
    op.add_column("tenants", sa.Column("usage_gpu_s", sa.Float(), nullable=False,
                                       server_default=sa.text("0")))
    op.add_column("tenants", sa.Column("usage_at", UTCDateTime(), nullable=True))
    op.add_column("jobs", sa.Column("timeout_s", sa.Float(), nullable=False,
                                    server_default=sa.text("86400")))
    op.add_column("jobs", sa.Column("deps_pending", sa.Integer(), nullable=False,
                                    server_default=sa.text("0")))
    op.add_column("jobs", sa.Column("pending_reason", sa.String(32), nullable=True))
    op.add_column("jobs", sa.Column("pending_detail", sa.String(64), nullable=True))
    # Jobs stored before this revision: their spec holds the timeout (always dumped).
    if op.get_bind().dialect.name == "sqlite":
        op.execute("UPDATE jobs SET timeout_s = json_extract(spec, '$.timeout_s') "
                   "WHERE json_extract(spec, '$.timeout_s') IS NOT NULL")
    else:
        op.execute("UPDATE jobs SET timeout_s = (spec->>'timeout_s')::float "
                   "WHERE spec->>'timeout_s' IS NOT NULL")
    op.create_index("ix_jobs_heads", "jobs", ["state", "deps_pending", "queue", "tenant_id",
                                              "priority", "submitted_at"])
    op.create_index("ix_jobs_array_state", "jobs", ["array_id", "state"])
    op.create_index("ix_attempts_started", "attempts", ["started_at"])
    op.create_table(
        "job_deps",
        sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id"), primary_key=True),
        sa.Column("dep_id", sa.String(40), primary_key=True),
    )
    op.create_index("ix_job_deps_dep", "job_deps", ["dep_id"])


def downgrade() -> None:
    op.drop_index("ix_job_deps_dep", table_name="job_deps")
    op.drop_table("job_deps")
    op.drop_index("ix_attempts_started", table_name="attempts")
    op.drop_index("ix_jobs_array_state", table_name="jobs")
    op.drop_index("ix_jobs_heads", table_name="jobs")
    for column in ("pending_detail", "pending_reason", "deps_pending", "timeout_s"):
        op.drop_column("jobs", column)   # SQLite >= 3.35 drops columns in place
    for column in ("usage_at", "usage_gpu_s", "quotas"):
        op.drop_column("tenants", column)
