"""Operators' standing controls of a job (pins, exclusions).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21 23:38:39.406492
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        # Existing jobs get no controls; the server default fills their rows.
        batch_op.add_column(
            sa.Column(
                "controls",
                sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
                nullable=False,
                server_default=sa.text("'{}'"),
            )
        )


def downgrade() -> None:
    # In place, not in a batch: see 0029_settled_through (a batch on SQLite drops the table,
    # and its children's rows with it).
    op.drop_column("jobs", "controls")
