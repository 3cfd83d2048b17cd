"""Pure planning: performance models, batch plans and placement. No database, no HTTP, no clock.

Plain values in, plain values out; the callers (services) time it, store it and serve it.

Batch plans::

    PerfModel(per_sample_ms, intercept_ms=0.0, floor_ms=0.0)   t(b) = max(floor, intercept +
        .predict(batch_size) -> float                          per_sample * b), t(0) = 0
    WorkerSpec(id, model, min_batch=0, max_batch=None, pinned_batch=None)
    PlanProblem(global_batch, workers: tuple[WorkerSpec, ...], granularity=1)
    solve(problem, policy="minmax") -> Allocation          raises Infeasible, UnknownPolicy
    POLICIES: Mapping[str, (PlanProblem) -> Allocation]    "equal", "proportional", "minmax"
    Allocation(batch_sizes, predicted_ms, makespan_ms, lower_bound_ms, optimal, policy)

Performance models from measurements::

    Observation(batch_size, compute_ms, iteration=0)
    fit_model(observations, *, half_life_iterations=100.0, fit_floor=True, max_batch=None,
              granularity=1) -> ModelFit
    ModelFit(identifiable, model | None, reason, observations, used, trimmed,
             distinct_batch_sizes, r2, relative_rmse, explore, notes, guess)
    explore_batches(batch, max_batch=None, granularity=1) -> tuple[int, ...]

Placement of pending jobs onto free devices (a greedy placement proven by a bound, else an
exact search over hosts, PuLP/CBC past its size)::

    FreeDevice(id, host, model="", memory_gb=0.0, samples_per_s=1.0)
    JobRequest(id, min_workers, max_workers=None, priority=0, host_penalty=None, min_memory_gb=0)
    place(job, devices, *, time_limit_s=10.0) -> Placement
    place_jobs(jobs, devices, *, time_limit_s=10.0, backfill=True) -> tuple[Placement, ...]
    Placement(job_id, device_ids, hosts_used, predicted_samples_per_s, status, objective, reason)
    SolveStatus: "optimal" | "feasible" (time-limited) | "infeasible" | "no_solution"

Prior device speeds before any telemetry (from data/gpu_profiles.csv)::

    load_gpu_profiles(path) / parse_gpu_profiles(rows) -> tuple[GpuProfile, ...]
    prior_speed(device_name, profiles, *, workload="resnet50", precision=None, memory_gb=None,
                cpu=None) -> SpeedPrior(samples_per_s, matched, source)

The same min-max problem as an integer program, for checks and benchmarks::

    solve_ilp(problem, *, time_limit_s=60.0, warm_start=None) -> IlpResult(status, plan,
              objective_ms, lp_status, solution_status)

Errors (see ``server.planner.errors`` for the tree): ``PlannerError``, ``InvalidInput``,
``UnknownPolicy``, ``Infeasible``, ``SolverError``.
"""

from server.planner.errors import Infeasible, InvalidInput, PlannerError, SolverError, UnknownPolicy
from server.planner.fit import ModelFit, Observation, explore_batches, fit_model
from server.planner.ilp import IlpResult, SolveStatus, solve_ilp
from server.planner.minmax import minmax
from server.planner.model import PerfModel
from server.planner.placement import FreeDevice, JobRequest, Placement, place, place_jobs
from server.planner.policies import POLICIES, Policy, equal, proportional, solve
from server.planner.problem import Allocation, PlanProblem, WorkerSpec
from server.planner.profiles import (
    GpuProfile,
    SpeedPrior,
    load_gpu_profiles,
    parse_gpu_profiles,
    prior_speed,
)

__all__ = [
    "POLICIES",
    "Allocation",
    "FreeDevice",
    "GpuProfile",
    "IlpResult",
    "Infeasible",
    "InvalidInput",
    "JobRequest",
    "ModelFit",
    "Observation",
    "PerfModel",
    "Placement",
    "PlanProblem",
    "PlannerError",
    "Policy",
    "SolveStatus",
    "SolverError",
    "SpeedPrior",
    "UnknownPolicy",
    "WorkerSpec",
    "equal",
    "explore_batches",
    "fit_model",
    "load_gpu_profiles",
    "minmax",
    "parse_gpu_profiles",
    "place",
    "place_jobs",
    "prior_speed",
    "proportional",
    "solve",
    "solve_ilp",
]
