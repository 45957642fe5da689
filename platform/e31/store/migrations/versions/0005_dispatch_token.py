"""dispatch authority: jobs' dispatch token; operators' drain requests

Revision ID: 0005
Revises: 0004
"""
import sqlalchemy as sa
from alembic import op

from e31.store.models import UTCDateTime

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN on every backend (SQLite too: batch mode would copy `jobs`, see 0002).
    op.add_column("jobs", sa.Column("dispatch_token", sa.String(64), nullable=True))
    # Messages published before this revision carry no token and run nothing: their jobs are
    # published again, with one, at the scheduler's next tick instead of after the timeout.
    op.execute("UPDATE jobs SET dispatched_at = NULL "
               "WHERE state = 'queued' AND dispatched_at IS NOT NULL")
    op.create_table(
        "drain_requests",
        sa.Column("node", sa.String(200), primary_key=True),
        sa.Column("requested_at", UTCDateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("drain_requests")
    op.drop_column("jobs", "dispatch_token")   # SQLite >= 3.35 drops columns in place
