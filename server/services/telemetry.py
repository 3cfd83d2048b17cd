"""Per-iteration timing telemetry: idempotent batched ingest and windowed reads."""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import Table, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from agent.wire import JobStatus, TelemetryBatch
from server.errors import Conflict, Invalid
from server.models import IterationTelemetry, Job

_T = cast(Table, IterationTelemetry.__table__)
_KEY = ["job_id", "rank", "iteration"]


def ingest(session: Session, job: Job, batch: TelemetryBatch) -> tuple[int, int]:
    """Store a batch; rows already stored for (job, rank, iteration) are skipped, so a retried
    batch never duplicates. Returns (accepted, duplicates)."""
    if job.status == JobStatus.PENDING.value:
        raise Conflict(
            f"job {job.id} is pending; it has no workers to report timings", field="status"
        )
    world = len(job.workers)
    rows: list[dict[str, Any]] = []
    for i, r in enumerate(batch.records):
        if r.rank >= world:
            raise Invalid(
                f"records[{i}].rank is {r.rank}; job {job.id} has {world} workers",
                field=f"records.{i}.rank",
            )
        rows.append(
            {
                "job_id": job.id,
                "rank": r.rank,
                "iteration": r.iteration,
                "plan_version": r.plan_version,
                "batch_size": r.batch_size,
                "data_ms": r.data_ms,
                "compute_ms": r.compute_ms,
                "sync_ms": r.sync_ms,
                "ts": r.ts,
            }
        )
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = insert(_T).on_conflict_do_nothing(index_elements=_KEY).returning(_T.c.id)
    accepted = len(session.execute(stmt, rows).all())
    return accepted, len(rows) - accepted


def window(
    session: Session,
    job_id: int,
    *,
    since_iteration: int = 0,
    rank: int | None = None,
    limit: int = 10_000,
) -> list[IterationTelemetry]:
    q = (
        select(IterationTelemetry)
        .where(IterationTelemetry.job_id == job_id, IterationTelemetry.iteration >= since_iteration)
        .order_by(IterationTelemetry.iteration, IterationTelemetry.rank)
        .limit(limit)
    )
    if rank is not None:
        q = q.where(IterationTelemetry.rank == rank)
    return list(session.scalars(q))
