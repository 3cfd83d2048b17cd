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
    op.add_column(
        "jobs", sa.Column("logs_followed_until", sa.DateTime(timezone=True), nullable=True)
    )
    op.add_column("workers", sa.Column("log_end", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    # Not in a batch: on SQLite a batch copies the table and drops the old one, and dropping
    # ``jobs`` or ``workers`` deletes the rows that hang off them (their keys cascade). SQLite
    # drops a plain column in place (3.35 and later).
    op.drop_column("workers", "log_end")
    op.drop_column("jobs", "logs_followed_until")
