"""Every policy: the plan invariants as properties, the heuristics' own rules, the registry."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from server.planner import (
    POLICIES,
    Allocation,
    Infeasible,
    PerfModel,
    PlanProblem,
    UnknownPolicy,
    WorkerSpec,
    solve,
)

from .brute import brute_force_makespan
from .strategies import plan_problems


def assert_valid(problem: PlanProblem, plan: Allocation) -> None:
    """Everything a plan promises, checked from the definitions."""
    assert list(plan.batch_sizes) == [w.id for w in problem.workers]  # worker order
    assert sum(plan.batch_sizes.values()) == problem.global_batch
    for w in problem.workers:
        b = plan.batch_sizes[w.id]
        assert b >= w.min_batch
        assert w.max_batch is None or b <= w.max_batch
        assert w.pinned_batch is None or b == w.pinned_batch
        assert b % problem.granularity == 0
        assert plan.predicted_ms[w.id] == w.model.predict(b)
        if b == 0:
            assert plan.predicted_ms[w.id] == 0.0
    assert plan.makespan_ms == max(plan.predicted_ms.values())
    assert plan.lower_bound_ms <= plan.makespan_ms


@settings(max_examples=300, deadline=None)
@given(plan_problems(max_workers=6, max_total=60))
def test_every_policy_keeps_every_constraint(problem: PlanProblem) -> None:
    try:
        exact = solve(problem, "minmax")
    except Infeasible:
        for name in POLICIES:
            with pytest.raises(Infeasible):
                solve(problem, name)
        return
    assert_valid(problem, exact)
    for name in ("equal", "proportional"):
        plan = solve(problem, name)
        assert_valid(problem, plan)
        assert plan.policy == name
        assert not plan.optimal
        assert plan.makespan_ms >= exact.makespan_ms  # nothing beats the exact optimum


@settings(max_examples=100, deadline=None)
@given(plan_problems(max_workers=3))
def test_feasibility_agrees_with_brute_force(problem: PlanProblem) -> None:
    feasible = brute_force_makespan(problem) is not None
    for name in POLICIES:
        if feasible:
            assert_valid(problem, solve(problem, name))
        else:
            with pytest.raises(Infeasible):
                solve(problem, name)


def _workers(*per_sample: float) -> tuple[WorkerSpec, ...]:
    return tuple(WorkerSpec(f"w{i}", PerfModel(s, 30.0)) for i, s in enumerate(per_sample))


def test_equal_splits_evenly_with_largest_remainder() -> None:
    plan = solve(PlanProblem(10, _workers(1.0, 2.0, 3.0)), "equal")
    assert plan.batch_list == [4, 3, 3]


def test_equal_shares_what_a_cap_leaves_among_the_others() -> None:
    workers = (
        WorkerSpec("a", PerfModel(1.0), max_batch=10),
        WorkerSpec("b", PerfModel(1.0), pinned_batch=30),
        WorkerSpec("c", PerfModel(1.0)),
        WorkerSpec("d", PerfModel(1.0)),
    )
    plan = solve(PlanProblem(100, workers), "equal")
    assert plan.batch_sizes == {"a": 10, "b": 30, "c": 30, "d": 30}


def test_proportional_follows_throughput_and_ignores_intercepts() -> None:
    workers = (
        WorkerSpec("fast", PerfModel(1.0, 500.0)),
        WorkerSpec("slow", PerfModel(3.0, 0.0)),
    )
    plan = solve(PlanProblem(120, workers), "proportional")
    assert plan.batch_sizes == {"fast": 90, "slow": 30}
    # The exact policy sees the intercept and gives the fast worker less.
    assert solve(PlanProblem(120, workers)).batch_sizes["fast"] < 90


def test_proportional_rounds_to_granules_within_caps() -> None:
    workers = (
        WorkerSpec("a", PerfModel(1.0), max_batch=40),
        WorkerSpec("b", PerfModel(2.0)),
        WorkerSpec("c", PerfModel(4.0)),
    )
    plan = solve(PlanProblem(96, workers, granularity=8), "proportional")
    # Uncapped shares would be 96 * (4, 2, 1) / 7 = 54.9, 27.4, 13.7; a is capped at 40, and the
    # remaining 56 go 2:1 -> 37.3, 18.7, rounded to granules of 8 by largest remainder.
    assert plan.batch_sizes == {"a": 40, "b": 40, "c": 16}


def test_minmax_beats_baselines_on_heterogeneous_fleet() -> None:
    # Intercepts differ too, which proportional cannot see.
    models = [
        PerfModel(2.83, 38.0),
        PerfModel(4.9, 20.0),
        PerfModel(1.0, 60.0),
        PerfModel(0.6, 90.0),
    ]
    problem = PlanProblem(512, tuple(WorkerSpec(f"w{i}", m) for i, m in enumerate(models)))
    spans = {name: solve(problem, name).makespan_ms for name in POLICIES}
    assert spans["minmax"] < spans["proportional"] < spans["equal"]


def test_unknown_policy_is_refused_by_name() -> None:
    with pytest.raises(UnknownPolicy, match="fastest") as caught:
        solve(PlanProblem(8, _workers(1.0)), "fastest")
    assert caught.value.field == "policy"


def test_registry_names_match_the_wire_contract() -> None:
    from typing import get_args

    from contract.api import SolvePolicy
    from contract.enums import PolicyName
    from server.services.rebalancer import SOLVER

    assert set(POLICIES) == set(get_args(SolvePolicy))
    assert set(SOLVER) == set(PolicyName), "every job policy solves with a registered policy"
    assert set(SOLVER.values()) <= set(POLICIES)
    problem = PlanProblem(8, _workers(1.0, 2.0))
    for name in get_args(SolvePolicy):
        assert solve(problem, name).policy == name
