"""Exhaustive reference solver for tiny problems: every admissible split, evaluated at once."""

from __future__ import annotations

import math

import numpy as np

from server.planner import PlanProblem
from server.planner.model import predict_accumulated


def time_tables(problem: PlanProblem) -> list[np.ndarray]:
    """Per worker, ``table[b]`` = predicted time of batch b, or inf where b is not admissible.

    Admissibility is taken straight from the constraint definitions, and the times from the
    scalar ``PerfModel.predict`` (``predict_accumulated`` for a worker with a memory cap, which
    counts its extra passes), independently of the solver's closed forms.
    """
    g, total = problem.granularity, problem.global_batch
    tables = []
    for w in problem.workers:
        table = np.full(total + 1, math.inf)
        for b in range(total + 1):
            if (
                b % g == 0
                and b >= w.min_batch
                and (w.max_batch is None or b <= w.max_batch)
                and (w.pinned_batch is None or b == w.pinned_batch)
                and (w.micro_batch != 0 or b == 0)
            ):
                table[b] = predict_accumulated(w.model, b, w.micro_batch)
        tables.append(table)
    return tables


def brute_force_makespan(problem: PlanProblem) -> float | None:
    """Least makespan over all splits summing to the global batch, or None if there is none."""
    total = problem.global_batch
    tables = time_tables(problem)
    n = len(tables)
    # Broadcast the first n - 1 workers' choices over a grid; the last worker takes the rest.
    grids = np.meshgrid(*(np.arange(total + 1) for _ in range(n - 1)), indexing="ij")
    rest = total - np.sum(grids, axis=0)
    span = np.full(rest.shape, -math.inf)
    for table, b in zip(tables[:-1], grids, strict=True):
        span = np.maximum(span, table[b])
    last = np.where(rest >= 0, tables[-1][np.clip(rest, 0, total)], math.inf)
    span = np.maximum(span, last)
    best = float(span.min())
    return None if math.isinf(best) else best
