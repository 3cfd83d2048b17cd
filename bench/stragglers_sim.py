"""Benchmark (pure simulation): straggler policies against the oracle on three scenarios.

Four ranks with ResNet-50-like models from the published figures (V100: 38 ms + 2.83 ms/sample;
P100 about 1.6x slower; an A100-class device about 2x faster; a second V100), global batch 256,
memory caps, 5% uniform noise, and an all-reduce of 60 ms (102 MB of gradients over ~2.5 GB/s of
bus bandwidth). Scenarios:

- ``3x-window``: rank 1 runs 3x slower on iterations [200, 500) of 800.
- ``periodic``: ranks 0 and 2 are 2x slower for 60 iterations out of every 200, out of phase.
- ``10x-to-end``: rank 3 runs 10x slower from iteration 250 to the end (800).

For each scenario and policy: total simulated time, its ratio to the oracle, plan changes,
regroups, and (adaptive) detection delays and plan changes per event.

The simulator runs the same detector and ladder as the server (with the all-reduce's slowdown
measured the same way), but it starts from the true min-max plan (no warm-up), and a decision
takes effect at the next iteration (no telemetry flush, control-loop round or plan delivery):
on the live stack (``bench/stragglers.py``) those are separate lines of the decomposition.
Switching costs are the ladder's NCCL-sized defaults (a GPU cluster).

    python bench/stragglers_sim.py [--seed 0] [--noise 0.05] [--gaussian] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from server.planner import PerfModel  # noqa: E402
from server.stragglers import (  # noqa: E402
    POLICY_NAMES,
    RankSlowdown,
    Scenario,
    SimResult,
    simulate,
)

MODELS = (
    PerfModel(2.83, 38.0),  # V100
    PerfModel(4.6, 45.0),  # P100-like
    PerfModel(1.4, 20.0),  # A100-class
    PerfModel(2.83, 38.0),  # V100
)
CAPS = (128, 128, 256, 128)


def scenarios(seed: int, noise: float, kind: str) -> list[Scenario]:
    common = dict(
        models=MODELS,
        global_batch=256,
        iterations=800,
        noise=noise,
        noise_kind=kind,
        seed=seed,
        max_batch=CAPS,
        sync_ms=60.0,
    )
    periodic = []
    for start in range(100, 700, 200):
        periodic.append(RankSlowdown(0, start, start + 60, 2.0))
        periodic.append(RankSlowdown(2, start + 100, start + 160, 2.0))
    return [
        Scenario("3x-window", slowdowns=(RankSlowdown(1, 200, 500, 3.0),), **common),  # type: ignore[arg-type]
        Scenario("periodic", slowdowns=tuple(periodic), **common),  # type: ignore[arg-type]
        Scenario("10x-to-end", slowdowns=(RankSlowdown(3, 250, 800, 10.0),), **common),  # type: ignore[arg-type]
    ]


def row(r: SimResult) -> str:
    delays = ",".join("-" if d is None else str(d) for d in r.detection_delays) or "-"
    extra = ",".join(str(c - 1) for c in r.changes_per_event) or "-"
    return (
        f"{r.scenario:<11} {r.policy:<9} {r.total_ms / 1000:9.1f} {r.oracle_ms / 1000:9.1f} "
        f"{r.ratio:7.3f} {r.plan_changes:7d} {r.regroups:8d}  {delays:<16} {extra}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise", type=float, default=0.05)
    parser.add_argument("--gaussian", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    kind = "gaussian" if args.gaussian else "uniform"
    print(
        f"{'scenario':<11} {'policy':<9} {'total s':>9} {'oracle s':>9} {'ratio':>7} "
        f"{'changes':>7} {'regroups':>8}  {'detect delay':<16} extra changes/event"
    )
    results = []
    for scenario in scenarios(args.seed, args.noise, kind):
        for policy in POLICY_NAMES:
            result = simulate(scenario, policy)
            results.append(result)
            print(row(result))
    if args.json:
        args.json.write_text(
            json.dumps(
                [
                    {
                        "scenario": r.scenario,
                        "policy": r.policy,
                        "total_ms": r.total_ms,
                        "oracle_ms": r.oracle_ms,
                        "ratio": r.ratio,
                        "plan_changes": r.plan_changes,
                        "regroups": r.regroups,
                        "detection_delays": list(r.detection_delays),
                        "changes_per_event": list(r.changes_per_event),
                    }
                    for r in results
                ],
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
