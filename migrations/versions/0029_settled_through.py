"""jobs.settled_through: where the rebalancer's models were all identified (for a takeover)

A policy that plans once after warm-up (``static``, ``adaptive``) keeps that plan; the
rebalancer knew it had settled only in the controller's memory. A controller that took over
took every job for one still exploring and planned it again on the window it saw (a static
job's plan, made in the middle of a slowdown, then starved the slow rank for good). The job
now says so itself: the iteration every rank had reported when the rebalancer's first
decision on identified models was made; None while it explores, and again from a restart.

Revision ID: 0029_settled_through
Revises: 0028_telemetry_key_order
Create Date: 2026-12-06 22:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0029_settled_through"
down_revision: str | None = "0028_telemetry_key_order"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


SETTLED_BEFORE = sa.text(
    "UPDATE jobs SET settled_through = 0 "
    "WHERE attempt = 0 AND status IN ('starting', 'running') AND EXISTS ("
    "SELECT 1 FROM plans WHERE plans.job_id = jobs.id AND plans.source = 'automatic' "
    "AND plans.reason NOT LIKE :exploring)"
).bindparams(exploring="%exploring:%")
"""The live jobs the rebalancer had settled before the upgrade: those with a plan it made on
identified models (every plan made while exploring says ``exploring:``). Without the mark, the
controller started after the upgrade would take their automatic plan in force for one made on
guesses and replace it. A job on its second attempt or later is left to explore again (its
plans before the restart are not its attempt's)."""


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("settled_through", sa.Integer(), nullable=True))
    op.execute(SETTLED_BEFORE)


def downgrade() -> None:
    # Not in a batch: on SQLite a batch copies the table and drops the old one, and dropping
    # ``jobs`` deletes every job's workers, plans and telemetry (their keys cascade). SQLite
    # drops a plain column in place (3.35 and later).
    op.drop_column("jobs", "settled_through")
