"""Stateless what-if planning: the plan a policy would make for given worker models."""

from __future__ import annotations

import time

from fastapi import APIRouter

from contract.api import SolveRequest, SolveResponse
from server.api.bodies import JSONRoute
from server.api.deps import Viewer
from server.errors import Invalid
from server.planner import Infeasible, InvalidInput, PerfModel, PlanProblem, WorkerSpec, solve

router = APIRouter(prefix="/plan", tags=["planner"], route_class=JSONRoute)

# Which request field an infeasibility is about, by the planner's constraint code.
CONSTRAINT_FIELDS = {
    "granularity": "granularity",
    "capacity": "global_batch",
    "minimums": "global_batch",
    "worker_bounds": "workers",
}


@router.post("/solve")
def solve_plan(req: SolveRequest, _: Viewer) -> SolveResponse:
    """Solve a batch plan (default: the exact min-max optimum); 422 names an impossible constraint."""
    index = {w.id: i for i, w in enumerate(req.workers)}
    if len(index) != len(req.workers):
        raise Invalid("worker ids must be unique", field="workers")
    try:
        problem = PlanProblem(
            global_batch=req.global_batch,
            granularity=req.granularity,
            workers=tuple(
                WorkerSpec(
                    id=w.id,
                    model=PerfModel(w.per_sample_ms, w.intercept_ms, w.floor_ms),
                    min_batch=w.min_batch,
                    max_batch=w.max_batch,
                    pinned_batch=w.pinned_batch,
                )
                for w in req.workers
            ),
        )
        start = time.perf_counter()
        plan = solve(problem, req.policy)
        solve_ms = (time.perf_counter() - start) * 1000
    except Infeasible as exc:
        field = CONSTRAINT_FIELDS.get(exc.constraint, "workers")
        if exc.worker is not None and exc.worker in index:
            field = f"workers.{index[exc.worker]}"
        raise Invalid(str(exc), field=field) from exc
    except InvalidInput as exc:
        raise Invalid(str(exc), field=exc.field) from exc
    return SolveResponse(
        batch_sizes=plan.batch_sizes,
        predicted_ms=plan.predicted_ms,
        makespan_ms=plan.makespan_ms,
        lower_bound_ms=plan.lower_bound_ms,
        optimal=plan.optimal,
        policy=req.policy,
        solve_ms=round(solve_ms, 3),
    )
