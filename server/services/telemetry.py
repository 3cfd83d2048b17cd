"""Per-iteration timing telemetry: idempotent batched ingest and windowed reads."""

from __future__ import annotations

from itertools import repeat
from typing import Any

from sqlalchemy import Connection, bindparam, func, select, text
from sqlalchemy.orm import Session

from contract.agent import TELEMETRY_FIELDS, TelemetryBatch
from contract.enums import JobStatus
from server.errors import Conflict, Invalid, NotFound
from server.models import IterationTelemetry, Job, Worker
from server.services.jobs import check_may_write_ranks
from server.services.paging import Paging, page
from server.services.tokens import Principal

Row = tuple[
    int, int, int, int, int, float, float, float, float, bool, float | None, int | None, int | None
]
"""A telemetry row as inserted: the job id, then ``COLUMNS``."""


def ingest(
    conn: Connection, job_id: int, batch: TelemetryBatch, principal: Principal
) -> tuple[int, int]:
    """Store a batch; rows already stored for (job, rank, iteration) are skipped, so a retried
    batch never duplicates. Returns (accepted, duplicates).

    The hot write path (bench/ingest.py), so it works on a Core connection, not an ORM session:
    one query for the job's status and size (and one for an agent's rights over the ranks),
    then one bulk
    insert straight from the batch's per-field arrays (``TelemetryBatch.arrays``; a columnar
    batch hands over the lists it was parsed into)."""
    found = conn.execute(_JOB_STATE, {"job_id": job_id}).first()
    if found is None:
        raise NotFound(f"job {job_id} not found")
    status, world = found
    arrays = batch.arrays()  # one list per field, in COLUMNS order
    ranks = arrays[0]
    check_may_write_ranks(conn, principal, job_id, ranks)
    if status == JobStatus.PENDING.value:
        raise Conflict(
            f"job {job_id} is pending; it has no workers to report timings", field="status"
        )
    if JobStatus(status).terminal:
        raise Conflict(
            f"job {job_id} has ended ({status}); it takes no more telemetry", field="status"
        )
    if max(ranks) >= world:
        i = next(i for i, rank in enumerate(ranks) if rank >= world)
        where, shown = (
            (f"records.{i}.rank", f"records[{i}].rank")
            if batch.records is not None
            else (f"columns.rank.{i}", f"columns.rank[{i}]")
        )
        raise Invalid(f"{shown} is {ranks[i]}; job {job_id} has {world} workers", field=where)
    if conn.dialect.name == "postgresql":
        accepted = _insert_postgresql(conn, job_id, arrays)
    else:
        accepted = _insert_sqlite(conn, list(zip(repeat(job_id), *arrays)))
    return accepted, len(ranks) - accepted


_JOB_STATE = select(
    Job.status,
    select(func.count(Worker.id)).where(Worker.job_id == Job.id).scalar_subquery(),
).where(Job.id == bindparam("job_id"))

# Bulk inserts, measured (bench/ingest.py): on PostgreSQL one INSERT ... SELECT FROM unnest()
# of per-column arrays is ~3x faster than a multi-row VALUES insert; on SQLite a plain
# executemany is fastest. Both skip existing keys and report how many rows they inserted.
COLUMNS = TELEMETRY_FIELDS  # a row's values, after its job id
_PG_TYPES = (  # of COLUMNS, in order
    "integer",
    "bigint",
    "integer",
    "integer",
    "float8",
    "float8",
    "float8",
    "float8",
    "boolean",
    "float8",
    "integer",
    "integer",
)
_PG_ARRAYS = ", ".join(f"CAST(:{c} AS {t}[])" for c, t in zip(COLUMNS, _PG_TYPES, strict=True))
_PG_INSERT = text(
    f"INSERT INTO iteration_telemetry (job_id, {', '.join(COLUMNS)}) "
    f"SELECT :job_id, * FROM unnest({_PG_ARRAYS}) "
    "ON CONFLICT (job_id, rank, iteration) DO NOTHING"
)
_SQLITE_INSERT = (
    f"INSERT INTO iteration_telemetry (job_id, {', '.join(COLUMNS)}) "
    f"VALUES ({', '.join('?' * (len(COLUMNS) + 1))}) "
    "ON CONFLICT (job_id, rank, iteration) DO NOTHING"
)


def _insert_postgresql(conn: Connection, job_id: int, arrays: tuple[list[Any], ...]) -> int:
    params: dict[str, Any] = dict(zip(COLUMNS, arrays, strict=True))
    params["job_id"] = job_id
    return int(conn.execute(_PG_INSERT, params).rowcount)


def _insert_sqlite(conn: Connection, rows: list[Row]) -> int:
    return int(conn.exec_driver_sql(_SQLITE_INSERT, rows).rowcount)


def window(
    session: Session,
    job_id: int,
    *,
    since_iteration: int = 0,
    rank: int | None = None,
    paging: Paging = Paging(),
) -> tuple[list[IterationTelemetry], int]:
    """A page of the job's timings from ``since_iteration`` on, by iteration and rank."""
    q = (
        select(IterationTelemetry)
        .where(IterationTelemetry.job_id == job_id, IterationTelemetry.iteration >= since_iteration)
        .order_by(IterationTelemetry.iteration, IterationTelemetry.rank)
    )
    if rank is not None:
        q = q.where(IterationTelemetry.rank == rank)
    return page(session, q, paging)
