"""job_metrics: training metrics (the global loss, user-logged values) per rank and iteration

Revision ID: 0021_job_metrics
Revises: 0020_worker_credentials
Create Date: 2026-11-24 03:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021_job_metrics"
down_revision: str | None = "0020_worker_credentials"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "job_metrics",
        sa.Column("id", BigId, nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("iteration", sa.BigInteger(), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_job_metrics_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_metrics")),
        sa.UniqueConstraint(
            "job_id",
            "name",
            "rank",
            "iteration",
            name=op.f("uq_job_metrics_job_id_name_rank_iteration"),
        ),
    )


def downgrade() -> None:
    op.drop_table("job_metrics")
