"""Running the same emulated job under several policies and measuring each from its telemetry:
what ``evenflow compare`` and ``evenflow demo`` print.

A profile (YAML)::

    global_batch: 256
    iterations: 300
    policies: [equal, proportional, minmax]      # the default
    workload: mlp                                 # or cnn-digits
    workers:
      - {name: slow, per_sample_ms: 4.0, intercept_ms: 5}
      - {name: fast, per_sample_ms: 1.0, intercept_ms: 5,
         slowdowns: [{from_iteration: 100, to_iteration: 200, factor: 3}],
         memory_mb: 12288, memory_base_mb: 4600, memory_per_sample_mb: 90}   # optional

Measures, per policy (iteration ``i`` ends when its last rank reports it):

- ``samples_per_s``: samples trained in the second half of the iterations over their wall time
  (steady state; counted from the batch sizes reported, so an epoch's final partial batch
  counts what it really holds);
- ``total_s``: wall time of all iterations;
- ``mean_iteration_ms``: ``total_s`` over the iterations;
- ``idle_fraction``: the share of worker time spent in the all-reduce, i.e. waiting for the
  slowest rank (the all-reduce itself is tiny for these models);
- ``plan_changes``: plan versions used beyond the first;
- ``ooms``: passes that ran out of (emulated) memory and were redone smaller;
- ``peak_memory_fraction``: the largest peak memory any worker reported over its device's memory
  (None without emulated memory).

A policy whose job fails is reported with its ``error`` and no figures; ``evenflow compare``
then exits with status 1.

``ideal_samples_per_s`` is B over the continuous min-max optimum of the true (base) emulated
speeds: what perfect balancing with no overhead would reach. With emulated memory,
``ideal_under_caps_samples_per_s`` is B over the least makespan any plan within the memory caps
can reach (exact; a share above a cap costs its extra passes), the caps being what plans may
use: each device's memory less the default 10% headroom.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from contract.api import TelemetryOut
from contract.enums import PolicyName
from contract.spec import EmulatedWorker, JobSpec, PolicySpec, Slowdown, WorkloadSpec
from evenflow.local_cluster import LocalCluster
from server.planner import PerfModel, PlanProblem, WorkerSpec, solve
from server.planner.memory import DEFAULT_HEADROOM, MemoryModel


class ProfileWorker(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    per_sample_ms: float = Field(gt=0, le=1e4)
    intercept_ms: float = Field(default=0.0, ge=0, le=1e5)
    slowdowns: list[Slowdown] = Field(default_factory=list)
    memory_mb: int | None = Field(default=None, ge=1, le=10_000_000)
    """The emulated device's memory: a pass that needs more raises an out-of-memory error."""
    memory_base_mb: float = Field(default=0.0, ge=0, le=10_000_000)
    memory_per_sample_mb: float = Field(default=0.0, ge=0, le=10_000_000)


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    global_batch: int = Field(ge=1, le=1_000_000)
    iterations: int = Field(ge=4, le=1_000_000)
    policies: list[PolicyName] = Field(
        default_factory=lambda: [PolicyName.EQUAL, PolicyName.PROPORTIONAL, PolicyName.MINMAX],
        min_length=1,
    )
    workload: Literal["mlp", "cnn-digits"] = "mlp"
    rebalance_every: int = Field(default=20, ge=1)
    explore_iterations: int = Field(default=10, ge=1)
    workers: list[ProfileWorker] = Field(min_length=1, max_length=64)

    @model_validator(mode="after")
    def _enough(self) -> Profile:
        if self.global_batch < len(self.workers):
            raise ValueError("global_batch must be at least the number of workers")
        return self

    def job_spec(self, policy: PolicyName, iterations: int | None = None) -> JobSpec:
        return JobSpec(
            name=f"compare-{policy.value}",
            workload=WorkloadSpec(builtin=self.workload),
            global_batch=self.global_batch,
            iterations=iterations or self.iterations,
            workers=len(self.workers),
            policy=PolicySpec(
                name=policy,
                rebalance_every=self.rebalance_every,
                explore_iterations=self.explore_iterations,
            ),
            emulation=[
                EmulatedWorker(
                    name=w.name,
                    per_sample_ms=w.per_sample_ms,
                    intercept_ms=w.intercept_ms,
                    slowdowns=w.slowdowns,
                    memory_mb=w.memory_mb,
                    memory_base_mb=w.memory_base_mb,
                    memory_per_sample_mb=w.memory_per_sample_mb,
                )
                for w in self.workers
            ],
        )

    def models(self) -> list[PerfModel]:
        return [PerfModel(w.per_sample_ms, w.intercept_ms) for w in self.workers]

    def memory_caps(self, headroom: float = DEFAULT_HEADROOM) -> list[int | None]:
        """Each worker's cap as plans may use it: its emulated memory less the headroom."""
        return [
            None
            if w.memory_mb is None
            else MemoryModel(w.memory_base_mb, w.memory_per_sample_mb).cap(w.memory_mb, headroom)
            for w in self.workers
        ]


def capped_optimum_ms(profile: Profile) -> float | None:
    """The least makespan of any plan within the memory caps (None without emulated memory)."""
    caps = profile.memory_caps()
    if all(c is None for c in caps):
        return None
    problem = PlanProblem(
        global_batch=profile.global_batch,
        workers=tuple(
            WorkerSpec(id=str(i), model=m, micro_batch=c)
            for i, (m, c) in enumerate(zip(profile.models(), caps, strict=True))
        ),
    )
    return solve(problem, "minmax").makespan_ms


def optimum_ms(
    models: Sequence[PerfModel], global_batch: int, policy: str = "minmax"
) -> tuple[float, float]:
    """(integer plan's makespan, continuous optimum) for these models under a policy."""
    problem = PlanProblem(
        global_batch=global_batch,
        workers=tuple(WorkerSpec(id=str(i), model=m) for i, m in enumerate(models)),
    )
    plan = solve(problem, policy)
    return plan.makespan_ms, plan.lower_bound_ms


@dataclass(frozen=True)
class PolicyResult:
    samples_per_s: float
    total_s: float
    mean_iteration_ms: float
    idle_fraction: float
    plan_changes: int
    iterations: int
    ooms: int = 0
    peak_memory_fraction: float | None = None
    error: str | None = None
    job_id: int | None = None
    """The job that ran it (for the dashboard's compare page)."""


def failed(error: str) -> PolicyResult:
    """A policy whose job did not succeed: no figures, the reason."""
    nan = math.nan
    return PolicyResult(nan, nan, nan, nan, 0, 0, error=error)


def _memory(
    rows: Sequence[TelemetryOut], memory_mb: Sequence[int | None]
) -> tuple[int, float | None]:
    ooms = sum(1 for r in rows if r.oom_batch is not None)
    fractions = [
        r.peak_memory_mb / mb
        for r in rows
        if r.peak_memory_mb is not None
        and r.rank < len(memory_mb)
        and (mb := memory_mb[r.rank]) is not None
    ]
    return ooms, max(fractions) if fractions else None


def measure(rows: Sequence[TelemetryOut], memory_mb: Sequence[int | None] = ()) -> PolicyResult:
    """The figures above, from one job's telemetry (``memory_mb``: each rank's device memory)."""
    ends: dict[int, float] = defaultdict(float)
    samples: dict[int, int] = defaultdict(int)
    first_ms = 0.0
    idle = busy = 0.0
    versions = set()
    for r in rows:
        ends[r.iteration] = max(ends[r.iteration], r.ts)
        samples[r.iteration] += r.batch_size
        idle += r.sync_ms
        busy += r.data_ms + r.compute_ms + r.sync_ms
        versions.add(r.plan_version)
        if r.iteration == 0:
            first_ms = max(first_ms, r.data_ms + r.compute_ms + r.sync_ms)
    its = sorted(ends)
    if len(its) < 4:
        raise ValueError(
            f"too few iterations to measure: {len(its)} stored ({len(rows)} rows, "
            f"iterations {its[:8]}, ranks {sorted({r.rank for r in rows})})"
        )
    n = len(its)
    total_s = ends[its[-1]] - ends[its[0]] + first_ms / 1000
    half = its[n // 2 - 1]
    steady_s = ends[its[-1]] - ends[half]
    ooms, peak = _memory(rows, memory_mb)
    return PolicyResult(
        samples_per_s=sum(samples[i] for i in its[n // 2 :]) / steady_s
        if steady_s > 0
        else math.inf,
        total_s=total_s,
        mean_iteration_ms=1000 * total_s / n,
        idle_fraction=idle / busy if busy else 0.0,
        plan_changes=len(versions) - 1,
        iterations=n,
        ooms=ooms,
        peak_memory_fraction=peak,
    )


def run_policy(
    cluster: LocalCluster,
    profile: Profile,
    policy: PolicyName,
    iterations: int | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> PolicyResult:
    job = cluster.submit(profile.job_spec(policy, iterations))
    done = cluster.wait(job.id, on_progress)
    if done.status.value != "succeeded":
        return failed(f"job {job.id} ({policy.value}) {done.status.value}: {done.error}")
    rows = cluster.client.telemetry(job.id).items
    try:
        measured = measure(rows, [w.memory_mb for w in profile.workers])
    except ValueError as exc:  # a job that succeeded with its telemetry missing: this policy
        # failed to be measured, said in its row; the others' figures still come (a traceback
        # took them all away)
        return replace(failed(f"job {job.id} ({policy.value}) succeeded, but {exc}"), job_id=job.id)
    return replace(measured, job_id=job.id)


def report(profile: Profile, results: dict[PolicyName, PolicyResult]) -> dict[str, Any]:
    """The JSON ``evenflow compare --json`` prints."""
    _, continuous = optimum_ms(profile.models(), profile.global_batch)
    capped = capped_optimum_ms(profile)
    equal = results.get(PolicyName.EQUAL)
    ok = {p: r for p, r in results.items() if r.error is None}
    out: dict[str, Any] = {
        "ideal_samples_per_s": profile.global_batch / continuous * 1000,
        "policies": {
            p.value: (
                {k: v for k, v in asdict(r).items() if k not in ("iterations", "error", "job_id")}
                if r.error is None
                else {"error": r.error}
            )
            for p, r in results.items()
        },
        "speedup_vs_equal": {p.value: r.samples_per_s / equal.samples_per_s for p, r in ok.items()}
        if equal and equal.error is None
        else {},
        "failed": sorted(p.value for p, r in results.items() if r.error is not None),
    }
    if capped is not None:
        out["ideal_under_caps_samples_per_s"] = profile.global_batch / capped * 1000
    return out
