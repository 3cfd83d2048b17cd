"""Exact min-max batch split: the least possible iteration time, proven.

Problem. Choose integers ``b_i`` with ``sum b_i = B``, each in its admissible set
``F_i = {lo_i, lo_i + g, ..., hi_i}`` (see ``PlanProblem.bounds``), minimising
``max_i t_i(b_i)``, where ``t_i`` is the worker's ``PerfModel`` (non-decreasing, ``t_i(0) = 0``).

Capacity. For a makespan T let ``C_i(T)`` be the largest ``b`` in ``F_i`` with ``t_i(b) <= T``,
or "none" when even ``t_i(lo_i) > T``. Because ``t_i`` is non-decreasing, the members of ``F_i``
allowed under T are exactly ``lo_i, ..., C_i(T)``, a prefix of ``F_i``. Since ``F_i`` are runs of
multiples of g and B is a multiple of g, some choice sums to exactly B with every time ``<= T``
iff every worker has a capacity and ``sum_i C_i(T) >= B``. Call that ``feasible(T)``; it is
monotone in T.

Closed form. For b >= 1, ``t_i(b) <= T`` iff ``f_i <= T`` and ``c_i + s_i b <= T``, so
``C_i(T) = g * floor(min(hi_i, (T - c_i) / s_i) / g)`` (no limit but ``hi_i`` when ``s_i = 0`` and
``c_i <= T``; 0 when ``f_i > T``). The division can be off by one granule through rounding, so the
result is corrected, vectorised, against the very expression ``max(f, c + s*b)`` that defines
``t_i`` in floating point. All of this is a handful of numpy operations on arrays of n workers.

Exactness. The optimal makespan ``T*`` is the least T with ``feasible(T)``. It is one of the
values ``t_i(b)`` (an optimal plan's maximum is attained by some worker), so in particular it is a
double. ``least_true`` bisects over the bit patterns of doubles between
``T_lo = max_i t_i(lo_i)`` (no plan is faster) and ``T_hi = max_i t_i(hi_i)`` (feasible whenever
the problem is) and returns the smallest double where ``feasible`` holds: exactly ``T*``, after at
most 63 steps, with no tolerance. Optimality is relative to the floating-point evaluation of
``t_i``, which is monotone because IEEE rounding is; a brute force computing the same
``max(f, c + s*b)`` agrees to the last bit.

Accumulation. A worker with a memory cap ``m_i`` runs a larger share as ``k`` full passes of
``m_i`` and one of the rest, in time ``k P_i + t_i(r)`` (``model.predict_passes``, non-decreasing
in floating point too), so the same bisection is exact. Its capacity at T starts from
``k = floor(T / P_i)`` full passes plus what one more pass reaches in ``T - k P_i``, and the same
correction fixes the rounding.

Filling. At ``T*`` the capacities sum to ``B + E`` with ``E >= 0``. Removing samples never raises a
time (t is non-decreasing), so any removal of E that keeps ``b_i >= lo_i`` (in granules) keeps
the makespan at ``T*``; it cannot fall below, since ``T*`` is least. The excess is taken round-robin
in granules, slowest workers first, which spreads it instead of emptying a few workers.

Lower bound. The continuous relaxation drops integrality and granularity but keeps the jump
from ``t(0) = 0`` to the intercept (a worker contributes nothing until T reaches ``max(f_i, c_i)``).
Its least feasible T bounds every integer plan from below; it is reported so that heuristic plans
can be judged against it, and so the gap shows how much integrality costs.
"""

from __future__ import annotations

import numpy as np

from server.planner.bisection import least_true
from server.planner.model import NO_CAP, FloatArray, predict_many, predict_passes
from server.planner.problem import Allocation, IntArray, PlanProblem, make_plan


class Fleet:
    """A problem's workers as float64 arrays, with their capacity at a makespan."""

    def __init__(self, problem: PlanProblem) -> None:
        lo, hi = problem.bounds()
        self.s, self.c, self.f = problem.model_arrays()
        self.m = problem.micro_array()
        self.accumulates = bool(np.any(self.m < NO_CAP))
        self.lo = lo.astype(np.float64)
        self.hi = hi.astype(np.float64)
        self.g = float(problem.granularity)
        self.total = float(problem.global_batch)

    def times(self, batch: FloatArray) -> FloatArray:
        if self.accumulates:
            return predict_passes(self.s, self.c, self.f, self.m, batch)
        return predict_many(self.s, self.c, self.f, batch)

    def _reach(self, budget: FloatArray) -> FloatArray:
        """Most samples one pass (unbounded) runs within ``budget`` ms; -inf where none."""
        s, c, f = self.s, self.c, self.f
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            reach = np.where(s > 0, (budget - c) / s, np.where(c <= budget, np.inf, -np.inf))
        return np.where(f <= budget, reach, -np.inf)

    def _accumulated_reach(self, makespan: float) -> FloatArray:
        """Most samples within ``makespan`` counting passes of at most ``m`` (a first guess)."""
        one = predict_many(self.s, self.c, self.f, self.m)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            full = np.where(one > 0, np.floor(makespan / one), np.inf)
        full = np.minimum(full, np.floor(self.hi / self.m) + 1.0)
        extra = np.clip(self._reach(makespan - full * one), 0.0, self.m - 1.0)
        reach = np.where(np.isfinite(full), full * self.m + extra, np.inf)
        single = self._reach(np.full_like(self.s, makespan))
        return np.where(self.m < NO_CAP, np.where(single >= 1, reach, single), single)

    def capacity(self, makespan: float) -> FloatArray:
        """``C_i(T)`` per worker, as floats holding integers; -1 where no batch fits under T."""
        g = self.g
        if self.accumulates:
            reach = self._accumulated_reach(makespan)
        else:
            reach = self._reach(np.full_like(self.s, makespan))
        b = np.maximum(np.floor(np.minimum(reach, self.hi) / g) * g, 0.0)
        # Correct rounding of the division against the defining expression. Each worker moves only
        # in one direction (up while the next granule fits, down while its own batch does not),
        # so the loop ends; in practice after zero or one pass.
        while True:
            up = b + g
            grow = (up <= self.hi) & (self.times(up) <= makespan)
            shrink = (b > 0) & (self.times(b) > makespan)
            if not (grow.any() or shrink.any()):
                break
            b = np.where(grow, up, np.where(shrink, b - g, b))
        return np.where(b >= self.lo, b, -1.0)

    def feasible(self, makespan: float) -> bool:
        cap = self.capacity(makespan)
        return bool(cap.min() >= 0) and float(cap.sum()) >= self.total

    def relaxed_feasible(self, makespan: float) -> bool:
        """``feasible`` for the continuous relaxation (real batches in ``[lo_i, hi_i]``)."""
        s, c, f = self.s, self.c, self.f
        active = (f <= makespan) & (c <= makespan)
        with np.errstate(divide="ignore", invalid="ignore"):
            reach = np.where(s > 0, (makespan - c) / s, np.inf)
        cap = np.where(active, np.minimum(reach, self.hi), 0.0)
        if np.any(cap < self.lo):
            return False
        return float(cap.sum()) >= self.total

    def least_makespan(self) -> float:
        """``T*``: the least makespan of any plan (exact, see the module docstring)."""
        t_lo = float(self.times(self.lo).max())
        if self.feasible(t_lo):
            return t_lo
        t_hi = float(self.times(self.hi).max())
        return least_true(self.feasible, t_lo, t_hi)

    def lower_bound(self, upper: float) -> float:
        """Least makespan of the continuous relaxation, searched in ``[0, upper]``."""
        if self.relaxed_feasible(0.0):
            return 0.0
        if not self.relaxed_feasible(upper):
            return upper  # only by rounding; the relaxation cannot be worse than the integer plan
        return least_true(self.relaxed_feasible, 0.0, upper)


def trim(batch: FloatArray, lo: FloatArray, excess: int, g: float, order: IntArray) -> FloatArray:
    """Remove ``excess`` granules from ``batch`` round-robin in ``order``, never below ``lo``.

    Worker i can give ``k_i = (batch_i - lo_i) / g`` granules. The water level r is the largest
    integer with ``sum_i min(k_i, r) <= excess``; every worker gives ``min(k_i, r)`` and the
    remaining ``excess - sum_i min(k_i, r)`` (fewer than the number of workers with ``k_i > r``)
    come one each from the first such workers in ``order``.
    """
    if excess <= 0:
        return batch
    slack = np.rint((batch - lo) / g).astype(np.int64)
    if int(slack.sum()) < excess:
        raise AssertionError("cannot trim more than the slack above the minimums")
    low, high = 0, int(slack.max())
    while low < high:  # largest r with sum(min(slack, r)) <= excess
        mid = (low + high + 1) // 2
        if int(np.minimum(slack, mid).sum()) <= excess:
            low = mid
        else:
            high = mid - 1
    give = np.minimum(slack, low)
    rest = excess - int(give.sum())
    if rest:
        candidates = order[slack[order] > low][:rest]
        give[candidates] += 1
    return batch - give.astype(np.float64) * g


def minmax(problem: PlanProblem) -> Allocation:
    """The exact min-max plan: least possible makespan, ``optimal=True``.

    Raises ``Infeasible`` (naming the constraint) when no plan exists.
    """
    fleet = Fleet(problem)
    best = fleet.least_makespan()
    batch = fleet.capacity(best)
    excess = round((float(batch.sum()) - fleet.total) / fleet.g)
    # Slowest first; ties keep worker order (stable sort).
    order = np.argsort(-fleet.times(batch), kind="stable").astype(np.int64)
    batch = trim(batch, fleet.lo, excess, fleet.g, order)
    plan = make_plan(
        problem,
        np.rint(batch).astype(np.int64),
        lower_bound_ms=fleet.lower_bound(best),
        optimal=True,
        policy="minmax",
    )
    if plan.makespan_ms != best:
        raise AssertionError(f"filled plan has makespan {plan.makespan_ms}, expected {best}")
    return plan
