"""controller_fence: the turn of the active controller, read by each of its writes

The controller lock on PostgreSQL is a session advisory lock on a connection of its own: if
that connection alone broke while the controller's process went on, a standby took the lock
and both wrote until the first next checked its lock, a round later. Each controller now takes
a new epoch with the lock, and its write transactions stop when the epoch is no longer theirs
(``server.controller``). One row, epoch 0.

Revision ID: 0030_controller_fence
Revises: 0029_settled_through
Create Date: 2026-12-07 02:50:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0030_controller_fence"
down_revision: str | None = "0029_settled_through"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    fence = op.create_table(
        "controller_fence",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("holder", sa.String(length=200), nullable=True),
        sa.Column("since", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_controller_fence")),
    )
    op.bulk_insert(fence, [{"id": 1, "epoch": 0}])


def downgrade() -> None:
    op.drop_table("controller_fence")
