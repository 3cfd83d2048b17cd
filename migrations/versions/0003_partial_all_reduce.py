"""Partial all-reduce: plans name excluded ranks; telemetry marks their probes.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21 23:50:07.238635
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("iteration_telemetry", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("probe", sa.Boolean(), nullable=False, server_default=sa.false())
        )

    with op.batch_alter_table("plans", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "excluded",
                sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
                nullable=False,
                server_default=sa.text("'[]'"),
            )
        )


def downgrade() -> None:
    # In place, not in a batch: see 0029_settled_through (a batch on SQLite drops the table,
    # and its children's rows with it).
    op.drop_column("plans", "excluded")

    op.drop_column("iteration_telemetry", "probe")
