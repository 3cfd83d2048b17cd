"""Pure planning: performance models, batch plans and placement. No database, no HTTP, no clock.

Plain values in, plain values out; the callers (services) time it, store it and serve it.

Batch plans::

    PerfModel(per_sample_ms, intercept_ms=0.0, floor_ms=0.0)   t(b) = max(floor, intercept +
        .predict(batch_size) -> float                          per_sample * b), t(0) = 0
    WorkerSpec(id, model, min_batch=0, max_batch=None, pinned_batch=None)
    PlanProblem(global_batch, workers: tuple[WorkerSpec, ...], granularity=1)
    solve(problem, policy="minmax") -> Plan                    raises Infeasible, UnknownPolicy
    POLICIES: Mapping[str, (PlanProblem) -> Plan]              "equal", "proportional", "minmax"
    Plan(batch_sizes, predicted_ms, makespan_ms, lower_bound_ms, optimal, policy)

Errors (see ``server.planner.errors`` for the tree): ``PlannerError``, ``InvalidInput``,
``UnknownPolicy``, ``Infeasible``, ``SolverError``.
"""

from server.planner.errors import Infeasible, InvalidInput, PlannerError, SolverError, UnknownPolicy
from server.planner.minmax import minmax
from server.planner.model import PerfModel
from server.planner.policies import POLICIES, Policy, equal, proportional, solve
from server.planner.problem import Plan, PlanProblem, WorkerSpec

__all__ = [
    "POLICIES",
    "Infeasible",
    "InvalidInput",
    "PerfModel",
    "Plan",
    "PlanProblem",
    "PlannerError",
    "Policy",
    "SolverError",
    "UnknownPolicy",
    "WorkerSpec",
    "equal",
    "minmax",
    "proportional",
    "solve",
]
