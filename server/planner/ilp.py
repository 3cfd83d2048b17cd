"""The min-max batch split as an integer program for PuLP/CBC, and honest CBC statuses.

The exact solver in ``server.planner.minmax`` is the one the control plane uses. This module
states the same problem for a general MIP solver, as an independent check in tests and in the
benchmark, and as the place where CBC's answers are read correctly (also used by placement).

Formulation, with ``k_i`` the batch of worker i in granules (``b_i = g * k_i``) and ``z_i`` a
binary "worker i computes this iteration"::

    minimise    T
    subject to  sum_i g * k_i = B
                lo_i / g <= k_i <= hi_i / g
                k_i <= (hi_i / g) * z_i                 no samples unless z_i = 1
                T >= c_i * z_i + s_i * g * k_i          the linear part of t_i
                T >= f_i * z_i                          the floor
                z_i = 1 where lo_i > 0

With ``z_i = 1`` the two lower bounds on T are ``max(f_i, c_i + s_i b_i) = t_i(b_i)``; with
``z_i = 0`` the worker has ``b_i = 0`` and bounds T by 0 = ``t_i(0)``. A solution with ``z_i = 1``
and ``k_i = 0`` only over-estimates, so the optimum is the min-max makespan. PuLP writes the
coefficients with 13 significant digits and CBC has its own tolerances, so a "proven optimal" CBC
plan can sit a hair above the exact optimum; its ``makespan_ms`` is always re-evaluated exactly.

Reading CBC. PuLP sets ``prob.status`` to "Optimal" also when CBC stopped at its time limit with
an incumbent it had not proven optimal; only ``prob.sol_status`` tells the two apart
(``LpSolutionOptimal`` against ``LpSolutionIntegerFeasible``). ``run_cbc`` maps both to one
``SolveStatus`` and never calls a time-limited answer optimal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import pulp

from server.planner.errors import SolverError
from server.planner.minmax import Fleet
from server.planner.problem import Allocation, PlanProblem, make_plan


class SolveStatus(StrEnum):
    """What a MIP solve established."""

    OPTIMAL = "optimal"
    """A solution, proven optimal."""
    FEASIBLE = "feasible"
    """A solution, not proven optimal: the time limit stopped the search."""
    INFEASIBLE = "infeasible"
    """Proven to have no solution."""
    NO_SOLUTION = "no_solution"
    """Stopped (time limit) before finding any solution; feasibility unknown."""


def run_cbc(
    prob: pulp.LpProblem, *, time_limit_s: float, warm_start: bool, threads: int = 1
) -> SolveStatus:
    """Solve ``prob`` with CBC and classify the outcome from ``status`` and ``sol_status``."""
    if not math.isfinite(time_limit_s) or time_limit_s <= 0:
        raise ValueError(f"time_limit_s must be positive, got {time_limit_s}")
    solver = pulp.PULP_CBC_CMD(
        msg=False, timeLimit=time_limit_s, warmStart=warm_start, threads=threads
    )
    if not solver.available():
        raise SolverError("CBC is not available to PuLP")
    try:
        prob.solve(solver)
    except pulp.PulpSolverError as exc:
        raise SolverError(f"CBC failed: {exc}") from exc
    if prob.status == pulp.LpStatusOptimal and prob.sol_status == pulp.LpSolutionOptimal:
        return SolveStatus.OPTIMAL
    if prob.sol_status == pulp.LpSolutionIntegerFeasible:
        return SolveStatus.FEASIBLE
    if prob.status == pulp.LpStatusInfeasible or prob.sol_status == pulp.LpSolutionInfeasible:
        return SolveStatus.INFEASIBLE
    if prob.sol_status == pulp.LpSolutionNoSolutionFound:
        return SolveStatus.NO_SOLUTION
    raise SolverError(
        f"CBC answered {pulp.LpStatus.get(prob.status)!r} / "
        f"{pulp.LpSolution.get(prob.sol_status)!r}, which this problem cannot produce"
    )


@dataclass(frozen=True)
class IlpResult:
    """The outcome of ``solve_ilp``."""

    status: SolveStatus
    plan: Allocation | None
    """The solver's split, re-evaluated with the performance models; None without a solution.
    ``plan.optimal`` is True only for ``SolveStatus.OPTIMAL``."""
    objective_ms: float | None
    """T as CBC reports it (subject to CBC's tolerances; ``plan.makespan_ms`` is exact)."""
    lp_status: str
    """PuLP's ``LpStatus`` text, verbatim ("Optimal" even when time-limited)."""
    solution_status: str
    """PuLP's ``LpSolution`` text, verbatim: what distinguishes proven from time-limited."""

    @property
    def proven_optimal(self) -> bool:
        return self.status is SolveStatus.OPTIMAL


def solve_ilp(
    problem: PlanProblem,
    *,
    time_limit_s: float = 60.0,
    warm_start: Allocation | None = None,
    threads: int = 1,
) -> IlpResult:
    """Solve the min-max split with CBC (see the module docstring for the formulation).

    ``warm_start`` (any plan of the same problem) is handed to CBC as its first incumbent.
    Raises ``Infeasible`` for the same reasons, and with the same messages, as the policies.
    """
    fleet = Fleet(problem)  # validates bounds: raises Infeasible before any solver runs
    g = problem.granularity
    lo_g = np.rint(fleet.lo / g).astype(np.int64)
    hi_g = np.rint(fleet.hi / g).astype(np.int64)
    prob = pulp.LpProblem("minmax_split", pulp.LpMinimize)
    makespan = pulp.LpVariable("T", lowBound=0)
    prob += makespan
    granules: list[pulp.LpVariable] = []
    for i in range(len(problem.workers)):
        k = pulp.LpVariable(f"k_{i}", lowBound=int(lo_g[i]), upBound=int(hi_g[i]), cat="Integer")
        granules.append(k)
        s, c, f = float(fleet.s[i]), float(fleet.c[i]), float(fleet.f[i])
        if hi_g[i] == 0:
            continue  # never gets samples: contributes t(0) = 0
        if lo_g[i] > 0:
            prob += makespan >= c + s * g * k, f"line_{i}"
            if f > 0:
                prob += makespan >= f, f"floor_{i}"
            continue
        z = pulp.LpVariable(f"z_{i}", cat="Binary")
        prob += k <= int(hi_g[i]) * z, f"on_{i}"
        prob += makespan >= c * z + s * g * k, f"line_{i}"
        if f > 0:
            prob += makespan >= f * z, f"floor_{i}"
        if warm_start is not None:
            z.setInitialValue(1 if warm_start.batch_sizes[problem.workers[i].id] > 0 else 0)
    prob += pulp.lpSum(granules) == problem.global_batch // g, "global_batch"
    if warm_start is not None:
        for w, k in zip(problem.workers, granules, strict=True):
            k.setInitialValue(warm_start.batch_sizes[w.id] // g)
        makespan.setInitialValue(warm_start.makespan_ms)
    status = run_cbc(
        prob, time_limit_s=time_limit_s, warm_start=warm_start is not None, threads=threads
    )
    plan = None
    objective = None
    if status in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE):
        batches = np.array([round(k.varValue or 0.0) * g for k in granules], dtype=np.int64)
        objective = float(pulp.value(prob.objective))
        plan = make_plan(
            problem,
            batches,
            lower_bound_ms=fleet.lower_bound(float(fleet.times(batches.astype(float)).max())),
            optimal=status is SolveStatus.OPTIMAL,
            policy="ilp",
        )
    return IlpResult(
        status=status,
        plan=plan,
        objective_ms=objective,
        lp_status=pulp.LpStatus.get(prob.status, str(prob.status)),
        solution_status=pulp.LpSolution.get(prob.sol_status, str(prob.sol_status)),
    )
