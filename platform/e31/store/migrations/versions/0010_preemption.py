"""Preemption: jobs.preemptible and jobs.preempt_requested_at

Revision ID: 0010
Revises: 0009
"""
import sqlalchemy as sa
from alembic import op

from e31.store.models import UTCDateTime

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Jobs stored before it were never preemptible: the server default says so.
    op.add_column("jobs", sa.Column("preemptible", sa.Boolean(), nullable=False,
                                    server_default=sa.text("false")))
    op.add_column("jobs", sa.Column("preempt_requested_at", UTCDateTime(), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "preempt_requested_at")
    op.drop_column("jobs", "preemptible")
