"""Gangs on demand: jobs.dispatch_host and jobs.dispatch_gpus

Revision ID: 0011
Revises: 0010
"""
import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Set only while a job is published to a node's queue (docs/scheduling.md, "Gangs").
    op.add_column("jobs", sa.Column("dispatch_host", sa.String(200), nullable=True))
    op.add_column("jobs", sa.Column("dispatch_gpus", sa.String(64), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "dispatch_gpus")
    op.drop_column("jobs", "dispatch_host")
