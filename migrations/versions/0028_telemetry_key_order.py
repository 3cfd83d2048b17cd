"""telemetry: the unique key in (job_id, iteration, rank) order, and no (job_id, iteration) index

Every telemetry row updated four b-trees: the id, the unique (job_id, rank, iteration) that
dedupes retried posts, (job_id, iteration) for the reads of a job's iterations, and (job_id, id)
for the control loop's. No query reads by rank first: they read a job's iterations (a range of
them, for every rank or for one). The unique key in (job_id, iteration, rank) order serves those
reads (and orders a page of them by iteration and rank without a sort), so the (job_id,
iteration) index goes. ``ON CONFLICT (job_id, rank, iteration)`` finds the key in any column
order, on PostgreSQL and SQLite alike. Side by side (``bench/telemetry_keys.py``, PostgreSQL
on this 2-core machine, 8 rounds of 57,600 rows each), a stored row cost its backend 21.3 us of
CPU instead of 24.7 (median; less in all 8 pairs of rounds) and wrote 437 bytes of WAL instead
of 488. The new key's leaf pages are emptier (a job's rows arrive at the end of its range, not
of each rank's), so that bench's indexes took 56 MB instead of 51; in the fleet
(``bench/fleet.py``, jobs over several hosts) the stored bytes per row grew 0.6%.

Upgrading builds the new unique index over the stored rows (the raw telemetry that retention
keeps: at most ``telemetry_keep_iterations`` per job plus the running jobs' last hour), holding
the table's writes meanwhile; SQLite copies the table.

Revision ID: 0028_telemetry_key_order
Revises: 0027_departures
Create Date: 2026-12-06 03:30:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0028_telemetry_key_order"
down_revision: str | None = "0027_departures"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("iteration_telemetry", schema=None) as batch_op:
        batch_op.create_unique_constraint(
            op.f("uq_iteration_telemetry_job_id_iteration_rank"), ["job_id", "iteration", "rank"]
        )
        batch_op.drop_constraint(
            op.f("uq_iteration_telemetry_job_id_rank_iteration"), type_="unique"
        )
        batch_op.drop_index("ix_iteration_telemetry_job_iteration")


def downgrade() -> None:
    with op.batch_alter_table("iteration_telemetry", schema=None) as batch_op:
        batch_op.create_index(
            "ix_iteration_telemetry_job_iteration", ["job_id", "iteration"], unique=False
        )
        batch_op.create_unique_constraint(
            op.f("uq_iteration_telemetry_job_id_rank_iteration"), ["job_id", "rank", "iteration"]
        )
        batch_op.drop_constraint(
            op.f("uq_iteration_telemetry_job_id_iteration_rank"), type_="unique"
        )
