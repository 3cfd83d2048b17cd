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
- ``plan_changes``: plan versions used beyond the first.

``ideal_samples_per_s`` is B over the continuous min-max optimum of the true (base) emulated
speeds: what perfect balancing with no overhead would reach.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from contract.api import TelemetryOut
from contract.enums import PolicyName
from contract.spec import EmulatedWorker, JobSpec, PolicySpec, Slowdown, WorkloadSpec
from evenflow.local_cluster import LocalCluster
from server.planner import PerfModel, PlanProblem, WorkerSpec, solve


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


def measure(rows: Sequence[TelemetryOut]) -> PolicyResult:
    """The figures above, from one job's telemetry."""
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
        raise ValueError("too few iterations to measure")
    n = len(its)
    total_s = ends[its[-1]] - ends[its[0]] + first_ms / 1000
    half = its[n // 2 - 1]
    steady_s = ends[its[-1]] - ends[half]
    return PolicyResult(
        samples_per_s=sum(samples[i] for i in its[n // 2 :]) / steady_s
        if steady_s > 0
        else math.inf,
        total_s=total_s,
        mean_iteration_ms=1000 * total_s / n,
        idle_fraction=idle / busy if busy else 0.0,
        plan_changes=len(versions) - 1,
        iterations=n,
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
        raise RuntimeError(f"job {job.id} ({policy.value}) {done.status.value}: {done.error}")
    return measure(cluster.client.telemetry(job.id, limit=100_000))


def report(profile: Profile, results: dict[PolicyName, PolicyResult]) -> dict[str, Any]:
    """The JSON ``evenflow compare --json`` prints."""
    _, continuous = optimum_ms(profile.models(), profile.global_batch)
    equal = results.get(PolicyName.EQUAL)
    return {
        "ideal_samples_per_s": profile.global_batch / continuous * 1000,
        "policies": {
            p.value: {k: v for k, v in asdict(r).items() if k != "iterations"}
            for p, r in results.items()
        },
        "speedup_vs_equal": {
            p.value: r.samples_per_s / equal.samples_per_s for p, r in results.items()
        }
        if equal
        else {},
    }
