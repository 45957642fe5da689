"""Limits on what a job can exhaust: attempts.limits

Revision ID: 0012
Revises: 0011
"""
import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable ADD COLUMN: the processes, memory and disk an attempt ran under, noted by its
    # worker before it starts (docs/jobs.md, "Limits"); NULL on older attempts.
    op.add_column("attempts", sa.Column("limits", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("attempts", "limits")   # SQLite >= 3.35 drops columns in place
