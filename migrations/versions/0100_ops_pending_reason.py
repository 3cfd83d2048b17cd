"""Jobs: why a pending job waits (kept up to date by the controller's placement).

Revision ID: ops_pending_reason
Revises: 0020_worker_credentials
Create Date: 2026-11-24 03:25:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "ops_pending_reason"
down_revision: str | None = "0020_worker_credentials"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("pending_reason", sa.String(length=500), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("pending_reason")
