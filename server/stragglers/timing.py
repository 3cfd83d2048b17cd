"""Per-iteration timings and what one iteration says on its own: imbalance and model deviation.

For iteration k with compute times ``t_i`` of the ranks that computed something (batch > 0)::

    imbalance_k = (max_i t_i - min_i t_i) / mean_i t_i         (0 with fewer than two ranks)
    ratio_i,k   = t_i / model_i.predict(b_i)                   (only where a model is known)

A rank with batch 0 (excluded, or given nothing) computed nothing: it is left out of both, since
its 0 ms says nothing about its speed. One iteration's imbalance mixes noise with real skew; the
detector and the ladder never act on one of them alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from itertools import groupby
from operator import attrgetter
from typing import NamedTuple

from server.planner import PerfModel


class ComputeTiming(NamedTuple):
    """One rank's compute time in one iteration (the detector's only input from training). A
    named tuple: the control loop makes one per telemetry row, and a frozen dataclass took
    four times as long to build."""

    rank: int
    iteration: int
    batch_size: int
    compute_ms: float
    plan_version: int = 0
    planned_batch: int | None = None
    """The rank's batch in the plan in force, when known: ``batch_size`` is smaller on an
    epoch's final partial global batch, which the detector judges at its size, bounded by
    this one's time (``changepoint``)."""


@dataclass(frozen=True)
class IterationStats:
    """One iteration summarised."""

    iteration: int
    ranks: int
    """Ranks that computed something (batch > 0)."""
    min_ms: float
    max_ms: float
    mean_ms: float
    imbalance: float
    slowest_rank: int | None
    ratios: Mapping[int, float]
    """measured / predicted per rank with a known model and a batch > 0."""


def by_iteration(timings: Iterable[ComputeTiming]) -> Iterator[tuple[int, list[ComputeTiming]]]:
    """Timings grouped by iteration, ascending; within an iteration in rank order."""
    ordered = sorted(timings, key=_ITERATION_RANK)
    for iteration, group in groupby(ordered, key=_ITERATION):
        yield iteration, list(group)


_ITERATION_RANK = attrgetter("iteration", "rank")
_ITERATION = attrgetter("iteration")


def imbalance(times_ms: Iterable[float]) -> float:
    """``(max - min) / mean`` of the positive times; 0 when fewer than two are positive."""
    busy = [t for t in times_ms if t > 0]
    if len(busy) < 2:
        return 0.0
    mean = sum(busy) / len(busy)
    return (max(busy) - min(busy)) / mean


def iteration_stats(
    window: Iterable[ComputeTiming], models: Mapping[int, PerfModel] | None = None
) -> list[IterationStats]:
    """``IterationStats`` of every iteration in ``window``, ascending."""
    models = models or {}
    out = []
    for iteration, rows in by_iteration(window):
        busy = [r for r in rows if r.batch_size > 0 and r.compute_ms > 0]
        ratios: dict[int, float] = {}
        for r in busy:
            model = models.get(r.rank)
            predicted = model.predict(r.batch_size) if model is not None else 0.0
            if predicted > 0:
                ratios[r.rank] = r.compute_ms / predicted
        times = [r.compute_ms for r in busy]
        slowest = max(busy, key=lambda r: r.compute_ms).rank if busy else None
        out.append(
            IterationStats(
                iteration=iteration,
                ranks=len(busy),
                min_ms=min(times, default=0.0),
                max_ms=max(times, default=0.0),
                mean_ms=sum(times) / len(times) if times else 0.0,
                imbalance=imbalance(times),
                slowest_rank=slowest,
                ratios=ratios,
            )
        )
    return out
