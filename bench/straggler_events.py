"""Straggler events in runs without slowdowns: what ``make demo`` and ``evenflow compare`` show.

    python bench/straggler_events.py [--iterations 200] [--runs demo,compare] [--json]

No worker is ever slowed down in these runs, so every event the detector opens is a false one.
Two profiles, both with the demo's emulated workers (per-sample ms 1, 1, 2, 4; intercept 5 ms;
B = 256):

- ``demo``: ``evenflow demo``'s job (cnn-digits: 1,797 samples, so every eighth iteration is an
  epoch's final partial batch of 5 samples) under ``equal`` then ``minmax``;
- ``compare``: an ``evenflow compare`` profile (mlp) under ``equal``, ``proportional``,
  ``minmax`` and ``adaptive``.

Printed: events per job by kind, open and closed. Target: zero in every job.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from contract.enums import PolicyName
from evenflow.experiment import Profile, ProfileWorker
from evenflow.local_cluster import LocalCluster

PER_SAMPLE = (1.0, 1.0, 2.0, 4.0)


def profile(workload: str, n: int, policies: list[PolicyName]) -> Profile:
    return Profile(
        global_batch=256,
        iterations=n,
        policies=policies,
        workload=workload,
        workers=[
            ProfileWorker(name=f"emulated-{i}", per_sample_ms=ms, intercept_ms=5.0)
            for i, ms in enumerate(PER_SAMPLE)
        ],
    )


RUNS = {
    "demo": ("cnn-digits", [PolicyName.EQUAL, PolicyName.MINMAX]),
    "compare": (
        "mlp",
        [PolicyName.EQUAL, PolicyName.PROPORTIONAL, PolicyName.MINMAX, PolicyName.ADAPTIVE],
    ),
}


def run(cluster: LocalCluster, p: Profile, policy: PolicyName) -> dict[str, Any]:
    job = cluster.submit(p.job_spec(policy))
    done = cluster.wait(job.id)
    if done.status.value != "succeeded":
        raise RuntimeError(f"job {job.id} ({policy.value}) {done.status.value}: {done.error}")
    events = cluster.client.events(job.id).items
    kinds = Counter(e.kind for e in events)
    return {
        "job": job.id,
        "events": len(events),
        "open": sum(1 for e in events if e.end_iteration is None),
        "by_kind": dict(sorted(kinds.items())),
        "ranks": sorted({e.rank for e in events if e.rank is not None}),
        "starts": sorted({e.start_iteration for e in events})[:12],
        "detail": [
            (e.rank, e.kind, e.start_iteration, e.end_iteration, round(e.severity, 2))
            for e in sorted(events, key=lambda e: e.start_iteration)[:12]
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--runs", default="demo,compare")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as d, LocalCluster(Path(d), workers=4, agents=2) as c:
        for name in args.runs.split(","):
            workload, policies = RUNS[name]
            p = profile(workload, args.iterations, policies)
            for policy in policies:
                r = run(c, p, policy)
                results[f"{name}/{policy.value}"] = r
                print(
                    f"{name:<8} {policy.value:<13} job {r['job']:<3} events {r['events']:<4} "
                    f"open {r['open']:<3} {r['by_kind']} ranks {r['ranks']} starts {r['starts']}",
                    flush=True,
                )
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
