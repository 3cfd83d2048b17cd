"""worker credentials and agent instances: workers.token_hash, hosts.agent_instance

Revision ID: 0020_worker_credentials
Revises: 0011_telemetry_rollups
Create Date: 2026-11-23 03:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020_worker_credentials"
down_revision: str | None = "0011_telemetry_rollups"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("token_hash", sa.String(length=64), nullable=True))
        batch_op.create_unique_constraint(batch_op.f("uq_workers_token_hash"), ["token_hash"])
    with op.batch_alter_table("hosts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("agent_instance", sa.String(length=64), nullable=True))


def downgrade() -> None:
    # In place, not in a batch: see 0029_settled_through (a batch on SQLite drops the table,
    # and its children's rows with it).
    op.drop_column("hosts", "agent_instance")
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("uq_workers_token_hash"), type_="unique")
        batch_op.drop_column("token_hash")
