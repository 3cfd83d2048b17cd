"""The exact min-max solver against brute force, hand-checked cases and its own guarantees."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.planner import Infeasible, PerfModel, PlanProblem, WorkerSpec, minmax

from .brute import brute_force_makespan
from .strategies import plan_problems


@settings(max_examples=400, deadline=None)
@given(plan_problems())
def test_matches_brute_force_or_both_infeasible(problem: PlanProblem) -> None:
    best = brute_force_makespan(problem)
    if best is None:
        with pytest.raises(Infeasible):
            minmax(problem)
        return
    plan = minmax(problem)
    assert plan.makespan_ms == best  # exact, to the last bit
    assert plan.optimal
    assert plan.lower_bound_ms <= plan.makespan_ms


@settings(max_examples=150, deadline=None)
@given(plan_problems(constrained=False, max_workers=3))
def test_unconstrained_matches_brute_force(problem: PlanProblem) -> None:
    best = brute_force_makespan(problem)
    assert best is not None  # nothing but granularity can fail, and totals are multiples of g
    assert minmax(problem).makespan_ms == best


def test_two_workers_by_hand() -> None:
    # t_a = 2b, t_b = 10 + b, B = 30: the balance point is 2b = 10 + (30 - b), b = 40/3.
    # b_a = 13: max(26, 27) = 27; b_a = 14: max(28, 26) = 28. So 13/17 at 27 ms.
    problem = PlanProblem(
        30, (WorkerSpec("a", PerfModel(2.0)), WorkerSpec("b", PerfModel(1.0, 10.0)))
    )
    plan = minmax(problem)
    assert plan.batch_sizes == {"a": 13, "b": 17}
    assert plan.makespan_ms == 27.0
    assert plan.predicted_ms == {"a": 26.0, "b": 27.0}
    # Continuous relaxation: 2x = 10 + (30 - x) gives x = 40/3 and T = 80/3.
    assert plan.lower_bound_ms == pytest.approx(80 / 3)


def test_weak_worker_with_large_intercept_gets_nothing() -> None:
    # The slow worker's intercept alone (500 ms) exceeds what the fast one needs for everything.
    problem = PlanProblem(
        64, (WorkerSpec("fast", PerfModel(1.0, 5.0)), WorkerSpec("slow", PerfModel(1.0, 500.0)))
    )
    plan = minmax(problem)
    assert plan.batch_sizes == {"fast": 64, "slow": 0}
    assert plan.predicted_ms["slow"] == 0.0
    assert plan.makespan_ms == 69.0


def test_min_batch_forces_a_slow_worker_in() -> None:
    problem = PlanProblem(
        64,
        (
            WorkerSpec("fast", PerfModel(1.0, 5.0)),
            WorkerSpec("slow", PerfModel(1.0, 500.0), min_batch=1),
        ),
    )
    plan = minmax(problem)
    assert plan.batch_sizes["slow"] >= 1
    assert plan.makespan_ms == 501.0  # the slow worker's single sample sets the pace


def test_floor_makes_small_batches_free() -> None:
    # Transformer-like V100: flat 92 ms up to the knee, then 48 + 1.0625 b.
    flat = PerfModel(1.0625, 48.0, 92.0)
    problem = PlanProblem(64, (WorkerSpec("a", flat), WorkerSpec("b", flat)), granularity=8)
    plan = minmax(problem)
    assert plan.makespan_ms == 92.0
    assert sum(plan.batch_sizes.values()) == 64
    # The excess at the optimum is spread round-robin, not dumped on one worker.
    assert plan.batch_sizes == {"a": 32, "b": 32}


def test_pins_caps_and_granularity_hold() -> None:
    problem = PlanProblem(
        96,
        (
            WorkerSpec("a", PerfModel(1.0), max_batch=20),
            WorkerSpec("b", PerfModel(3.0), pinned_batch=8),
            WorkerSpec("c", PerfModel(2.0), min_batch=30),
            WorkerSpec("d", PerfModel(0.5, 40.0)),
        ),
        granularity=4,
    )
    plan = minmax(problem)
    b = plan.batch_sizes
    assert sum(b.values()) == 96
    assert b["a"] <= 20 and b["b"] == 8 and b["c"] >= 30
    assert all(v % 4 == 0 for v in b.values())


def test_zero_per_sample_worker_takes_up_to_its_cap() -> None:
    problem = PlanProblem(
        100,
        (WorkerSpec("free", PerfModel(0.0, 10.0), max_batch=60), WorkerSpec("lin", PerfModel(1.0))),
    )
    plan = minmax(problem)
    assert plan.batch_sizes == {"free": 60, "lin": 40}
    assert plan.makespan_ms == 40.0


def test_empty_global_batch_is_all_zero() -> None:
    problem = PlanProblem(
        0, (WorkerSpec("a", PerfModel(1.0, 5.0)), WorkerSpec("b", PerfModel(2.0)))
    )
    plan = minmax(problem)
    assert plan.batch_sizes == {"a": 0, "b": 0}
    assert plan.makespan_ms == 0.0


@pytest.mark.parametrize("n", [1024, 10_000])
def test_large_fleets_are_consistent(n: int) -> None:
    """Large instances: constraints hold, the plan is optimal by the capacity argument."""
    rng = np.random.default_rng(n)
    workers = tuple(
        WorkerSpec(
            f"w{i}",
            PerfModel(float(rng.uniform(0.4, 25.0)), float(rng.uniform(0, 60)), 0.0),
            max_batch=int(rng.integers(64, 640)),
        )
        for i in range(n)
    )
    problem = PlanProblem(48 * n, workers, granularity=2)
    plan = minmax(problem)
    assert sum(plan.batch_sizes.values()) == 48 * n
    assert plan.lower_bound_ms <= plan.makespan_ms
    assert plan.gap < 0.05
    # Optimality certificate: under any makespan below the plan's, the capacities fall short.
    below = np.nextafter(plan.makespan_ms, 0.0)
    capacity = 0
    for w in workers:
        m = w.model
        fits = (
            0
            if below < m.intercept_ms + m.per_sample_ms * 2
            else int(min(w.max_batch or 0, (below - m.intercept_ms) // m.per_sample_ms))
        )
        while fits > 0 and m.predict(fits) > below:
            fits -= 1
        while fits < (w.max_batch or 0) and m.predict(fits + 1) <= below:
            fits += 1
        capacity += fits - fits % 2
    assert capacity < 48 * n


@given(st.integers(1, 50), st.integers(1, 6))
def test_identical_workers_split_evenly(per_worker: int, n: int) -> None:
    problem = PlanProblem(
        per_worker * n, tuple(WorkerSpec(f"w{i}", PerfModel(1.5, 7.0)) for i in range(n))
    )
    plan = minmax(problem)
    assert set(plan.batch_sizes.values()) == {per_worker}


def test_speed_scales_roughly_linearly() -> None:
    """Targets are 50 ms at 1,024 workers and 500 ms at 10,000; allow 10x for a busy machine.

    This guards against an accidental quadratic step, not a benchmark (see bench/planner.py).
    """
    import time

    rng = np.random.default_rng(7)
    for n, budget_s in ((1024, 0.5), (10_000, 5.0)):
        workers = tuple(
            WorkerSpec(
                f"w{i}",
                PerfModel(float(rng.uniform(0.4, 25.0)), float(rng.uniform(0, 60)), 0.0),
                max_batch=int(rng.integers(64, 640)),
            )
            for i in range(n)
        )
        problem = PlanProblem(64 * n, workers)
        start = time.perf_counter()
        minmax(problem)
        assert time.perf_counter() - start < budget_s
