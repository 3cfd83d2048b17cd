"""telemetry_rollups: per-rank aggregates of telemetry older than the retention window

Revision ID: 0011_telemetry_rollups
Revises: 0010_telemetry_job_id
Create Date: 2026-11-23 03:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011_telemetry_rollups"
down_revision: str | None = "0010_telemetry_job_id"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "telemetry_rollups",
        sa.Column("id", BigId, nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("first_iteration", sa.BigInteger(), nullable=False),
        sa.Column("last_iteration", sa.BigInteger(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        *(
            sa.Column(name, sa.Float(), nullable=False)
            for name in (
                "batch_size",
                "data_ms",
                "compute_ms",
                "compute_min_ms",
                "compute_max_ms",
                "sync_ms",
                "iteration_ms",
                "iteration_min_ms",
                "iteration_max_ms",
            )
        ),
        sa.Column("plan_version_min", sa.Integer(), nullable=False),
        sa.Column("plan_version_max", sa.Integer(), nullable=False),
        sa.Column("last_ts", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.id"],
            name=op.f("fk_telemetry_rollups_job_id_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_telemetry_rollups")),
    )
    op.create_index(
        "ix_telemetry_rollups_job_rank_first",
        "telemetry_rollups",
        ["job_id", "rank", "first_iteration"],
    )


def downgrade() -> None:
    op.drop_index("ix_telemetry_rollups_job_rank_first", table_name="telemetry_rollups")
    op.drop_table("telemetry_rollups")
