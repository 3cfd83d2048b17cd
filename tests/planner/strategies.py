"""Hypothesis strategies for planner problems, shared by the planner tests."""

from __future__ import annotations

from hypothesis import strategies as st

from server.planner import PerfModel, PlanProblem, WorkerSpec

ms = st.floats(min_value=0.0, max_value=200.0, allow_nan=False, allow_infinity=False)


@st.composite
def perf_models(draw: st.DrawFn) -> PerfModel:
    per_sample = draw(st.one_of(st.just(0.0), st.floats(0.01, 20.0), st.sampled_from([1.0, 2.5])))
    intercept = draw(st.one_of(st.just(0.0), ms))
    floor = draw(st.one_of(st.just(0.0), ms))
    return PerfModel(per_sample, intercept, floor)


@st.composite
def plan_problems(
    draw: st.DrawFn,
    *,
    min_workers: int = 2,
    max_workers: int = 4,
    max_total: int = 40,
    constrained: bool = True,
    memory: bool = False,
) -> PlanProblem:
    """Small problems with random models and, when ``constrained``, caps, minimums and pins;
    with ``memory``, memory caps (``micro_batch``) that shares above them accumulate over.

    Not every drawn problem is feasible; tests decide what they expect from each.
    """
    g = draw(st.sampled_from([1, 1, 2, 4]))
    total = g * draw(st.integers(0, max_total // g))
    n = draw(st.integers(min_workers, max_workers))
    workers = []
    for i in range(n):
        model = draw(perf_models())
        min_batch, max_batch, pinned = 0, None, None
        if constrained:
            min_batch = draw(st.one_of(st.just(0), st.integers(0, max_total // 2)))
            max_batch = draw(st.one_of(st.none(), st.integers(0, max_total)))
            if draw(st.integers(0, 5)) == 0:
                pinned = draw(st.integers(0, max_total // 2))
        micro = draw(st.one_of(st.none(), st.integers(0, max_total // 2))) if memory else None
        workers.append(WorkerSpec(f"w{i}", model, min_batch, max_batch, pinned, micro))
    return PlanProblem(total, tuple(workers), g)
