"""artifact quotas: tenants' outputs cap and running total; when gc removed a job's artifacts

Revision ID: 0004
Revises: 0003
"""
from collections import defaultdict

import sqlalchemy as sa
from alembic import op

from e31.store.models import UTCDateTime

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

BACKFILL_BATCH = 1000   # jobs read at a time while outputs stored so far are added up


def upgrade() -> None:
    # Plain ADD COLUMN on every backend (SQLite too: batch mode would copy `jobs`, see 0002).
    op.add_column("tenants", sa.Column("outputs_max_bytes", sa.BigInteger(), nullable=True))
    op.add_column("tenants", sa.Column("outputs_bytes", sa.BigInteger(), nullable=False,
                                       server_default=sa.text("0")))
    op.add_column("jobs", sa.Column("artifacts_removed_at", UTCDateTime(), nullable=True))
    op.create_index("ix_jobs_ended", "jobs", ["ended_at"])
    _backfill_outputs_bytes()


def _backfill_outputs_bytes() -> None:
    """Outputs stored before this revision count towards their tenant's total: the sizes each
    job's row lists (its last recorded attempt's outputs), added up per tenant."""
    bind = op.get_bind()
    jobs = sa.table("jobs", sa.column("id", sa.String), sa.column("tenant_id", sa.String),
                    sa.column("outputs", sa.JSON))
    tenants = sa.table("tenants", sa.column("id", sa.String),
                       sa.column("outputs_bytes", sa.BigInteger))
    totals: dict[str, int] = defaultdict(int)
    after = ""
    while True:
        rows = bind.execute(sa.select(jobs.c.id, jobs.c.tenant_id, jobs.c.outputs)
                            .where(jobs.c.id > after, jobs.c.outputs.is_not(None))
                            .order_by(jobs.c.id).limit(BACKFILL_BATCH)).all()
        if not rows:
            break
        for _, tenant_id, outputs in rows:
            totals[tenant_id] += sum(int(o.get("size") or 0) for o in outputs or []
                                     if isinstance(o, dict))
        after = rows[-1][0]
    for tenant_id, total in totals.items():
        bind.execute(tenants.update().where(tenants.c.id == tenant_id)
                     .values(outputs_bytes=total))


def downgrade() -> None:
    op.drop_index("ix_jobs_ended", table_name="jobs")
    op.drop_column("jobs", "artifacts_removed_at")   # SQLite >= 3.35 drops columns in place
    for column in ("outputs_bytes", "outputs_max_bytes"):
        op.drop_column("tenants", column)
