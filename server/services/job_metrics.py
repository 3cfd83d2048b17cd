"""Training metrics (the runtime's global ``loss``, what user code logs with ``ctx.log``):
idempotent ingest and downsampled reads for charts.

A metric point is stored once per (job, name, rank, iteration): a retried batch never
duplicates, and the first value stored wins. Reads bucket iterations so a chart gets at most
``points`` values per (name, rank), each the mean of its bucket, computed in SQL."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, Insert, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from contract.agent import MetricBatch
from contract.base import MAX_METRIC_NAMES
from contract.dashboard import MetricSeries, MetricsOut
from contract.enums import JobStatus
from server.errors import Conflict, Invalid, NotFound
from server.models import Job, JobMetric, Worker
from server.services.rank_reports import check_may_write_ranks
from server.services.tokens import Principal

M = JobMetric
KEY = ("job_id", "name", "rank", "iteration")


def ingest(
    session: Session, job_id: int, batch: MetricBatch, principal: Principal
) -> tuple[int, int]:
    """Store a batch; points already stored for (job, name, rank, iteration) are skipped.
    Returns (accepted, duplicates). Refused: another rank's points (403), a job that is pending
    or has ended (409), a rank outside the job or a name beyond the job's
    ``MAX_METRIC_NAMES`` (422, naming the point)."""
    found = session.execute(
        select(
            Job.status,
            select(func.count(Worker.id)).where(Worker.job_id == Job.id).scalar_subquery(),
        ).where(Job.id == job_id)
    ).first()
    if found is None:
        raise NotFound(f"job {job_id} not found")
    status, world = found
    points = batch.points
    check_may_write_ranks(session, principal, job_id, [p.rank for p in points], "post metrics")
    if status == JobStatus.PENDING.value:
        raise Conflict(
            f"job {job_id} is pending; it has no workers to report metrics", field="status"
        )
    if JobStatus(status).terminal:
        raise Conflict(
            f"job {job_id} has ended ({status}); it takes no more metrics", field="status"
        )
    for i, p in enumerate(points):
        if p.rank >= world:
            raise Invalid(
                f"points[{i}].rank is {p.rank}; job {job_id} has {world} workers",
                field=f"points.{i}.rank",
            )
    _check_names(session, job_id, [p.name for p in points])
    rows = [
        {
            "job_id": job_id,
            "name": p.name,
            "rank": p.rank,
            "iteration": p.iteration,
            "value": p.value,
        }
        for p in points
    ]
    stmt: Insert
    if session.get_bind().dialect.name == "postgresql":
        stmt = pg_insert(M).values(rows).on_conflict_do_nothing(index_elements=list(KEY))
    else:
        stmt = sqlite_insert(M).values(rows).on_conflict_do_nothing(index_elements=list(KEY))
    # RETURNING counts the rows inserted on both backends (a multi-row insert's rowcount is
    # -1 under psycopg here); on the Core connection, not the ORM's bulk-insert path.
    accepted = len(session.connection().execute(stmt.returning(M.id)).all())
    return accepted, len(points) - accepted


def _check_names(session: Session, job_id: int, names: list[str]) -> None:
    """At most ``MAX_METRIC_NAMES`` distinct names per job. Known names cost one index probe
    each; the job's names are counted only when the batch brings a new one."""
    wanted = list(dict.fromkeys(names))
    new = [
        n
        for n in wanted
        if session.scalar(select(M.id).where(M.job_id == job_id, M.name == n).limit(1)) is None
    ]
    if not new:
        return
    known = set(session.scalars(select(M.name).where(M.job_id == job_id).distinct()))
    if len(known | set(new)) > MAX_METRIC_NAMES:
        i = names.index(next(n for n in new if n not in known))
        raise Invalid(
            f"points[{i}].name '{names[i]}' would be job {job_id}'s metric number "
            f"{len(known) + 1}; a job may report at most {MAX_METRIC_NAMES} metric names",
            field=f"points.{i}.name",
        )


def downsampled(
    session: Session,
    job: Job,
    *,
    points: int,
    names: Sequence[str] | None = None,
    rank: int | None = None,
) -> MetricsOut:
    """At most ``points`` entries per (name, rank), bucketed by iteration (one bucket width
    for every series, so they line up), each the mean of its bucket; only ``names`` and
    ``rank`` when given."""
    where: list[ColumnElement[bool]] = [M.job_id == job.id]
    if names is not None:
        where.append(M.name.in_(list(names)))
    if rank is not None:
        where.append(M.rank == rank)
    all_names = list(
        session.scalars(select(M.name).where(M.job_id == job.id).distinct().order_by(M.name))
    )
    lo, hi = session.execute(
        select(func.min(M.iteration), func.max(M.iteration)).where(*where)
    ).one()
    out = MetricsOut(
        job_id=job.id,
        bucket=1,
        first_iteration=None,
        last_iteration=None,
        names=all_names,
        series=[],
    )
    if lo is None or hi is None:
        return out
    lo, hi = int(lo), int(hi)
    bucket = max(1, math.ceil((hi - lo + 1) / max(1, points)))
    key = ((M.iteration - lo) // bucket).label("bucket")
    rows = session.execute(
        select(M.name, M.rank, key, func.min(M.iteration), func.avg(M.value))
        .where(*where)
        .group_by(M.name, M.rank, key)
        .order_by(M.name, M.rank, key)
    )
    series: dict[tuple[str, int], dict[str, list[Any]]] = {}
    for name, r, _, first, value in rows:
        cols = series.setdefault((str(name), int(r)), {"it": [], "v": []})
        cols["it"].append(int(first))
        cols["v"].append(float(value))
    last = _last_points(session, where)
    return out.model_copy(
        update={
            "bucket": bucket,
            "first_iteration": lo,
            "last_iteration": hi,
            "series": [
                MetricSeries(
                    name=n,
                    rank=r,
                    iteration=c["it"],
                    value=c["v"],
                    last_iteration=last[n, r][0],
                    last_value=last[n, r][1],
                )
                for (n, r), c in series.items()
            ],
        }
    )


def _last_points(
    session: Session, where: list[ColumnElement[bool]]
) -> dict[tuple[str, int], tuple[int, float]]:
    """Each (name, rank)'s newest point: its iteration and value."""
    newest = (
        select(M.name, M.rank, func.max(M.iteration).label("it"))
        .where(*where)
        .group_by(M.name, M.rank)
        .subquery()
    )
    rows = session.execute(
        select(M.name, M.rank, M.iteration, M.value)
        .join(
            newest,
            (M.name == newest.c.name) & (M.rank == newest.c.rank) & (M.iteration == newest.c.it),
        )
        .where(*where)
    )
    return {(str(n), int(r)): (int(it), float(v)) for n, r, it, v in rows}
