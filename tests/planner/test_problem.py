"""Problem values: malformed input is InvalidInput; impossible constraints are Infeasible."""

from __future__ import annotations

import math

import pytest

from server.planner import (
    Infeasible,
    InvalidInput,
    PerfModel,
    PlannerError,
    PlanProblem,
    WorkerSpec,
    solve,
)

M = PerfModel(1.0, 10.0)


def test_model_predicts_zero_for_no_samples_and_the_line_above_the_floor() -> None:
    m = PerfModel(2.0, 10.0, 40.0)
    assert m.predict(0) == 0.0
    assert m.predict(1) == 40.0  # floor
    assert m.predict(15) == 40.0  # 10 + 30 = 40, the knee
    assert m.predict(20) == 50.0
    assert m.knee == 15.0
    assert PerfModel(4.0).samples_per_s == 250.0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"per_sample_ms": -1.0}, "per_sample_ms"),
        ({"per_sample_ms": math.nan}, "per_sample_ms"),
        ({"per_sample_ms": 1.0, "intercept_ms": math.inf}, "intercept_ms"),
        ({"per_sample_ms": 1.0, "floor_ms": -0.5}, "floor_ms"),
    ],
)
def test_bad_model_parameters_are_named(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(InvalidInput, match=field) as caught:
        PerfModel(**kwargs)
    assert caught.value.field == field


def test_malformed_problems_are_invalid_input() -> None:
    with pytest.raises(InvalidInput, match="twice"):
        PlanProblem(8, (WorkerSpec("a", M), WorkerSpec("a", M)))
    with pytest.raises(InvalidInput, match="at least one worker"):
        PlanProblem(8, ())
    with pytest.raises(InvalidInput, match="granularity"):
        PlanProblem(8, (WorkerSpec("a", M),), granularity=0)
    with pytest.raises(InvalidInput, match="global_batch"):
        PlanProblem(-1, (WorkerSpec("a", M),))
    with pytest.raises(InvalidInput, match="min_batch"):
        WorkerSpec("a", M, min_batch=-2)
    with pytest.raises(InvalidInput, match="integer"):
        WorkerSpec("a", M, max_batch=2.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="id"):
        WorkerSpec("", M)


def test_problem_is_immutable_and_takes_any_sequence() -> None:
    problem = PlanProblem(8, [WorkerSpec("a", M)])  # type: ignore[arg-type]
    assert isinstance(problem.workers, tuple)
    with pytest.raises(AttributeError):
        problem.global_batch = 9  # type: ignore[misc]
    assert hash(problem) == hash(PlanProblem(8, (WorkerSpec("a", M),)))


@pytest.mark.parametrize(
    ("total", "workers", "granularity", "constraint", "words"),
    [
        (100, [WorkerSpec("a", M, max_batch=40), WorkerSpec("b", M, max_batch=50)], 1,
         "capacity", "at most 90 samples"),
        (10, [WorkerSpec("a", M, pinned_batch=8), WorkerSpec("b", M, min_batch=4)], 1,
         "minimums", "pinned batches (8)"),
        (10, [WorkerSpec("a", M), WorkerSpec("b", M)], 4, "granularity", "not a multiple"),
        (16, [WorkerSpec("a", M, min_batch=5, max_batch=7), WorkerSpec("b", M)], 4,
         "worker_bounds", "worker a: no multiple of granularity 4"),
        (16, [WorkerSpec("a", M, min_batch=9, max_batch=7), WorkerSpec("b", M)], 1,
         "worker_bounds", "worker a: min_batch 9 > max_batch 7"),
        (16, [WorkerSpec("a", M, pinned_batch=12, max_batch=10), WorkerSpec("b", M)], 1,
         "worker_bounds", "worker a: pinned_batch 12 is outside"),
        (16, [WorkerSpec("a", M, pinned_batch=6), WorkerSpec("b", M)], 4,
         "worker_bounds", "pinned_batch 6 is not a multiple of granularity 4"),
        (16, [WorkerSpec("a", M, min_batch=20), WorkerSpec("b", M)], 1,
         "minimums", "worker a: min_batch 20"),
    ],
)  # fmt: skip
def test_infeasible_names_the_constraint(
    total: int, workers: list[WorkerSpec], granularity: int, constraint: str, words: str
) -> None:
    problem = PlanProblem(total, tuple(workers), granularity)
    for policy in ("equal", "proportional", "minmax"):
        with pytest.raises(Infeasible, match=words.replace("(", r"\(").replace(")", r"\)")) as e:
            solve(problem, policy)
        assert e.value.constraint == constraint
        assert isinstance(e.value, PlannerError)
    if "worker a" in words:
        assert e.value.worker == "a"


def test_numpy_integers_are_stored_as_plain_ints() -> None:
    import numpy as np

    w = WorkerSpec("a", M, min_batch=np.int64(2), max_batch=np.int32(9))  # type: ignore[arg-type]
    problem = PlanProblem(np.int64(8), (w,), np.int64(2))  # type: ignore[arg-type]
    assert type(problem.global_batch) is int and type(problem.granularity) is int
    assert type(w.min_batch) is int and type(w.max_batch) is int
