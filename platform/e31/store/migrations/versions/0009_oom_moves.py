"""OOM to the next size: attempts.moved_to

Revision ID: 0009
Revises: 0008
"""
import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable ADD COLUMN: no attempt before it moved its job to another class.
    op.add_column("attempts", sa.Column("moved_to", sa.String(32), nullable=True))


def downgrade() -> None:
    op.drop_column("attempts", "moved_to")   # SQLite >= 3.35 drops columns in place
