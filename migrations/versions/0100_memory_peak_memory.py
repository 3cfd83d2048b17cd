"""iteration_telemetry.peak_memory_mb: peak device memory of each iteration's compute

Revision ID: memory_peak_memory
Revises: 0020_worker_credentials
Create Date: 2026-11-24 03:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "memory_peak_memory"
down_revision: str | None = "0020_worker_credentials"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("iteration_telemetry", schema=None) as batch_op:
        batch_op.add_column(sa.Column("peak_memory_mb", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("iteration_telemetry", schema=None) as batch_op:
        batch_op.drop_column("peak_memory_mb")
