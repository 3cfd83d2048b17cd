"""Workers: index (host_id, state), so a heartbeat finds its host's live ranks without reading
every rank the host ever ran (it replaces the index on host_id alone, a prefix of it).

Revision ID: 0026_worker_host_state
Revises: 0025_memory_plans
Create Date: 2026-11-24 18:40:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0026_worker_host_state"
down_revision: str | None = "0025_memory_plans"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.drop_index("ix_workers_host_id")
        batch_op.create_index("ix_workers_host_state", ["host_id", "state"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.drop_index("ix_workers_host_state")
        batch_op.create_index("ix_workers_host_id", ["host_id"], unique=False)
