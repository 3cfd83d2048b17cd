"""memory-aware plans: iteration_telemetry.peak_memory_mb, .oom_batch, .pass_size; plans.memory_caps

Revision ID: 0025_memory_plans
Revises: 0024_log_tail
Create Date: 2026-11-24 03:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0025_memory_plans"
down_revision: str | None = "0024_log_tail"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

Json = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("iteration_telemetry", schema=None) as batch_op:
        batch_op.add_column(sa.Column("peak_memory_mb", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("oom_batch", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("pass_size", sa.Integer(), nullable=True))
    with op.batch_alter_table("plans", schema=None) as batch_op:
        batch_op.add_column(sa.Column("memory_caps", Json, nullable=True))


def downgrade() -> None:
    # In place, not in a batch: see 0029_settled_through (a batch on SQLite drops the table,
    # and its children's rows with it).
    op.drop_column("plans", "memory_caps")
    op.drop_column("iteration_telemetry", "pass_size")
    op.drop_column("iteration_telemetry", "oom_batch")
    op.drop_column("iteration_telemetry", "peak_memory_mb")
