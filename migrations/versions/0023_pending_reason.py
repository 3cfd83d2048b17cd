"""Jobs: why a pending job waits (kept up to date by the controller's placement).

Revision ID: 0023_pending_reason
Revises: 0022_checkpoints_restarts
Create Date: 2026-11-24 03:25:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0023_pending_reason"
down_revision: str | None = "0022_checkpoints_restarts"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("pending_reason", sa.String(length=500), nullable=True))


def downgrade() -> None:
    # In place, not in a batch: see 0029_settled_through (a batch on SQLite drops the table,
    # and its children's rows with it).
    op.drop_column("jobs", "pending_reason")
