"""blobs: bytes uploaded to the control plane, stored in pieces; jobs.context names a code archive

A job could only run code already installed on every host. Its code now travels with it: the
archive's bytes go into the database (so every server sharing it can serve them) in pieces,
read and written a piece at a time, named by their SHA-256, and ``jobs.context`` names the
archive a job runs, so an agent's right to fetch one is one indexed lookup. A job's outputs are
kept the same way (``artifacts``, 0032).

Revision ID: 0031_blobs
Revises: 0030_controller_fence
Create Date: 2026-12-07 16:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0031_blobs"
down_revision: str | None = "0030_controller_fence"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "blobs",
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("chunks", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.String(length=128), nullable=False),
        sa.PrimaryKeyConstraint("sha256", name=op.f("pk_blobs")),
    )
    op.create_table(
        "blob_chunks",
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["sha256"],
            ["blobs.sha256"],
            name=op.f("fk_blob_chunks_sha256_blobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("sha256", "seq", name=op.f("pk_blob_chunks")),
    )
    op.add_column("jobs", sa.Column("context", sa.String(length=64), nullable=True))
    op.create_index(op.f("ix_jobs_context"), "jobs", ["context"], unique=False)


def downgrade() -> None:
    # The column in place, not in a batch: see 0029_settled_through (a batch on SQLite drops the
    # table, and its children's rows with it).
    op.drop_index(op.f("ix_jobs_context"), table_name="jobs")
    op.drop_column("jobs", "context")
    op.drop_table("blob_chunks")
    op.drop_table("blobs")
