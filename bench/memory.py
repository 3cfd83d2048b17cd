"""Issue 15's targets on the whole local stack (control plane, agents, gloo workers).

    python bench/memory.py [--iterations 150] [--scale 2] [--json]

Four emulated workers: two fast cards with 12 GB (``1 * scale`` ms per sample) and two slower
ones with 80 GB (``3 * scale`` ms per sample), intercept 5 ms, each pass needing
``4595 + 90.7 b`` MB (resnet50-224px fp32 as measured on an H100, tests/data/h100_tb_curves.csv),
so a 12 GB card fits 84 samples per pass, 71 with the 10% headroom plans keep.

1. ``fits``: B = 256. Equal's 64 each fit everywhere; the speed-only optimum gives the fast
   cards 96, which does not fit them. Every policy must complete with no failure; reported per
   policy: samples/s, out-of-memory errors, the peak memory fraction, and for ``minmax`` the
   steady-state throughput against the ideal under the caps (B over the least makespan any plan
   within the caps can reach, extra passes counted). Target: >= 0.95.
2. ``injected-oom``: B = 384. The initial equal split (96 each) does not fit the fast cards: their
   first pass runs out of memory. Reported: out-of-memory errors, iterations lost (iterations
   missing or trained on fewer samples than their global batch; target <= 3) and what the
   recovery cost in time (the excess of the iterations with an error over the median
   iteration, in iterations).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from agent.runtime.sampler import GlobalBatchSampler
from contract.api import TelemetryOut
from contract.enums import PolicyName
from evenflow.experiment import Profile, ProfileWorker, capped_optimum_ms, measure, optimum_ms
from evenflow.local_cluster import LocalCluster

BASE_MB, PER_SAMPLE_MB = 4595.0, 90.7
MLP_SAMPLES = 4096
"""The built-in ``mlp`` workload's dataset size (its epochs end with a partial batch)."""
POLICIES = [PolicyName.EQUAL, PolicyName.PROPORTIONAL, PolicyName.MINMAX, PolicyName.ADAPTIVE]


def profile(global_batch: int, iterations: int, scale: float) -> Profile:
    def worker(name: str, ms: float, memory_mb: int) -> ProfileWorker:
        return ProfileWorker(
            name=name,
            per_sample_ms=ms * scale,
            intercept_ms=5.0,
            memory_mb=memory_mb,
            memory_base_mb=BASE_MB,
            memory_per_sample_mb=PER_SAMPLE_MB,
        )

    return Profile(
        global_batch=global_batch,
        iterations=iterations,
        policies=POLICIES,
        workload="mlp",
        explore_iterations=5,
        rebalance_every=20,
        workers=[
            worker("fast-12gb-0", 1.0, 12_288),
            worker("fast-12gb-1", 1.0, 12_288),
            worker("slow-80gb-0", 3.0, 81_920),
            worker("slow-80gb-1", 3.0, 81_920),
        ],
    )


def _per_iteration(rows: list[TelemetryOut]) -> dict[int, list[TelemetryOut]]:
    out: dict[int, list[TelemetryOut]] = defaultdict(list)
    for r in rows:
        out[r.iteration].append(r)
    return out


def recovery(rows: list[TelemetryOut], prof: Profile, iterations: int) -> dict[str, Any]:
    """Iterations lost to out-of-memory recovery and the time the recovery cost."""
    by_it = _per_iteration(rows)
    sampler = GlobalBatchSampler(MLP_SAMPLES, prof.global_batch)  # an epoch ends short
    lost = sum(
        1
        for it in range(iterations)
        if it not in by_it or sum(r.batch_size for r in by_it[it]) != sampler.global_count(it)
    )
    spans = {it: max(r.data_ms + r.compute_ms + r.sync_ms for r in v) for it, v in by_it.items()}
    median = statistics.median(spans.values())
    oom_its = sorted({r.iteration for r in rows if r.oom_batch is not None})
    excess = sum(max(0.0, spans[it] - median) for it in oom_its)
    return {
        "oom_iterations": oom_its,
        "oom_pass_sizes": sorted({r.oom_batch for r in rows if r.oom_batch is not None}),
        "iterations_lost": lost,
        "recovery_cost_iterations": excess / median if median else 0.0,
        "median_iteration_ms": median,
    }


def scenario(
    cluster: LocalCluster, prof: Profile, *, with_recovery: bool = False
) -> dict[str, Any]:
    capped = capped_optimum_ms(prof)
    assert capped is not None
    speed_only, _ = optimum_ms(prof.models(), prof.global_batch)
    out: dict[str, Any] = {
        "global_batch": prof.global_batch,
        "caps_per_pass": prof.memory_caps(),
        "ideal_under_caps_samples_per_s": prof.global_batch / capped * 1000,
        "speed_only_optimum_samples_per_s": prof.global_batch / speed_only * 1000,
        "policies": {},
    }
    for policy in prof.policies:
        job = cluster.submit(prof.job_spec(policy))
        done = cluster.wait(job.id)
        entry: dict[str, Any] = {"status": done.status.value}
        if done.status.value != "succeeded":
            entry["error"] = done.error
            out["policies"][policy.value] = entry
            continue
        rows = cluster.client.telemetry(job.id).items
        m = measure(rows, [w.memory_mb for w in prof.workers])
        plans = cluster.client.plans(job.id).items
        events = cluster.client.events(job.id).items
        entry.update(
            samples_per_s=m.samples_per_s,
            of_ideal_under_caps=m.samples_per_s / out["ideal_under_caps_samples_per_s"],
            ooms=m.ooms,
            oom_events=sum(1 for e in events if e.kind == "oom"),
            peak_memory_fraction=m.peak_memory_fraction,
            plan_changes=m.plan_changes,
            final_plan=plans[0].batch_sizes if plans else None,
            final_caps=plans[0].memory_caps if plans else None,
        )
        if with_recovery:
            entry.update(recovery(list(rows), prof, prof.iterations))
        out["policies"][policy.value] = entry
    out["failed"] = [p for p, e in out["policies"].items() if e["status"] != "succeeded"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=150)
    ap.add_argument("--scale", type=float, default=2.0, help="per-sample time multiplier")
    ap.add_argument("--scenarios", default="fits,injected-oom")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    chosen = set(args.scenarios.split(","))
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d, LocalCluster(Path(d), workers=4, agents=2) as cluster:
        if "fits" in chosen:
            results["fits"] = scenario(cluster, profile(256, args.iterations, args.scale))
        if "injected-oom" in chosen:
            oom = profile(384, max(40, args.iterations // 3), args.scale)
            oom.policies = [PolicyName.EQUAL, PolicyName.MINMAX]
            results["injected-oom"] = scenario(cluster, oom, with_recovery=True)
    fits = results.get("fits", {}).get("policies", {}).get("minmax", {})
    injected = results.get("injected-oom", {}).get("policies", {})
    results["targets"] = {
        "every_policy_completes": not any(r["failed"] for r in results.values()),
        "minmax_of_ideal_under_caps": fits.get("of_ideal_under_caps"),
        "max_iterations_lost": max(
            (e.get("iterations_lost", 0) for e in injected.values()), default=None
        ),
    }
    if args.json:
        print(json.dumps(results, indent=2, default=str))
        return
    for name, sc in results.items():
        if name == "targets":
            continue
        print(
            f"== {name}: B = {sc['global_batch']}, caps per pass {sc['caps_per_pass']}, "
            f"ideal under caps {sc['ideal_under_caps_samples_per_s']:.0f} samples/s"
        )
        for policy, e in sc["policies"].items():
            print(f"  {policy:<12} {json.dumps(e, default=str)}")
    print("targets:", json.dumps(results["targets"]))


if __name__ == "__main__":
    main()
