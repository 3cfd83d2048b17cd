"""ranks that left a running job for good: jobs.departures, plans.departed

Revision ID: 0027_departures
Revises: 0026_worker_host_state
Create Date: 2026-11-24 20:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0027_departures"
down_revision: str | None = "0026_worker_host_state"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

Json = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("departures", Json, nullable=True))
    with op.batch_alter_table("plans", schema=None) as batch_op:
        batch_op.add_column(sa.Column("departed", Json, nullable=True))


def downgrade() -> None:
    # In place, not in a batch: see 0029_settled_through (a batch on SQLite drops the table,
    # and its children's rows with it).
    op.drop_column("plans", "departed")
    op.drop_column("jobs", "departures")
