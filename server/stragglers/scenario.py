"""Simulation scenarios: true worker speeds, a slowdown schedule, noise, and the oracle.

A ``Scenario`` is what really happens, unknown to the policies: rank i's compute time at
iteration k with batch b is ::

    t_i,k(b) = factor_i(k) * model_i.predict(b) * noise_i,k

with ``factor_i(k)`` the product of the ``RankSlowdown`` factors covering k (as in the runtime's
emulation) and ``noise`` multiplicative: uniform in ``[1 - noise, 1 + noise]`` or Gaussian
``1 + N(0, noise)`` (clipped at 0.05).

Iteration time. ``max_i t_i,k(b_i) + sync_ms * max_{i in G} factor_i(k)``: the slowest compute,
then the all-reduce of the group G (ranks not excluded), which runs at the pace of its slowest
member (a rank given 0 samples but still in the group still takes part in it).

Oracle. The least possible time of iteration k, knowing the true speeds and ignoring integrality,
granularity, noise and every cost of changing plans or groups: for each set of slowed ranks left
out of the group, the continuous optimum ``T*``, the T at which ``sum_i capacity_i(T) = B`` with
``capacity_i(T) = min(max_i, (T - c_i') / s_i')`` for the scaled models (0 while T is below the
worker's intercept or floor), plus the group's all-reduce; the oracle takes the best set. ``T*``
is the planner's continuous relaxation bound, ``Plan.lower_bound_ms`` of the true problem. The
oracle total is the sum over the iterations: no policy can beat it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from itertools import combinations

import numpy as np

from server.planner import Infeasible, PerfModel, PlanProblem, WorkerSpec, solve


@dataclass(frozen=True)
class RankSlowdown:
    """Rank ``rank`` runs ``factor`` times slower on iterations ``[from_iteration, to_iteration)``."""

    rank: int
    from_iteration: int
    to_iteration: int
    factor: float

    def __post_init__(self) -> None:
        if self.to_iteration <= self.from_iteration:
            raise ValueError("RankSlowdown.to_iteration must be greater than from_iteration")
        if not self.factor > 0:
            raise ValueError("RankSlowdown.factor must be > 0")


@dataclass(frozen=True)
class Scenario:
    """What really happens in a simulated job (see the module docstring)."""

    name: str
    models: tuple[PerfModel, ...]
    """True normal-speed model of each rank."""
    global_batch: int
    iterations: int
    slowdowns: tuple[RankSlowdown, ...] = ()
    noise: float = 0.05
    noise_kind: str = "uniform"
    seed: int = 0
    max_batch: tuple[int | None, ...] | None = None
    granularity: int = 1
    sync_ms: float = 0.0
    """All-reduce time of one iteration at normal speeds; slowed by the slowest group member."""

    def __post_init__(self) -> None:
        if self.noise_kind not in ("uniform", "gaussian"):
            raise ValueError("Scenario.noise_kind must be 'uniform' or 'gaussian'")
        if not 0 <= self.noise < 1:
            raise ValueError("Scenario.noise must be in [0, 1)")
        if self.max_batch is not None and len(self.max_batch) != len(self.models):
            raise ValueError("Scenario.max_batch needs one entry per rank")
        for s in self.slowdowns:
            if not 0 <= s.rank < len(self.models):
                raise ValueError(f"slowdown rank {s.rank} is not a rank of the scenario")

    @property
    def ranks(self) -> int:
        return len(self.models)

    def cap(self, rank: int) -> int | None:
        return None if self.max_batch is None else self.max_batch[rank]

    def factors(self, iteration: int) -> tuple[float, ...]:
        """True slowdown factor of every rank at ``iteration``."""
        out = [1.0] * self.ranks
        for s in self.slowdowns:
            if s.from_iteration <= iteration < s.to_iteration:
                out[s.rank] *= s.factor
        return tuple(out)

    def noise_matrix(self) -> np.ndarray:
        """``iterations x ranks`` multiplicative noise, the same for every policy (by seed)."""
        rng = np.random.default_rng(self.seed)
        shape = (self.iterations, self.ranks)
        if self.noise_kind == "uniform":
            return rng.uniform(1 - self.noise, 1 + self.noise, shape)
        return np.maximum(0.05, 1 + rng.normal(0.0, self.noise, shape))

    def problem(self, factors: Sequence[float], excluded: Sequence[int] = ()) -> PlanProblem:
        """The planning problem with every model scaled by its factor (excluded ranks get 0)."""
        workers = []
        for rank, (model, f) in enumerate(zip(self.models, factors, strict=True)):
            workers.append(
                WorkerSpec(
                    str(rank),
                    scaled(model, f),
                    max_batch=self.cap(rank),
                    pinned_batch=0 if rank in excluded else None,
                )
            )
        return PlanProblem(self.global_batch, tuple(workers), self.granularity)

    def iteration_ms(self, compute_ms: Sequence[float], group: Sequence[int], k: int) -> float:
        """True time of iteration k: slowest compute plus the group's all-reduce."""
        factors = self.factors(k)
        return max(compute_ms, default=0.0) + self.sync_ms * max(
            (factors[r] for r in group), default=1.0
        )

    def oracle_ms(self) -> float:
        """Sum over iterations of the continuous optimum for the true speeds."""
        best = _oracle_cache(self)
        return float(sum(best(self.factors(k)) for k in range(self.iterations)))


def scaled(model: PerfModel, factor: float) -> PerfModel:
    """``model`` running ``factor`` times slower: every time term multiplied."""
    return PerfModel(
        model.per_sample_ms * factor, model.intercept_ms * factor, model.floor_ms * factor
    )


def _oracle_cache(scenario: Scenario) -> Callable[[tuple[float, ...]], float]:
    @cache
    def best(factors: tuple[float, ...]) -> float:
        slowed = [r for r, f in enumerate(factors) if f > 1]
        options = []
        for n in range(len(slowed) + 1):
            for out in combinations(slowed, n):
                if len(out) == len(factors):
                    continue
                try:
                    compute = solve(scenario.problem(factors, out), "minmax").lower_bound_ms
                except Infeasible:
                    continue
                group = max(f for r, f in enumerate(factors) if r not in out)
                options.append(compute + scenario.sync_ms * group)
        return min(options)

    return best
