"""Benchmark: the exact min-max planner against PuLP/CBC on the same instances.

Instances are heterogeneous fleets drawn from the published ResNet-50 figures in
``gpu_profiles.csv``: ``per_sample_ms = 1000 / samples_per_s``, an intercept about 13 samples'
worth (V100 ResNet-50 measures 38 ms + 2.83 ms/sample) times U(0.5, 1.5), a floor on one worker in
five (Transformer-like flat region up to a knee of 32-64 samples), the row's largest batch as the
memory cap, and a global batch of 64 per worker.

For each size: the exact solver's median time over several runs (what a caller would time around
``solve``; building the problem value is reported apart), its makespan and gap to the lower bound,
the two baselines' makespans, and CBC cold and warm-started from the exact plan, each with its
solution status as CBC reported it. CBC runs only up to ``--cbc-max-workers``; a violated check
(exact makespan above CBC's) makes the exit status 1.

    python bench/planner.py [--sizes 4,16,64] [--repeats 5] [--cbc-time-limit 30] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from server.planner import (  # noqa: E402
    GpuProfile,
    PerfModel,
    PlanProblem,
    SolveStatus,
    WorkerSpec,
    load_gpu_profiles,
    solve,
    solve_ilp,
)
from server.planner.profiles import DEFAULT_PROFILES  # noqa: E402

DEFAULT_SIZES = (4, 16, 64, 256, 1024, 4096, 10_000)
INTERCEPT_SAMPLES = 38.0 / 2.83  # V100 ResNet-50: intercept worth ~13.4 samples


def fleet(n: int, rows: list[GpuProfile], seed: int) -> PlanProblem:
    rng = np.random.default_rng(seed)
    workers = []
    for i in range(n):
        row = rows[int(rng.integers(len(rows)))]
        per_sample = 1000.0 / row.samples_per_s
        intercept = per_sample * INTERCEPT_SAMPLES * float(rng.uniform(0.5, 1.5))
        floor = 0.0
        if rng.random() < 0.2:
            floor = intercept + per_sample * float(rng.uniform(32, 64))
        model = PerfModel(per_sample, intercept, floor)
        workers.append(WorkerSpec(f"w{i}", model, max_batch=row.batch_per_gpu))
    return PlanProblem(64 * n, tuple(workers))


def median_time(fn: Any, repeats: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def run_size(n: int, rows: list[GpuProfile], args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    problem = fleet(n, rows, args.seed + n)
    build_s = time.perf_counter() - start
    exact_s, exact = median_time(lambda: solve(problem, "minmax"), args.repeats)
    out: dict[str, Any] = {
        "workers": n,
        "global_batch": problem.global_batch,
        "build_ms": build_s * 1e3,
        "exact_ms": exact_s * 1e3,
        "makespan_ms": exact.makespan_ms,
        "lower_bound_ms": exact.lower_bound_ms,
        "gap": exact.gap,
        "idle_workers": sum(b == 0 for b in exact.batch_sizes.values()),
        "equal_ms": solve(problem, "equal").makespan_ms,
        "proportional_ms": solve(problem, "proportional").makespan_ms,
    }
    if n > args.cbc_max_workers:
        out["cbc_skipped"] = (
            f"CBC skipped above {args.cbc_max_workers} workers: it does not prove optimality "
            f"within {args.cbc_time_limit:g} s there"
        )
        return out
    for label, warm in (("cbc", None), ("cbc_warm", exact)):
        start = time.perf_counter()
        result = solve_ilp(problem, time_limit_s=args.cbc_time_limit, warm_start=warm)
        out[f"{label}_s"] = time.perf_counter() - start
        out[f"{label}_status"] = result.status.value
        out[f"{label}_lp_status"] = result.lp_status
        out[f"{label}_solution_status"] = result.solution_status
        span = result.plan.makespan_ms if result.plan is not None else None
        out[f"{label}_makespan_ms"] = span
        out[f"{label}_check"] = span is None or exact.makespan_ms <= span
        if result.status is SolveStatus.OPTIMAL and span is not None:
            out[f"{label}_rel_diff"] = (span - exact.makespan_ms) / exact.makespan_ms
    return out


def fmt_cbc(r: dict[str, Any], label: str) -> str:
    if f"{label}_s" not in r:
        return "skipped"
    span = r[f"{label}_makespan_ms"]
    span_s = f"{span:.2f}" if span is not None else "-"
    return f"{r[f'{label}_s']:.2f}s {r[f'{label}_status']} {span_s}"


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    head = (
        f"{'workers':>7} {'B':>7} {'exact ms':>9} {'build ms':>9} {'makespan':>9} {'gap LB':>7} "
        f"{'idle':>5} {'equal':>8} {'prop.':>8}  {'CBC cold (time status makespan)':<36} "
        f"{'CBC warm-started':<30} {'exact<=CBC':<10}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        checks = [r[k] for k in ("cbc_check", "cbc_warm_check") if k in r]
        check = "-" if not checks else ("yes" if all(checks) else "NO")
        lines.append(
            f"{r['workers']:>7} {r['global_batch']:>7} {r['exact_ms']:>9.2f} {r['build_ms']:>9.1f} "
            f"{r['makespan_ms']:>9.2f} {100 * r['gap']:>6.2f}% {r['idle_workers']:>5} "
            f"{r['equal_ms']:>8.1f} {r['proportional_ms']:>8.1f}  {fmt_cbc(r, 'cbc'):<36} "
            f"{fmt_cbc(r, 'cbc_warm'):<30} {check:<10}"
        )
    notes = [r["cbc_skipped"] for r in results if "cbc_skipped" in r]
    if notes:
        lines.append(f"note: {notes[0]}")
    lines.append(
        f"exact: median of {args.repeats} runs of solve(problem, 'minmax'); CBC: one run each, "
        f"time limit {args.cbc_time_limit:g} s, 1 thread; status is CBC's solution status "
        "(optimal = proven; feasible = stopped at the time limit, PuLP's status still says Optimal)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cbc-time-limit", type=float, default=30.0)
    parser.add_argument("--cbc-max-workers", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profiles", type=Path, default=DEFAULT_PROFILES)
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args(argv)
    if args.cbc_time_limit > 60:
        parser.error("--cbc-time-limit is at most 60 s")
    rows = [
        r
        for r in load_gpu_profiles(args.profiles)
        if r.model == "resnet50" and r.batch_per_gpu is not None
    ]
    results = []
    for n in (int(s) for s in args.sizes.split(",")):
        results.append(run_size(n, rows, args))
        print(f"  done: {n} workers", file=sys.stderr, flush=True)
    print(table(results, args))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    ok = all(r.get(k, True) for r in results for k in ("cbc_check", "cbc_warm_check"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
