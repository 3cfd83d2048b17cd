"""The PuLP/CBC formulation agrees with the exact solver, and CBC statuses are read honestly."""

from __future__ import annotations

import numpy as np
import pulp
import pytest

from server.planner import Infeasible, PerfModel, PlanProblem, WorkerSpec, solve
from server.planner.ilp import SolveStatus, run_cbc, solve_ilp


def random_problem(n: int, seed: int, granularity: int = 1) -> PlanProblem:
    rng = np.random.default_rng(seed)
    workers = []
    for i in range(n):
        per_sample = float(rng.uniform(0.4, 8.0))
        intercept = float(rng.uniform(0.0, 60.0))
        floor = float(rng.choice([0.0, intercept + per_sample * rng.uniform(8, 48)]))
        workers.append(
            WorkerSpec(
                f"w{i}",
                PerfModel(per_sample, intercept, floor),
                min_batch=int(rng.choice([0, 0, 0, 8])),
                max_batch=int(rng.integers(48, 400)),
                pinned_batch=16 if i == 0 else None,
            )
        )
    return PlanProblem(granularity * 24 * n, tuple(workers), granularity)


def hard_problem(n: int, seed: int) -> PlanProblem:
    """Many distinct intercepts and a global batch far from every cap: hard for cold CBC."""
    rng = np.random.default_rng(seed)
    workers = tuple(
        WorkerSpec(
            f"w{i}",
            PerfModel(
                float(rng.uniform(0.5, 10)),
                float(rng.uniform(0, 50)),
                float(rng.choice([0.0, 100.0])),
            ),
            max_batch=int(rng.integers(50, 600)),
        )
        for i in range(n)
    )
    return PlanProblem(64 * n, workers)


@pytest.mark.parametrize(
    "problem",
    [
        random_problem(16, 1, 1),
        random_problem(24, 2, 2),
        random_problem(32, 3, 4),
        hard_problem(48, 6),
    ],
    ids=["16-g1", "24-g2", "32-g4", "48-hard"],
)
def test_cold_cbc_agrees_with_exact_solver(problem: PlanProblem) -> None:
    exact = solve(problem)
    result = solve_ilp(problem, time_limit_s=30)
    assert result.plan is not None
    # The exact solver is optimal over every integer split, CBC's included, to the last bit.
    assert exact.makespan_ms <= result.plan.makespan_ms
    if result.status is SolveStatus.OPTIMAL:
        # PuLP hands CBC coefficients rounded to 13 digits, and CBC has its own tolerances.
        assert result.plan.makespan_ms == pytest.approx(exact.makespan_ms, rel=1e-8)
        assert result.plan.optimal
    else:
        assert result.status is SolveStatus.FEASIBLE and not result.plan.optimal


def test_warm_started_cbc_certifies_the_exact_plan_at_64_workers() -> None:
    problem = random_problem(64, 4)
    exact = solve(problem)
    result = solve_ilp(problem, time_limit_s=30, warm_start=exact)
    assert result.status is SolveStatus.OPTIMAL
    assert result.solution_status == "Optimal Solution Found"
    assert result.plan is not None
    assert result.plan.makespan_ms == pytest.approx(exact.makespan_ms, rel=1e-8)


def test_time_limited_cbc_is_not_called_optimal() -> None:
    # Cold CBC takes well over a second to prove optimality on 256 such workers (about 20 s).
    result = solve_ilp(hard_problem(256, 0), time_limit_s=1)
    assert result.status in (SolveStatus.FEASIBLE, SolveStatus.NO_SOLUTION)
    assert not result.proven_optimal
    if result.status is SolveStatus.FEASIBLE:
        assert result.lp_status == "Optimal"  # what PuLP says; the solution status is the truth
        assert result.solution_status == "Solution Found"
        assert result.plan is not None and not result.plan.optimal


def test_infeasible_problem_raises_before_the_solver() -> None:
    problem = PlanProblem(100, (WorkerSpec("a", PerfModel(1.0), max_batch=10),))
    with pytest.raises(Infeasible, match="capacity"):
        solve_ilp(problem)


class _Scripted(pulp.LpProblem):
    """An LpProblem whose solve only sets the given statuses, to drive every branch."""

    def __init__(self, status: int, sol_status: int) -> None:
        super().__init__("scripted", pulp.LpMinimize)
        self._script = (status, sol_status)

    def solve(self, solver: object = None, **kwargs: object) -> int:
        self.status, self.sol_status = self._script
        return self.status


@pytest.mark.parametrize(
    ("status", "sol_status", "expected"),
    [
        (pulp.LpStatusOptimal, pulp.LpSolutionOptimal, SolveStatus.OPTIMAL),
        (pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible, SolveStatus.FEASIBLE),
        (pulp.LpStatusInfeasible, pulp.LpSolutionNoSolutionFound, SolveStatus.INFEASIBLE),
        (pulp.LpStatusInfeasible, pulp.LpSolutionInfeasible, SolveStatus.INFEASIBLE),
        (pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound, SolveStatus.NO_SOLUTION),
    ],
)
def test_status_mapping(status: int, sol_status: int, expected: SolveStatus) -> None:
    assert run_cbc(_Scripted(status, sol_status), time_limit_s=1, warm_start=False) is expected
