"""watchdog and GPU health: attempts.idle_since, drain_requests.reason

Revision ID: 0007
Revises: 0006
"""
import sqlalchemy as sa
from alembic import op

from e31.store.models import UTCDateTime

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable ADD COLUMNs: a running attempt is not idle, an operator's drain has no reason.
    op.add_column("attempts", sa.Column("idle_since", UTCDateTime(), nullable=True))
    op.add_column("drain_requests", sa.Column("reason", sa.String(500), nullable=True))


def downgrade() -> None:
    op.drop_column("drain_requests", "reason")   # SQLite >= 3.35 drops columns in place
    op.drop_column("attempts", "idle_since")
