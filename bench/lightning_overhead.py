"""Issue 57's throughput target for the Lightning integration, on the whole local stack.

    python bench/lightning_overhead.py [--iterations 150] [--rounds 1] [--json]

The causal language model of ``examples/text.py`` trained twice on 4 emulated workers whose
per-sample times are 1:1:2:4 (speeds 4:4:2:1, as ``evenflow demo``'s), with the same spec,
data, optimizer, schedule and clipping: once through Evenflow's own loop (``examples.lightning_text:own_loop``:
``ctx.batches``/``ctx.backward`` directly), once through the Lightning integration
(``examples.lightning_text:train``: the same model as a LightningModule under
``evenflow.integrations.lightning``). Both jobs are balanced by ``minmax`` with
``policy.exclude: false`` (what the integration needs). Steady-state samples/s (second half of
the iterations, from the ranks' telemetry timestamps) of each, and their ratio. Target: the
Lightning job reaches at least 0.9 of the own loop's throughput. ``--rounds`` alternates the
two jobs that many times (the ratio of the medians is reported).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from contract.spec import JobSpec
from evenflow.experiment import measure
from evenflow.local_cluster import LocalCluster

GLOBAL_BATCH = 128
PER_SAMPLE_MS = (4.0, 4.0, 8.0, 16.0)  # speeds 4:4:2:1
INTERCEPT_MS = 5.0
ARGS = {"sequences": 4096, "workers": 1, "dropout": 0.0, "seed": 0}
ENTRYPOINTS = {
    "own loop": "examples.lightning_text:own_loop",
    "lightning": "examples.lightning_text:train",
}


def spec(entrypoint: str, iterations: int) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "lightning-overhead",
            "workload": {"entrypoint": entrypoint, "seed": 1, "args": ARGS},
            "global_batch": GLOBAL_BATCH,
            "iterations": iterations,
            "workers": len(PER_SAMPLE_MS),
            "policy": {"name": "minmax", "exclude": False},
            "emulation": [
                {"name": f"w{i}", "per_sample_ms": ms, "intercept_ms": INTERCEPT_MS}
                for i, ms in enumerate(PER_SAMPLE_MS)
            ],
        }
    )


def run(iterations: int, rounds: int) -> dict[str, Any]:
    figures: dict[str, list[float]] = {name: [] for name in ENTRYPOINTS}
    changes: dict[str, list[int]] = {name: [] for name in ENTRYPOINTS}
    with tempfile.TemporaryDirectory() as d, LocalCluster(Path(d), workers=4, agents=2) as cluster:
        for _ in range(rounds):
            for name, entrypoint in ENTRYPOINTS.items():
                job = cluster.submit(spec(entrypoint, iterations))
                done = cluster.wait(job.id, timeout_s=900)
                if done.status.value != "succeeded":
                    raise RuntimeError(f"{name}: {done.status.value}: {done.error}")
                r = measure(cluster.client.telemetry(job.id).items)
                figures[name].append(r.samples_per_s)
                changes[name].append(r.plan_changes)
    ideal = GLOBAL_BATCH / (
        GLOBAL_BATCH / sum(1 / ms for ms in PER_SAMPLE_MS) + INTERCEPT_MS
    )  # samples per ms at the continuous min-max optimum
    own = statistics.median(figures["own loop"])
    lit = statistics.median(figures["lightning"])
    return {
        "global_batch": GLOBAL_BATCH,
        "per_sample_ms": list(PER_SAMPLE_MS),
        "iterations": iterations,
        "rounds": rounds,
        "ideal_samples_per_s": 1000 * ideal,
        "own_loop_samples_per_s": figures["own loop"],
        "lightning_samples_per_s": figures["lightning"],
        "plan_changes": changes,
        "ratio": lit / own,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = run(args.iterations, args.rounds)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(
        f"4 emulated workers, per-sample ms {out['per_sample_ms']} (+{INTERCEPT_MS:g} ms), "
        f"global batch {GLOBAL_BATCH}, {out['iterations']} iterations, minmax; ideal "
        f"{out['ideal_samples_per_s']:.0f} samples/s"
    )
    for key, label in (("own_loop", "Evenflow's own loop"), ("lightning", "Lightning")):
        values = out[f"{key}_samples_per_s"]
        print(f"  {label:<20} {statistics.median(values):7.0f} samples/s  {values}")
    print(f"  Lightning / own loop: {out['ratio']:.3f} (target >= 0.9)")


if __name__ == "__main__":
    main()
