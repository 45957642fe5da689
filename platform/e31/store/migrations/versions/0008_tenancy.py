"""tenancy: named, expiring tokens; disabled tenants and per-tenant limits; audit log; secrets

Revision ID: 0008
Revises: 0007
"""
import sqlalchemy as sa
from alembic import op

from e31.store.models import UTCDateTime

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable ADD COLUMNs: tokens made before keep no name (shown as their id), no expiry.
    op.add_column("api_keys", sa.Column("name", sa.String(100), nullable=True))
    op.add_column("api_keys", sa.Column("prefix", sa.String(16), nullable=True))
    op.add_column("api_keys", sa.Column("expires_at", UTCDateTime(), nullable=True))
    op.add_column("api_keys", sa.Column("last_used_at", UTCDateTime(), nullable=True))
    op.add_column("tenants", sa.Column("disabled_at", UTCDateTime(), nullable=True))
    op.add_column("tenants", sa.Column("limits", sa.JSON(), nullable=True))
    op.create_table(
        "audit_log",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("at", UTCDateTime(), nullable=False),
        sa.Column("actor", sa.String(100), nullable=False),
        sa.Column("actor_key", sa.String(40), nullable=True),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("target", sa.String(200), nullable=False),
        sa.Column("source", sa.String(100), nullable=True),
        sa.Column("detail", sa.JSON(), nullable=True),
    )
    op.create_index("ix_audit_log_at", "audit_log", ["at"])
    op.create_table(
        "secrets",
        sa.Column("tenant_id", sa.String(40), sa.ForeignKey("tenants.id"), primary_key=True),
        sa.Column("name", sa.String(100), primary_key=True),
        sa.Column("ciphertext", sa.Text(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("secrets")
    op.drop_index("ix_audit_log_at", table_name="audit_log")
    op.drop_table("audit_log")
    for column in ("limits", "disabled_at"):
        op.drop_column("tenants", column)
    for column in ("last_used_at", "expires_at", "prefix", "name"):
        op.drop_column("api_keys", column)
