"""Bounded telemetry: raw rows older than a job's retention window are rolled up into
per-rank aggregates (``TelemetryRollup``) per bucket of :data:`BUCKET` iterations, then deleted.

The window, per job: its newest ``keep_iterations`` iterations, plus, while it runs, every row
of its last ``keep_running_s`` seconds. Everything the models and the straggler watch read is
recent, so it stays raw; the charts read raw rows and rollups as one weighted series
(``server.services.series``). A roll-up is a chunk of whole buckets moved in one transaction
(insert the aggregates, delete the rows), so a reader sees each iteration exactly once.

Probe rows (an excluded rank's occasional measurement) are not aggregated: they are timing
samples for the ladder, which reads only recent ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import ColumnElement, Float, Select, cast, delete, func, insert, literal, select
from sqlalchemy.orm import Session

from contract.enums import JobStatus
from server.models import JOB_RANK, IterationTelemetry, Job, TelemetryRollup

T = IterationTelemetry
R = TelemetryRollup

BUCKET = 100
"""Iterations per rollup row: a 500,000-iteration job keeps 5,000 rows per rank, finer than
any chart of it (which draws a few hundred points)."""

ROWS_PER_CHUNK = 100_000
"""About how many raw rows one roll-up transaction moves (whole buckets, at least one)."""

ROLLUP_COLUMNS = (
    "job_id",
    "rank",
    "first_iteration",
    "last_iteration",
    "count",
    "batch_size",
    "data_ms",
    "compute_ms",
    "compute_min_ms",
    "compute_max_ms",
    "sync_ms",
    "iteration_ms",
    "iteration_min_ms",
    "iteration_max_ms",
    "plan_version_min",
    "plan_version_max",
    "last_ts",
)


@dataclass(frozen=True)
class Window:
    keep_iterations: int = 20_000
    keep_running_s: float = 3600.0


@dataclass
class Retention:
    """What a controller remembers between passes: finished jobs already compacted are not
    looked at again."""

    window: Window
    compacted: set[int] = field(default_factory=set)

    def candidates(self, session: Session) -> list[int]:
        return [
            j for j in session.scalars(select(Job.id).order_by(Job.id)) if j not in self.compacted
        ]

    def roll_up(self, session: Session, job_id: int, *, now: float | None = None) -> int:
        """Roll up one chunk of the job's rows that are due; the number of raw rows removed
        (0 when nothing is due: a finished job is then never looked at again)."""
        job = session.get(Job, job_id)
        if job is None:
            self.compacted.add(job_id)
            return 0
        span = due_span(session, job, self.window, time.time() if now is None else now)
        if span is None:
            if JobStatus(job.status).terminal:
                self.compacted.add(job_id)
            return 0
        return roll_up_span(session, job.id, *span)


def due_span(session: Session, job: Job, window: Window, now: float) -> tuple[int, int] | None:
    """``[lo, hi)``: the oldest chunk of iterations outside the window, whole buckets only."""
    mine = T.job_id == job.id
    oldest = session.scalar(select(func.min(T.iteration)).where(mine))
    newest = session.scalar(select(func.max(T.iteration)).where(mine))
    if oldest is None or newest is None:
        return None
    keep_from = int(newest) - window.keep_iterations + 1
    if not JobStatus(job.status).terminal and window.keep_running_s > 0:
        keep_from = min(
            keep_from,
            _first_iteration_since(
                session, job.id, int(oldest), int(newest), now - window.keep_running_s
            ),
        )
    cut = (keep_from // BUCKET) * BUCKET
    lo = int(oldest)
    if lo >= cut:
        return None
    ranks = max(1, len(job.workers))
    chunk = max(1, ROWS_PER_CHUNK // (ranks * BUCKET)) * BUCKET
    return lo, min(cut, (lo // BUCKET) * BUCKET + chunk)


def _first_iteration_since(session: Session, job_id: int, lo: int, hi: int, since_ts: float) -> int:
    """The first iteration whose row was written at or after ``since_ts``: a bisection over
    the (job, iteration, rank) key, a few dozen seeks instead of a scan of the job's rows
    (iterations end in time order on every rank)."""

    def ts_at(iteration: int) -> float:
        ts = session.scalar(
            select(T.ts)
            .where(T.job_id == job_id, T.iteration >= iteration)
            .order_by(T.iteration)
            .limit(1)
        )
        return float("inf") if ts is None else float(ts)

    if ts_at(lo) >= since_ts:
        return lo
    while hi - lo > 1:  # invariant: ts_at(lo) < since_ts, and hi is newest or ts_at(hi) >= since
        mid = (lo + hi) // 2
        if ts_at(mid) >= since_ts:
            hi = mid
        else:
            lo = mid
    return hi if ts_at(hi) >= since_ts else hi + 1


def roll_up_span(session: Session, job_id: int, lo: int, hi: int) -> int:
    """Aggregate the job's rows of iterations ``[lo, hi)`` per rank and bucket (and one
    job-level row per bucket), then delete them. Returns the raw rows removed."""
    rows = (T.job_id == job_id, T.iteration >= lo, T.iteration < hi)
    session.execute(insert(R).from_select(ROLLUP_COLUMNS, _per_rank(rows)))
    session.execute(insert(R).from_select(ROLLUP_COLUMNS, _job_level(job_id, rows)))
    removed = session.execute(delete(T).where(*rows))
    return int(getattr(removed, "rowcount", 0) or 0)


def _per_rank(rows: tuple[ColumnElement[bool], ...]) -> Select[Any]:
    total = T.data_ms + T.compute_ms + T.sync_ms
    return (
        select(
            T.job_id,
            T.rank,
            func.min(T.iteration),
            func.max(T.iteration),
            func.count(),
            func.avg(cast(T.batch_size, Float)),
            func.avg(T.data_ms),
            func.avg(T.compute_ms),
            func.min(T.compute_ms),
            func.max(T.compute_ms),
            func.avg(T.sync_ms),
            func.avg(total),
            func.min(total),
            func.max(total),
            func.min(T.plan_version),
            func.max(T.plan_version),
            func.max(T.ts),
        )
        .where(*rows, T.probe.is_(False))
        .group_by(T.job_id, T.rank, T.iteration // BUCKET)
    )


def _job_level(job_id: int, rows: tuple[ColumnElement[bool], ...]) -> Select[Any]:
    """Per bucket: what the job waited for each iteration (its slowest rank), and means over
    all ranks."""
    per_iteration = (
        select(
            T.iteration.label("it"),
            func.avg(cast(T.batch_size, Float)).label("b"),
            func.avg(T.data_ms).label("d"),
            func.avg(T.compute_ms).label("c"),
            func.min(T.compute_ms).label("cmin"),
            func.max(T.compute_ms).label("cmax"),
            func.avg(T.sync_ms).label("s"),
            func.max(T.data_ms + T.compute_ms + T.sync_ms).label("slowest"),
            func.min(T.plan_version).label("vmin"),
            func.max(T.plan_version).label("vmax"),
            func.max(T.ts).label("ts"),
        )
        .where(*rows, T.probe.is_(False))
        .group_by(T.iteration)
        .subquery()
    )
    it = per_iteration.c
    return select(
        literal(job_id),
        literal(JOB_RANK),
        func.min(it.it),
        func.max(it.it),
        func.count(),
        func.avg(it.b),
        func.avg(it.d),
        func.avg(it.c),
        func.min(it.cmin),
        func.max(it.cmax),
        func.avg(it.s),
        func.avg(it.slowest),
        func.min(it.slowest),
        func.max(it.slowest),
        func.min(it.vmin),
        func.max(it.vmax),
        func.max(it.ts),
    ).group_by(it.it // BUCKET)


def first_iteration_of_versions(session: Session, job_id: int) -> dict[int, int]:
    """Plan version -> the first iteration of the first rolled-up bucket it was used in
    (bucket resolution: a version used only inside one bucket is not seen)."""
    firsts: dict[int, int] = {}
    for vmin, vmax, first in session.execute(
        select(R.plan_version_min, R.plan_version_max, func.min(R.first_iteration))
        .where(R.job_id == job_id, R.rank == JOB_RANK)
        .group_by(R.plan_version_min, R.plan_version_max)
    ):
        for v in (int(vmin), int(vmax)):
            firsts[v] = min(firsts.get(v, int(first)), int(first))
    return firsts
