"""Synthetic timing series: true models, a slowdown schedule and multiplicative noise."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from server.planner import PerfModel
from server.stragglers import ComputeTiming, RankSlowdown

MODELS = (
    PerfModel(2.83, 38.0),  # V100, ResNet-50
    PerfModel(4.6, 45.0),  # P100-like
    PerfModel(1.4, 20.0),  # A100-like
    PerfModel(2.83, 38.0, 120.0),  # V100 with a flat region
)


def noise_factors(rng: np.random.Generator, size: int, level: float, kind: str) -> np.ndarray:
    """Multiplicative noise: uniform in [1 - level, 1 + level] or Gaussian 1 + N(0, level)."""
    if kind == "uniform":
        return rng.uniform(1 - level, 1 + level, size)
    return np.maximum(0.05, 1 + rng.normal(0.0, level, size))


def series(
    models: Sequence[PerfModel],
    batches: Sequence[int],
    iterations: int,
    slowdowns: Sequence[RankSlowdown] = (),
    *,
    noise: float = 0.05,
    kind: str = "uniform",
    seed: int = 0,
    epoch: int | None = None,
    tail_floor: float = 0.0,
) -> list[ComputeTiming]:
    """Timings of ``iterations`` iterations, each rank at its planned batch, slowed by
    ``slowdowns`` and multiplied by noise.

    With ``epoch``, every ``epoch``-th iteration is an epoch's final partial batch: each rank
    gets between 0 and an eighth of its planned batch, and takes at least ``tail_floor`` times
    its full batch's time (the fixed cost of a step that a line fitted on full batches leaves
    out; 0: exactly its model's time at that size). Every timing carries its planned batch.
    """
    rng = np.random.default_rng(seed)
    out = []
    for it in range(iterations):
        factors = noise_factors(rng, len(models), noise, kind)
        tail = epoch is not None and it % epoch == epoch - 1
        for rank, (model, planned) in enumerate(zip(models, batches, strict=True)):
            slow = 1.0
            for s in slowdowns:
                if s.rank == rank and s.from_iteration <= it < s.to_iteration:
                    slow *= s.factor
            b = int(rng.integers(0, max(1, planned // 8) + 1)) if tail else planned
            if b == 0:
                continue  # nothing left for this rank: it computes nothing
            ideal = max(model.predict(b), tail_floor * model.predict(planned))
            ms = slow * ideal * float(factors[rank])
            out.append(ComputeTiming(rank, it, b, ms, planned_batch=planned))
    return out
