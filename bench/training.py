"""Issue 4's targets on the whole local stack (control plane, agents, gloo workers).

    python bench/training.py [--seconds 30] [--json] [--skip-overhead]

1. Balancing: 4 emulated workers whose per-sample times are 1:1:2:4 (speeds 4:4:2:1) with a
   5 ms intercept, global batch 256, MLP workload. The same job runs with ``equal`` and with
   ``minmax`` for about ``--seconds`` each; steady-state samples/s (second half of the
   iterations) are compared with each other and with the ideal (B over the continuous
   min-max optimum of the true speeds). Targets: minmax >= 0.95 of ideal, >= 2.5x equal.
2. Runtime overhead against a plain DDP loop with the same fixed batch sizes
   (``bench/runtime_overhead.py``, run here as a subprocess). Target: at most 2%.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from contract.enums import PolicyName
from evenflow.experiment import Profile, ProfileWorker, measure, optimum_ms
from evenflow.local_cluster import LocalCluster

ROOT = Path(__file__).resolve().parents[1]


def profile(scale: float = 1.0) -> Profile:
    """The issue's profile; ``scale`` multiplies the per-sample times (ratios stay 1:1:2:4)."""
    return Profile(
        global_batch=256,
        iterations=100,
        policies=[PolicyName.EQUAL, PolicyName.MINMAX],
        workload="mlp",
        workers=[
            ProfileWorker(name=f"w{i}", per_sample_ms=scale * ms, intercept_ms=5.0)
            for i, ms in enumerate((1, 1, 2, 4))
        ],
    )


def balancing(seconds: float, scale: float = 1.0) -> dict[str, Any]:
    prof = profile(scale)
    models = prof.models()
    integer_ms, ideal_ms = optimum_ms(models, prof.global_batch)
    out: dict[str, Any] = {
        "scale": scale,
        "ideal_samples_per_s": prof.global_batch / ideal_ms * 1000,
        "integer_optimum_ms": integer_ms,
        "continuous_optimum_ms": ideal_ms,
    }
    with tempfile.TemporaryDirectory() as d, LocalCluster(Path(d), workers=4, agents=2) as cluster:
        for policy in prof.policies:
            predicted = optimum_ms(models, prof.global_batch, policy.value)[0]
            iterations = max(40, math.ceil(seconds * 1000 / predicted))
            job = cluster.submit(prof.job_spec(policy, iterations))
            done = cluster.wait(job.id)
            if done.status.value != "succeeded":
                raise RuntimeError(f"{policy.value}: {done.status.value}: {done.error}")
            rows = cluster.client.telemetry(job.id).items
            r = measure(rows)
            steady = [x for x in rows if x.iteration >= iterations // 2]
            by_it: dict[int, list[Any]] = {}
            for x in steady:
                by_it.setdefault(x.iteration, []).append(x)
            out[policy.value] = {
                "samples_per_s": r.samples_per_s,
                "mean_iteration_ms": r.mean_iteration_ms,
                "idle_fraction": r.idle_fraction,
                "plan_changes": r.plan_changes,
                "iterations": r.iterations,
                # The slowest rank's compute (what balancing controls) and the all-reduce itself
                # (the fastest arrival's wait is ~0, so the smallest sync is the collective).
                "compute_makespan_ms": statistics.median(
                    max(x.compute_ms for x in v) for v in by_it.values()
                ),
                "all_reduce_ms": statistics.median(
                    min(x.sync_ms for x in v) for v in by_it.values()
                ),
                "data_ms": statistics.median(max(x.data_ms for x in v) for v in by_it.values()),
            }
            steady_ms = 1000 * prof.global_batch / r.samples_per_s
            parts = ("compute_makespan_ms", "all_reduce_ms", "data_ms")
            out[policy.value]["steady_iteration_ms"] = steady_ms
            # What the telemetry's phases do not cover: the step, the boundary, jitter of the
            # slowest rank (medians of maxima understate the mean of maxima).
            out[policy.value]["rest_ms"] = steady_ms - sum(out[policy.value][k] for k in parts)
    out["minmax_of_ideal"] = out["minmax"]["samples_per_s"] / out["ideal_samples_per_s"]
    out["minmax_vs_equal"] = out["minmax"]["samples_per_s"] / out["equal"]["samples_per_s"]
    out["minmax_balance"] = ideal_ms / out["minmax"]["compute_makespan_ms"]
    return out


def overhead() -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "runtime_overhead.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--scales", default="1,2", help="per-sample time multipliers to run")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--skip-overhead", action="store_true")
    args = ap.parse_args()
    results: dict[str, Any] = {
        "balancing": [balancing(args.seconds, float(k)) for k in args.scales.split(",")]
    }
    if not args.skip_overhead:
        results["runtime_overhead"] = overhead()
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for b in results["balancing"]:
        print(
            f"per-sample ms x{b['scale']:g}: ideal {b['ideal_samples_per_s']:.0f} samples/s "
            f"(continuous optimum {b['continuous_optimum_ms']:.1f} ms)"
        )
        for p in ("equal", "minmax"):
            r = b[p]
            print(
                f"  {p:<7} {r['samples_per_s']:7.0f} samples/s  {r['mean_iteration_ms']:6.1f} ms/iteration  "
                f"slowest compute {r['compute_makespan_ms']:6.1f} ms  all-reduce {r['all_reduce_ms']:4.1f} ms  "
                f"idle {100 * r['idle_fraction']:4.1f}%  plan changes {r['plan_changes']}"
            )
            print(
                f"          steady {r['steady_iteration_ms']:6.1f} ms/iteration = slowest compute "
                f"{r['compute_makespan_ms']:.1f} + all-reduce {r['all_reduce_ms']:.1f} + data "
                f"{r['data_ms']:.1f} + rest {r['rest_ms']:.1f} ms"
            )
        print(
            f"  minmax: {b['minmax_of_ideal']:.3f} of ideal (target >= 0.95), {b['minmax_vs_equal']:.2f}x equal "
            f"(target >= 2.5); balance {b['minmax_balance']:.3f} (optimum / slowest compute)"
        )
    if "runtime_overhead" in results:
        o = results["runtime_overhead"]
        print(
            f"runtime vs plain DDP: {o['evenflow_ms_median']} vs {o['ddp_ms_median']} ms/iteration "
            f"({o['overhead_pct']:+.1f}%, target <= +2%)"
        )


if __name__ == "__main__":
    main()
