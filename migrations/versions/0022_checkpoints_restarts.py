"""checkpoints and restarts: the checkpoints table, jobs.attempt, jobs.restart_history

Revision ID: 0022_checkpoints_restarts
Revises: 0021_job_metrics
Create Date: 2026-11-24 03:05:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0022_checkpoints_restarts"
down_revision: str | None = "0021_job_metrics"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("iteration", sa.BigInteger(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("write_ms", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.id"],
            name=op.f("fk_checkpoints_job_id_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
    )
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_checkpoints_job_id"), ["job_id"], unique=False)
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        # Existing jobs are on their first attempt and were never restarted.
        batch_op.add_column(
            sa.Column("attempt", sa.Integer(), nullable=False, server_default=sa.text("0"))
        )
        batch_op.add_column(
            sa.Column(
                "restart_history",
                sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
                nullable=False,
                server_default=sa.text("'[]'"),
            )
        )


def downgrade() -> None:
    # In place, not in a batch: see 0029_settled_through (a batch on SQLite drops the table,
    # and its children's rows with it).
    op.drop_column("jobs", "restart_history")
    op.drop_column("jobs", "attempt")
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_checkpoints_job_id"))
    op.drop_table("checkpoints")
