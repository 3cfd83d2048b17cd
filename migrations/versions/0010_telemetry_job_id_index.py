"""telemetry: an index on (job_id, id) for the control loop's reads of new rows

Revision ID: 0010_telemetry_job_id
Revises: 0003
Create Date: 2026-11-23 01:40:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0010_telemetry_job_id"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_iteration_telemetry_job_id_id", "iteration_telemetry", ["job_id", "id"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_iteration_telemetry_job_id_id", table_name="iteration_telemetry")
