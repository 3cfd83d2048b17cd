"""artifacts: the files a job's ranks left in their output directories, and their final models

A job's prints and saved model stayed on the agent host's disk. Each rank now reports what it
left (name, size, where) when it ends, and a rank on the default storage (its host's disk)
uploads a copy of the bytes, kept as a blob (0031), so anyone may download them through the
server.

Revision ID: 0032_artifacts
Revises: 0031_blobs
Create Date: 2026-12-07 16:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0032_artifacts"
down_revision: str | None = "0031_blobs"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "artifacts",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=512), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=True),
        sa.Column("blob", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["blob"], ["blobs.sha256"], name=op.f("fk_artifacts_blob_blobs"), ondelete="SET NULL"
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_artifacts_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_artifacts")),
        sa.UniqueConstraint("job_id", "rank", "name", name=op.f("uq_artifacts_job_id_rank_name")),
    )
    op.create_index(op.f("ix_artifacts_job_id"), "artifacts", ["job_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_artifacts_job_id"), table_name="artifacts")
    op.drop_table("artifacts")
