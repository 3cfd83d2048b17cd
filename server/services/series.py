"""Telemetry shaped for the dashboard: downsampled histories, rows after a stream cursor,
recent throughput. Reads only; the charts' points are computed here so a page with a long
history loads a bounded number of points per worker."""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import ColumnElement, Float, Subquery, cast, func, literal, select, union_all
from sqlalchemy.orm import Session

from contract.dashboard import PlanEffect, RankSeries, RankWindow, SeriesOut, ThroughputOut
from server.models import JOB_RANK, IterationTelemetry, Job, StragglerEvent, TelemetryRollup
from server.services import retention, telemetry

T = IterationTelemetry
R = TelemetryRollup
STREAM_COLUMNS = tuple(
    c for c in telemetry.COLUMNS if c not in ("probe", "peak_memory_mb", "oom_batch", "pass_size")
)
"""Column order of the rows a ``telemetry`` stream message carries."""


def downsampled(
    session: Session, job: Job, *, points: int, window_iterations: int = 20
) -> SeriesOut:
    """At most ``points`` points per rank, bucketed by iteration, plus when each plan version
    took effect and each rank's mean timings over the last ``window_iterations`` iterations.

    Everything is read up to one telemetry row id (returned as ``last_id``), so a stream
    started after it neither misses nor repeats a row."""
    last_id = int(session.scalar(select(func.max(T.id)).where(T.job_id == job.id)) or 0)
    rolled = (R.job_id == job.id,)
    rlo, rhi = session.execute(
        select(func.min(R.first_iteration), func.max(R.last_iteration)).where(*rolled)
    ).one()
    # ``id + 0``: the id bound is a filter, not the index range, so a job's rows are read by
    # its iterations after the rolled-up ones (a roll-up deletes every row of its span). Until
    # vacuumed, the deleted rows stay in both indexes, and a read through the (job, id) index
    # would visit all of them and their heap pages.
    mine: tuple[ColumnElement[bool], ...] = (T.job_id == job.id, (T.id + 0) <= last_id)
    if rhi is not None:
        mine = (*mine, T.iteration > int(rhi))
    lo, hi = session.execute(
        select(func.min(T.iteration), func.max(T.iteration)).where(*mine)
    ).one()
    if rlo is not None:
        lo = rlo if lo is None else min(lo, rlo)
        hi = rhi if hi is None else max(hi, rhi)
    out = SeriesOut(
        job_id=job.id,
        world_size=len(job.workers),
        bucket=1,
        first_iteration=None,
        last_iteration=None,
        last_id=last_id,
        ranks=[],
        measured={"iteration": [], "iteration_ms": []},
        plan_effects=[],
        window=[],
        window_iterations=window_iterations,
    )
    if lo is None or hi is None:
        return out
    lo, hi = int(lo), int(hi)
    bucket = max(1, math.ceil((hi - lo + 1) / max(1, points)))
    return out.model_copy(
        update={
            "bucket": bucket,
            "first_iteration": lo,
            "last_iteration": hi,
            "ranks": _rank_series(session, mine, rolled, lo, bucket),
            "measured": _slowest_per_bucket(session, mine, rolled, lo, bucket),
            "plan_effects": _plan_effects(session, mine, job.id),
            "window": _window(session, mine, hi - window_iterations),
        }
    )


def _rank_series(
    session: Session,
    mine: tuple[ColumnElement[bool], ...],
    rolled: tuple[ColumnElement[bool], ...],
    lo: int,
    bucket: int,
) -> list[RankSeries]:
    """Each rank's mean timings and batch size per bucket of iterations."""
    u = _per_rank_history(mine, rolled)
    key = ((u.c.first - lo) // bucket).label("bucket")
    n = func.sum(u.c.n)
    per_rank: dict[int, dict[str, list[Any]]] = {}
    rows = session.execute(
        select(
            u.c.rank,
            key,
            func.min(u.c.first),
            func.sum(u.c.b) / n,
            func.sum(u.c.d) / n,
            func.sum(u.c.c) / n,
            func.sum(u.c.s) / n,
            func.max(u.c.v),
        )
        .group_by(u.c.rank, key)
        .order_by(u.c.rank, key)
    )
    for rank, _, first, b, d, c, s, v in rows:
        cols = per_rank.setdefault(int(rank), {k: [] for k in ("it", "b", "d", "c", "s", "v")})
        cols["it"].append(int(first))
        cols["b"].append(round(float(b), 2))
        cols["d"].append(round(float(d), 3))
        cols["c"].append(round(float(c), 3))
        cols["s"].append(round(float(s), 3))
        cols["v"].append(int(v))
    return [
        RankSeries(
            rank=r,
            iteration=c["it"],
            batch_size=c["b"],
            data_ms=c["d"],
            compute_ms=c["c"],
            sync_ms=c["s"],
            plan_version=c["v"],
        )
        for r, c in sorted(per_rank.items())
    ]


def _per_rank_history(
    mine: tuple[ColumnElement[bool], ...], rolled: tuple[ColumnElement[bool], ...]
) -> Subquery:
    """Raw rows (each a count of 1) and per-rank rollups (sums: mean times count) as one
    table: rank, first iteration, n, and sums of batch size, data, compute and sync."""
    raw = select(
        T.rank.label("rank"),
        T.iteration.label("first"),
        literal(1).label("n"),
        cast(T.batch_size, Float).label("b"),
        T.data_ms.label("d"),
        T.compute_ms.label("c"),
        T.sync_ms.label("s"),
        T.plan_version.label("v"),
    ).where(*mine)
    old = select(
        R.rank,
        R.first_iteration,
        R.count,
        R.batch_size * R.count,
        R.data_ms * R.count,
        R.compute_ms * R.count,
        R.sync_ms * R.count,
        R.plan_version_max,
    ).where(*rolled, R.rank != JOB_RANK)
    return union_all(raw, old).subquery()


def _slowest_per_bucket(
    session: Session,
    mine: tuple[ColumnElement[bool], ...],
    rolled: tuple[ColumnElement[bool], ...],
    lo: int,
    bucket: int,
) -> dict[str, list[float]]:
    """The measured iteration time (its slowest rank's) averaged per bucket."""
    raw = (
        select(
            T.iteration.label("first"),
            literal(1).label("n"),
            func.max(T.data_ms + T.compute_ms + T.sync_ms).label("ms"),
        )
        .where(*mine)
        .group_by(T.iteration)
    )
    old = select(R.first_iteration, R.count, R.iteration_ms * R.count).where(
        *rolled, R.rank == JOB_RANK
    )
    u = union_all(raw, old).subquery()
    mkey = ((u.c.first - lo) // bucket).label("bucket")
    measured: dict[str, list[float]] = {"iteration": [], "iteration_ms": []}
    for first, ms in session.execute(
        select(func.min(u.c.first), func.sum(u.c.ms) / func.sum(u.c.n))
        .group_by(mkey)
        .order_by(mkey)
    ):
        measured["iteration"].append(int(first))
        measured["iteration_ms"].append(round(float(ms), 3))
    return measured


def _plan_effects(
    session: Session, mine: tuple[ColumnElement[bool], ...], job_id: int
) -> list[PlanEffect]:
    """The first iteration each plan version was used in (in rolled-up history: the first
    iteration of the first bucket that used it)."""
    firsts = retention.first_iteration_of_versions(session, job_id)
    for v, it in session.execute(
        select(T.plan_version, func.min(T.iteration)).where(*mine).group_by(T.plan_version)
    ):
        firsts[int(v)] = min(firsts.get(int(v), int(it)), int(it))
    return [PlanEffect(version=v, iteration=it) for v, it in sorted(firsts.items())]


def _window(
    session: Session, mine: tuple[ColumnElement[bool], ...], after_iteration: int
) -> list[RankWindow]:
    """Each rank's mean timings over the iterations after ``after_iteration``."""
    return [
        RankWindow(
            rank=int(rank),
            data_ms=round(float(d), 3),
            compute_ms=round(float(c), 3),
            sync_ms=round(float(s), 3),
            batch_size=round(float(b), 2),
        )
        for rank, d, c, s, b in session.execute(
            select(T.rank, func.avg(T.data_ms), func.avg(T.compute_ms), func.avg(T.sync_ms))
            .add_columns(func.avg(T.batch_size))
            .where(*mine, T.iteration > after_iteration)
            .group_by(T.rank)
            .order_by(T.rank)
        )
    ]


def max_telemetry_id(session: Session, job_id: int) -> int:
    return int(session.scalar(select(func.max(T.id)).where(T.job_id == job_id)) or 0)


def rows_after(
    session: Session, job_id: int, after_id: int, limit: int
) -> list[tuple[int, list[Any]]]:
    """Telemetry rows of a job with id above ``after_id``, oldest first, as (id, row) with the
    row's values in ``STREAM_COLUMNS`` order."""
    # ``job_id + 0`` keeps SQLite from choosing an index that starts with job_id, which would
    # scan the job's whole history; the primary key range holds only the new rows.
    q = (
        select(T.id, *(getattr(T, c) for c in STREAM_COLUMNS))
        .where(T.id > after_id, (T.job_id + 0) == job_id)
        .order_by(T.id)
        .limit(limit)
    )
    return [(int(row[0]), list(row[1:])) for row in session.execute(q)]


def events_after(session: Session, job_id: int, after_id: int) -> list[StragglerEvent]:
    return list(
        session.scalars(
            select(StragglerEvent)
            .where(StragglerEvent.job_id == job_id, StragglerEvent.id > after_id)
            .order_by(StragglerEvent.id)
            .limit(1000)
        )
    )


def max_event_id(session: Session, job_id: int) -> int:
    q = select(func.max(StragglerEvent.id)).where(StragglerEvent.job_id == job_id)
    return int(session.scalar(q) or 0)


def throughput(session: Session, job: Job, *, iterations: int = 20) -> ThroughputOut:
    """Samples per second over rank 0's last ``iterations`` iterations, from the workers'
    own end-of-iteration timestamps (so it includes every phase, idle time too)."""
    rows = session.execute(
        select(T.iteration, T.ts)
        .where(T.job_id == job.id, T.rank == 0)
        .order_by(T.iteration.desc())
        .limit(iterations + 1)
    ).all()
    if not rows:
        return ThroughputOut(job_id=job.id, samples_per_s=None, iteration=None)
    newest_it, newest_ts = rows[0]
    oldest_it, oldest_ts = rows[-1]
    speed = None
    if newest_ts > oldest_ts and newest_it > oldest_it:
        global_batch = job.job_spec.global_batch
        speed = round(global_batch * (newest_it - oldest_it) / (newest_ts - oldest_ts), 1)
    return ThroughputOut(job_id=job.id, samples_per_s=speed, iteration=int(newest_it))
