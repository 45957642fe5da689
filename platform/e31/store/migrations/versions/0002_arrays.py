"""arrays: N jobs submitted as one (sweeps); jobs.array_id and jobs.array_index

Revision ID: 0002
Revises: 0001
"""
import sqlalchemy as sa
from alembic import op

from e31.store.models import UTCDateTime

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "arrays",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant_id", sa.String(40), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("submitted_at", UTCDateTime(), nullable=False),
    )
    op.create_index("ix_arrays_tenant_submitted", "arrays", ["tenant_id", "submitted_at"])
    # SQLite: ALTER TABLE ADD COLUMN with an inline REFERENCES, not batch mode's copy-and-move,
    # which drops `jobs` and fails on a store whose attempts point at it (foreign_keys=ON).
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE jobs ADD COLUMN array_id VARCHAR(40) REFERENCES arrays (id)")
        op.add_column("jobs", sa.Column("array_index", sa.Integer(), nullable=True))
    else:
        op.add_column("jobs", sa.Column("array_id", sa.String(40), nullable=True))
        op.add_column("jobs", sa.Column("array_index", sa.Integer(), nullable=True))
        op.create_foreign_key("fk_jobs_array_id_arrays", "jobs", "arrays", ["array_id"], ["id"])
    op.create_index("ix_jobs_array", "jobs", ["array_id", "array_index"], unique=True)


def downgrade() -> None:
    # On SQLite this copies `jobs` (batch mode), which needs foreign_keys=OFF when attempts exist.
    op.drop_index("ix_jobs_array", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        if op.get_bind().dialect.name != "sqlite":
            batch.drop_constraint("fk_jobs_array_id_arrays", type_="foreignkey")
        batch.drop_column("array_index")
        batch.drop_column("array_id")
    op.drop_index("ix_arrays_tenant_submitted", table_name="arrays")
    op.drop_table("arrays")
