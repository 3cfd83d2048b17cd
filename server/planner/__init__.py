"""Pure planning: performance models, batch plans and placement. No database, no HTTP, no clock.

Plain values in, plain values out; the callers (services) time it, store it and serve it.

Batch plans::

    PerfModel(per_sample_ms, intercept_ms=0.0, floor_ms=0.0)   t(b) = max(floor, intercept +
        .predict(batch_size) -> float                          per_sample * b), t(0) = 0
    WorkerSpec(id, model, min_batch=0, max_batch=None, pinned_batch=None)
    PlanProblem(global_batch, workers: tuple[WorkerSpec, ...], granularity=1)
    solve(problem, policy="minmax") -> Plan                    raises Infeasible, UnknownPolicy
    POLICIES: Mapping[str, (PlanProblem) -> Plan]              "equal",
    "explore_batches",
    "fit_model", "proportional", "minmax"
    Plan(batch_sizes, predicted_ms, makespan_ms, lower_bound_ms, optimal, policy)

Performance models from measurements::

    Observation(batch_size, compute_ms, iteration=0)
    fit_model(observations, *, half_life_iterations=100.0, now=None, fit_floor=True,
              max_batch=None, granularity=1) -> ModelFit
    ModelFit(identifiable, model | None, reason, observations, used, trimmed,
             distinct_batch_sizes, r2, relative_rmse, explore, notes, guess)
    explore_batches(batch, max_batch=None, granularity=1) -> tuple[int, ...]

Errors (see ``server.planner.errors`` for the tree): ``PlannerError``, ``InvalidInput``,
``UnknownPolicy``, ``Infeasible``, ``SolverError``.
"""

from server.planner.errors import Infeasible, InvalidInput, PlannerError, SolverError, UnknownPolicy
from server.planner.fit import ModelFit, Observation, explore_batches, fit_model
from server.planner.minmax import minmax
from server.planner.model import PerfModel
from server.planner.policies import POLICIES, Policy, equal, proportional, solve
from server.planner.problem import Plan, PlanProblem, WorkerSpec

__all__ = [
    "POLICIES",
    "Infeasible",
    "InvalidInput",
    "ModelFit",
    "Observation",
    "PerfModel",
    "Plan",
    "PlanProblem",
    "PlannerError",
    "Policy",
    "SolverError",
    "UnknownPolicy",
    "WorkerSpec",
    "equal",
    "explore_batches",
    "fit_model",
    "minmax",
    "proportional",
    "solve",
]
