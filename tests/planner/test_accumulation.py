"""Memory caps and gradient accumulation in the planner: a share above a worker's cap runs as
several passes, every policy still splits exactly B, and the min-max plan stays exact."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.planner import POLICIES, Infeasible, PerfModel, PlanProblem, WorkerSpec, minmax, solve
from server.planner.model import passes, predict_accumulated, predict_many, predict_passes

from .brute import brute_force_makespan
from .strategies import perf_models, plan_problems


@settings(max_examples=300, deadline=None)
@given(perf_models(), st.integers(1, 50), st.integers(0, 400))
def test_accumulated_time_is_non_decreasing_and_counts_passes(
    model: PerfModel, micro: int, batch: int
) -> None:
    now = predict_accumulated(model, batch, micro)
    after = predict_accumulated(model, batch + 1, micro)
    assert after >= now  # the exact solver's bisection needs this, in floating point too
    k, r = divmod(batch, micro)
    expected = k * model.predict(micro) + model.predict(r)
    assert now == pytest.approx(expected, rel=1e-12, abs=1e-9)


@settings(max_examples=100, deadline=None)
@given(perf_models(), st.integers(0, 400))
def test_no_cap_is_bit_for_bit_the_single_pass_model(model: PerfModel, batch: int) -> None:
    one = np.array([1.0])
    s, c, f = one * model.per_sample_ms, one * model.intercept_ms, one * model.floor_ms
    b = one * batch
    assert predict_passes(s, c, f, one * 2.0**62, b)[0] == predict_many(s, c, f, b)[0]
    assert predict_accumulated(model, batch, None) == model.predict(batch)


@settings(max_examples=400, deadline=None)
@given(plan_problems(memory=True))
def test_minmax_with_memory_caps_matches_brute_force(problem: PlanProblem) -> None:
    best = brute_force_makespan(problem)
    if best is None:
        with pytest.raises(Infeasible):
            minmax(problem)
        return
    plan = minmax(problem)
    assert plan.makespan_ms == best  # exact, extra passes included
    assert plan.lower_bound_ms <= plan.makespan_ms


@settings(max_examples=300, deadline=None)
@given(plan_problems(memory=True, constrained=False), st.sampled_from(sorted(POLICIES)))
def test_every_policy_splits_exactly_b_whatever_the_caps(problem: PlanProblem, policy: str) -> None:
    """Sum b_i == B holds even when B exceeds the sum of the memory caps (the workers over
    their cap accumulate), for every policy, ``equal`` included."""
    fits_somewhere = any(w.micro_batch != 0 for w in problem.workers)
    if not fits_somewhere and problem.global_batch:
        with pytest.raises(Infeasible):
            solve(problem, policy)
        return
    plan = solve(problem, policy)
    assert sum(plan.batch_list) == problem.global_batch
    for w in problem.workers:
        b = plan.batch_sizes[w.id]
        assert b % problem.granularity == 0
        if w.micro_batch == 0:
            assert b == 0
        assert plan.predicted_ms[w.id] == predict_accumulated(w.model, b, w.micro_batch)


def _two_cards(global_batch: int, policy: str = "minmax") -> dict[str, int]:
    """A fast card with a 12-sample cap and a slow one with room for everything."""
    problem = PlanProblem(
        global_batch,
        (
            WorkerSpec("fast", PerfModel(1.0, 10.0), micro_batch=12),
            WorkerSpec("slow", PerfModel(3.0, 10.0), micro_batch=100),
        ),
    )
    return solve(problem, policy).batch_sizes


def test_caps_bind_where_the_speed_only_optimum_does_not_fit() -> None:
    # Speed only: 10 + b = 10 + 3 (40 - b) -> b = 30 on the fast card, three times its cap.
    # One pass each: fast 12 (22 ms), slow 28 (94 ms). Accumulating on the fast card:
    # 2 passes of 12 + one of 6 cost 3 * 10 + 30 = 60 ms for 30 samples, slow 10 gets 40 ms...
    plan = _two_cards(40)
    fast = plan["fast"]
    assert fast > 12  # an extra pass pays here: the slow card is three times slower
    t_fast = predict_accumulated(PerfModel(1.0, 10.0), fast, 12)
    t_slow = PerfModel(3.0, 10.0).predict(plan["slow"])
    assert max(t_fast, t_slow) == pytest.approx(
        min(
            max(
                predict_accumulated(PerfModel(1.0, 10.0), b, 12),
                PerfModel(3.0, 10.0).predict(40 - b),
            )
            for b in range(41)
        )
    )


def test_equal_respects_caps_when_the_batch_fits_in_one_pass() -> None:
    assert _two_cards(40, "equal") == {"fast": 12, "slow": 28}
    assert _two_cards(200, "equal") == {"fast": 100, "slow": 100}  # both accumulate
    assert passes(100, 12) == 9 and passes(100, 100) == 1 and passes(0, 12) == 0


def test_a_worker_whose_base_memory_does_not_fit_gets_nothing() -> None:
    problem = PlanProblem(
        8,
        (
            WorkerSpec("full", PerfModel(1.0), micro_batch=0),
            WorkerSpec("ok", PerfModel(5.0), micro_batch=8),
        ),
    )
    for policy in POLICIES:
        assert solve(problem, policy).batch_sizes == {"full": 0, "ok": 8}
