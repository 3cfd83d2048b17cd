"""Issue 6's scenarios on the whole local stack (control plane, agents, gloo workers).

    python bench/stragglers.py [--iterations 200] [--json] [--scenarios 3x-window,periodic,10x-to-end]
                               [--policies equal,static,minmax,adaptive] [--excess adaptive]
                               [--dump DIR | --load DIR]

Four emulated workers (per-sample ms 1, 1, 2, 4; intercept 5 ms; B = 256, MLP) with scripted
slowdowns that the emulation applies inside the real training loop:

- ``3x-window``: rank 0 three times slower on iterations [60, 140);
- ``periodic``: contention on ranks 1 and 2 in turn, 2x for 30 iterations at a time;
- ``10x-to-end``: rank 0 ten times slower from iteration 80 to the end.

Each runs under ``equal``, ``static`` (min-max once after warm-up), ``minmax`` (re-planned every
20 iterations) and ``adaptive`` (the straggler ladder). Reported: total time against an oracle
that knows the schedule (the sum over iterations of the continuous optimum for the true speeds,
no overhead), detection delay (confirmation iteration minus onset) and the ladder's plan changes
per event beyond its first reaction. Targets: adaptive within 1.15x of the oracle, at most 2
plan changes per event beyond the first reaction.

For the policies in ``--excess`` it also prints where the time beyond the oracle went
(``bench/excess.py``): warm-up before the first min-max plan, per-iteration overhead no plan
removes (all-reduce, step and plan boundary, data, compute above the emulated target),
regroup/resync, the reaction to each change of the true speeds (detection, the server's
telemetry-to-plan latency, delivery to the workers) and the quality of the plans in force.
``--dump DIR`` keeps each job's raw telemetry, plans and events; ``--load DIR`` analyses them
again without running anything.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

from excess import decompose  # bench/ is the script's directory

from contract.agent import PlanOut
from contract.api import EventOut, TelemetryOut
from contract.enums import PolicyName
from contract.spec import Slowdown
from evenflow.experiment import Profile, ProfileWorker, measure, optimum_ms
from evenflow.local_cluster import LocalCluster
from server.planner import PerfModel

PER_SAMPLE = (1.0, 1.0, 2.0, 4.0)
INTERCEPT = 5.0
B = 256


def scenarios(n: int) -> dict[str, dict[int, list[Slowdown]]]:
    def s(a: int, b: int, f: float) -> Slowdown:
        return Slowdown(from_iteration=a, to_iteration=min(b, n), factor=f)

    return {
        "3x-window": {0: [s(60, 140, 3.0)]},
        "periodic": {1: [s(40, 70, 2.0), s(120, 150, 2.0)], 2: [s(80, 110, 2.0), s(160, 190, 2.0)]},
        "10x-to-end": {0: [s(80, n, 10.0)]},
    }


def profile(slow: dict[int, list[Slowdown]], n: int) -> Profile:
    return Profile(
        global_batch=B,
        iterations=n,
        workload="mlp",
        rebalance_every=20,
        explore_iterations=10,
        workers=[
            ProfileWorker(
                name=f"w{r}", per_sample_ms=ms, intercept_ms=INTERCEPT, slowdowns=slow.get(r, [])
            )
            for r, ms in enumerate(PER_SAMPLE)
        ],
    )


def factor(slow: dict[int, list[Slowdown]], rank: int, it: int) -> float:
    return next(
        (x.factor for x in slow.get(rank, []) if x.from_iteration <= it < x.to_iteration), 1.0
    )


@cache
def _optimum(factors: tuple[float, ...]) -> float:
    models = [PerfModel(f * ms, f * INTERCEPT) for f, ms in zip(factors, PER_SAMPLE, strict=True)]
    return optimum_ms(models, B)[1]


def oracle_s(slow: dict[int, list[Slowdown]], n: int) -> float:
    return sum(_optimum(tuple(factor(slow, r, it) for r in range(4))) for it in range(n)) / 1000


def collect(
    cluster: LocalCluster, name: str, slow: dict[int, list[Slowdown]], policy: PolicyName, n: int
) -> dict[str, Any]:
    """Run one job; its raw telemetry, plans and events as plain JSON-ready data."""
    job = cluster.submit(profile(slow, n).job_spec(policy))
    done = cluster.wait(job.id)
    if done.status.value != "succeeded":
        raise RuntimeError(f"{name}/{policy.value}: job {done.status.value}: {done.error}")
    return {
        "scenario": name,
        "policy": policy.value,
        "iterations": n,
        "telemetry": [r.model_dump(mode="json") for r in cluster.client.telemetry(job.id).items],
        "plans": [p.model_dump(mode="json") for p in cluster.client.plans(job.id).items],
        "events": [e.model_dump(mode="json") for e in cluster.client.events(job.id).items],
    }


def analyse(raw: dict[str, Any], slow: dict[int, list[Slowdown]]) -> dict[str, Any]:
    """The figures of one job from its raw record (``collect``), and for every policy where its
    time went beyond the oracle (``excess``)."""
    n = int(raw["iterations"])
    telemetry = [TelemetryOut.model_validate(r) for r in raw["telemetry"]]
    m = measure(telemetry)
    out: dict[str, Any] = {"total_s": m.total_s, "plan_changes": m.plan_changes}
    schedule = {
        r: [(w.from_iteration, w.to_iteration, w.factor) for w in ws] for r, ws in slow.items()
    }
    out["excess"] = decompose(
        raw, schedule, per_sample=PER_SAMPLE, intercept=INTERCEPT, global_batch=B
    )
    if raw["policy"] != PolicyName.ADAPTIVE.value:
        return out
    events = [EventOut.model_validate(e) for e in raw["events"] if e["kind"] == "dynamic"]
    ladder = [
        PlanOut.model_validate(p)
        for p in raw["plans"]
        if str(p["reason"]).startswith("straggler ladder")
    ]
    delays: list[int | None] = []
    extra: list[int] = []
    for rank, windows in slow.items():
        for w in windows:
            mine = [
                e
                for e in events
                if e.rank == rank and w.from_iteration - 5 <= e.start_iteration < w.to_iteration
            ]
            if not mine:
                delays.append(None)
                continue
            e = min(mine, key=lambda e: e.start_iteration)
            confirmed = (e.detail or {}).get("confirmed_iteration")
            delays.append(None if confirmed is None else confirmed - w.from_iteration)
    # Plan changes per event beyond the first reaction: ladder plans that took effect while
    # the event was open (or within 10 iterations of its end: undoing the reaction).
    took_effect: dict[int, int] = {}
    for r in sorted(telemetry, key=lambda r: r.iteration):
        if not r.probe:
            took_effect.setdefault(r.plan_version, r.iteration)
    for e in events:
        end = e.end_iteration if e.end_iteration is not None else n
        during = [p for p in ladder if start_ok(took_effect.get(p.version), e.start_iteration, end)]
        extra.append(max(0, len(during) - 1))
    out.update(
        events=len(events),
        detection_delays=delays,
        extra_changes_per_event=extra,
        ladder_plans=len(ladder),
    )
    return out


def start_ok(first: int | None, start: int, end: int) -> bool:
    return first is not None and start <= first < end + 10


def report(name: str, policy: str, r: dict[str, Any], *, excess: bool) -> None:
    line = f"{name:<11} {policy:<9} {r['total_s']:7.1f} s  {r['vs_oracle']:.3f}x oracle"
    if "events" in r:
        line += (
            f"  events {r['events']} delays {r['detection_delays']} extra changes "
            f"{r['extra_changes_per_event']}"
        )
    print(line, flush=True)
    if excess:
        for text in r["excess"].lines():
            print(f"    {text}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--scenarios", default="3x-window,periodic,10x-to-end")
    ap.add_argument("--policies", default="equal,static,minmax,adaptive")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--dump", type=Path, help="write each job's raw record to DIR/SCENARIO.POLICY.json"
    )
    ap.add_argument("--load", type=Path, help="analyse the records in DIR instead of running jobs")
    ap.add_argument(
        "--excess", default="adaptive", help="policies whose time is decomposed in the output"
    )
    args = ap.parse_args()
    n = args.iterations
    chosen = {k: v for k, v in scenarios(n).items() if k in args.scenarios.split(",")}
    policies = [PolicyName(p) for p in args.policies.split(",")]
    decomposed = set(args.excess.split(","))
    results: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        cluster = None
        if args.load is None:
            d = stack.enter_context(tempfile.TemporaryDirectory())
            cluster = stack.enter_context(LocalCluster(Path(d), workers=4, agents=2))
        for name, slow in chosen.items():
            oracle = oracle_s(slow, n)
            results[name] = {"oracle_s": oracle}
            for policy in policies:
                file = f"{name}.{policy.value}.json"
                if cluster is None:
                    assert args.load is not None
                    if not (args.load / file).exists():
                        continue
                    raw = json.loads((args.load / file).read_text())
                else:
                    raw = collect(cluster, name, slow, policy, n)
                if args.dump is not None:
                    args.dump.mkdir(parents=True, exist_ok=True)
                    (args.dump / file).write_text(json.dumps(raw))
                r = analyse(raw, slow)
                r["vs_oracle"] = r["total_s"] / oracle
                report(name, policy.value, r, excess=policy.value in decomposed)
                r["excess"] = r["excess"].as_dict()
                results[name][policy.value] = r
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
