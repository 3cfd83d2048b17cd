"""Batch-split policies: each is a function ``(PlanProblem) -> Allocation``, registered by name.

- ``equal``: the DDP default, ``B / n`` each. The baseline every other policy is measured against.
- ``proportional``: ``b_i`` proportional to measured throughput ``1 / per_sample_ms``, ignoring
  intercepts and floors (the LB-BSP rule). Right for devices that differ only in speed.
- ``minmax``: the exact least makespan (``server.planner.minmax``).

Both heuristics are water-fillings. With weights ``w_i`` (1 for ``equal``, ``1 / s_i`` for
``proportional``) the real-valued split is ``x_i = clip(lam * w_i, lo_i, hi_i)``, with the level
``lam`` chosen so that ``sum x_i = B``: the plain rule where no bound binds, and where one does
(a pin, a memory cap, a minimum), the others share what is left in the same proportions. The
level is found by exact bisection (``sum x_i`` is continuous and non-decreasing in ``lam``), then
``x`` is rounded to multiples of g by largest remainder, which keeps every bound and hits B exactly.
Memory caps (``micro_batch``) bound the shares like ``max_batch`` while the global batch fits in
one pass of every worker; when it does not, the shares ignore them and the workers over their cap
accumulate gradients over several passes.

Heuristic plans carry the same lower bound as minmax plans, so their gap is visible, and
``optimal=False``: they are not proven optimal even when they happen to be.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import numpy as np

from server.planner.bisection import least_true
from server.planner.errors import UnknownPolicy
from server.planner.minmax import Fleet, minmax
from server.planner.model import FloatArray
from server.planner.problem import Allocation, IntArray, PlanProblem, make_plan

Policy = Callable[[PlanProblem], Allocation]

FASTEST_PER_SAMPLE_MS = 1e-12
"""``proportional`` treats a zero per-sample cost as this one (a finite, overwhelming weight)."""


def water_fill(weights: FloatArray, lo: FloatArray, hi: FloatArray, total: float) -> FloatArray:
    """Real shares ``clip(lam * weights, lo, hi)`` summing to ``total`` (to rounding).

    Requires ``weights > 0`` and ``sum(lo) <= total <= sum(hi)``.
    """

    def enough(level: float) -> bool:
        return float(np.clip(level * weights, lo, hi).sum()) >= total

    if enough(0.0):
        return lo.copy()
    top = float(np.max(hi / weights))
    level = least_true(enough, 0.0, top) if top > 0 else 0.0
    return np.clip(level * weights, lo, hi)


def round_to_granules(
    shares: FloatArray, lo: FloatArray, hi: FloatArray, total: int, g: int
) -> IntArray:
    """Largest-remainder rounding of ``shares`` to multiples of g in ``[lo, hi]`` summing to total.

    In granules, ``u_i = shares_i / g``. Flooring loses less than one granule per worker and
    ``sum u = total / g``, so the deficit D is below n and at least D workers have a fractional
    part; each of the D largest remainders gets one more granule. A worker with a remainder is
    strictly below its (integral) upper bound, so no bound breaks. Rounding noise in ``shares``
    can leave D off by one either way; the passes below absorb that while keeping the bounds.
    """
    lo_g = np.rint(lo / g).astype(np.int64)
    hi_g = np.rint(hi / g).astype(np.int64)
    units = shares / g
    base = np.clip(np.floor(units).astype(np.int64), lo_g, hi_g)
    remainder = units - base
    need = total // g - int(base.sum())
    while need > 0:  # largest remainders first; ties in worker order
        order = np.argsort(-remainder, kind="stable")
        room = order[base[order] < hi_g[order]][:need]
        if not len(room):
            raise AssertionError("no room left below the upper bounds")
        base[room] += 1
        remainder[room] -= 1.0
        need -= len(room)
    while need < 0:  # smallest remainders give back first
        order = np.argsort(remainder, kind="stable")
        spare = order[base[order] > lo_g[order]][:-need]
        if not len(spare):
            raise AssertionError("no slack left above the lower bounds")
        base[spare] -= 1
        remainder[spare] += 1.0
        need += len(spare)
    return base * g


def _one_pass_bounds(fleet: Fleet) -> FloatArray:
    """The upper bounds with every worker's memory cap as well, where the global batch fits in
    one pass of every worker; else the plain bounds (the workers accumulate)."""
    g = fleet.g
    capped = np.maximum(fleet.lo, np.minimum(fleet.hi, np.floor(fleet.m / g) * g))
    return capped if float(capped.sum()) >= fleet.total else fleet.hi


def _heuristic(problem: PlanProblem, weights: FloatArray, name: str) -> Allocation:
    fleet = Fleet(problem)
    hi = _one_pass_bounds(fleet)
    shares = water_fill(weights, fleet.lo, hi, fleet.total)
    batch = round_to_granules(shares, fleet.lo, hi, problem.global_batch, problem.granularity)
    makespan = float(fleet.times(batch.astype(np.float64)).max())
    return make_plan(
        problem,
        batch,
        lower_bound_ms=fleet.lower_bound(makespan),
        optimal=False,
        policy=name,
    )


def equal(problem: PlanProblem) -> Allocation:
    """``B / n`` per worker; pinned, capped and minimum-bound workers are honoured and the
    difference is shared evenly by the others."""
    return _heuristic(problem, np.ones(len(problem.workers)), "equal")


def proportional(problem: PlanProblem) -> Allocation:
    """``b_i`` proportional to ``1 / per_sample_ms`` (intercepts ignored), within the bounds."""
    s, _, _ = problem.model_arrays()
    return _heuristic(problem, 1.0 / np.maximum(s, FASTEST_PER_SAMPLE_MS), "proportional")


POLICIES: Mapping[str, Policy] = MappingProxyType(
    {"equal": equal, "proportional": proportional, "minmax": minmax}
)
"""Every policy by name; the names match ``contract.enums.PolicyName``."""


def solve(problem: PlanProblem, policy: str = "minmax") -> Allocation:
    """Plan ``problem`` with the named policy. Raises ``UnknownPolicy`` or ``Infeasible``."""
    try:
        chosen = POLICIES[str(policy)]
    except KeyError:
        raise UnknownPolicy(str(policy), tuple(POLICIES)) from None
    return chosen(problem)
