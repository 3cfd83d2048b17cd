"""What the dashboard's charts read: per-rank series, plan effects and throughput."""

from __future__ import annotations

from contract.base import Response


class RankSeries(Response):
    """One rank's timings, downsampled: each entry is the mean over ``SeriesOut.bucket``
    consecutive iterations, placed at the bucket's first iteration."""

    rank: int
    iteration: list[int]
    batch_size: list[float]
    data_ms: list[float]
    compute_ms: list[float]
    sync_ms: list[float]
    plan_version: list[int]
    """The newest plan version seen in the bucket."""


class PlanEffect(Response):
    """When a plan version took effect: the first iteration any rank ran with it."""

    version: int
    iteration: int


class RankWindow(Response):
    """One rank's mean timings over the job's most recent iterations (``SeriesOut.window``)."""

    rank: int
    data_ms: float
    compute_ms: float
    sync_ms: float
    batch_size: float


class SeriesOut(Response):
    """A job's telemetry shaped for charts; the live stream resumes after ``last_id``."""

    job_id: int
    world_size: int
    bucket: int
    """Iterations per point."""
    first_iteration: int | None
    last_iteration: int | None
    last_id: int
    """Stream cursor: the newest telemetry row included here (0 when there is none)."""
    ranks: list[RankSeries]
    measured: dict[str, list[float]]
    """``iteration`` and ``iteration_ms``: per bucket, the mean over iterations of the slowest
    rank's data + compute + sync time, i.e. the measured synchronous iteration time."""
    plan_effects: list[PlanEffect]
    window: list[RankWindow]
    window_iterations: int
    """How many recent iterations ``window`` averages."""


class ThroughputOut(Response):
    """A job's recent training speed, from rank 0's worker-side timestamps."""

    job_id: int
    samples_per_s: float | None
    iteration: int | None
    """The newest iteration reported by rank 0."""


class MetricSeries(Response):
    """One metric of one rank, downsampled: each entry is the mean of the values reported in a
    bucket of ``MetricsOut.bucket`` consecutive iterations, placed at the first iteration that
    had one."""

    name: str
    rank: int
    iteration: list[int]
    value: list[float]
    last_iteration: int
    last_value: float
    """The newest point reported, exactly (not a bucket's mean)."""


class MetricsOut(Response):
    """A job's training metrics (the global ``loss`` and what user code logged) shaped for
    charts: at most ``points`` entries per (name, rank)."""

    job_id: int
    bucket: int
    """Iterations per point."""
    first_iteration: int | None
    last_iteration: int | None
    names: list[str]
    """Every metric name the job has reported, whatever ``names`` asked for."""
    series: list[MetricSeries]
    """Ordered by name, then rank."""
