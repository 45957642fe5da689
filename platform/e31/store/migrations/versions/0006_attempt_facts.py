"""attempt facts: isolation, start, start_ms, setup_s, gpu_mem_peak_gb, gpu_util_mean

Revision ID: 0006
Revises: 0005
"""
import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

COLUMNS = (
    ("isolation", sa.String(16)),
    ("start", sa.String(8)),
    ("start_ms", sa.Float()),
    ("setup_s", sa.Float()),
    ("gpu_mem_peak_gb", sa.Float()),
    ("gpu_util_mean", sa.Float()),
)


def upgrade() -> None:
    # Plain ADD COLUMN on every backend (SQLite too); earlier attempts keep NULL: not known.
    for name, type_ in COLUMNS:
        op.add_column("attempts", sa.Column(name, type_, nullable=True))


def downgrade() -> None:
    for name, _ in reversed(COLUMNS):
        op.drop_column("attempts", name)   # SQLite >= 3.35 drops columns in place
