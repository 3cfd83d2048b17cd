"""logs followed: until when someone follows a job's logs

`evenflow jobs logs --follow` streams the live log of running ranks: while a job's logs are
followed its agents upload the running ranks' log tails with their heartbeats, and a heartbeat's
answer says until when (so the column is one the kept heartbeat answers depend on). A rank's
log tail comes with where it ends in the log (bytes), so a follower prints only what is new.

Revision ID: 0033_logs_followed
Revises: 0032_artifacts
Create Date: 2026-12-07 21:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0033_logs_followed"
down_revision: str | None = "0032_artifacts"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(
            sa.Column("logs_followed_until", sa.DateTime(timezone=True), nullable=True)
        )
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("log_end", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("log_end")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("logs_followed_until")
