"""Workers: the last lines of a rank's log, uploaded by its agent when the rank ends unsuccessfully.

Revision ID: 0024_log_tail
Revises: 0023_pending_reason
Create Date: 2026-11-24 03:45:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0024_log_tail"
down_revision: str | None = "0023_pending_reason"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("log_tail", sa.Text(), nullable=True))


def downgrade() -> None:
    # In place, not in a batch: see 0029_settled_through (a batch on SQLite drops the table,
    # and its children's rows with it).
    op.drop_column("workers", "log_tail")
