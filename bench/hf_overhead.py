"""Issue 57's overhead target: the Hugging Face Trainer through Evenflow against Evenflow's own loop.

    python -m bench.hf_overhead [--iterations 60] [--json]      (from the repository root)

The same model (``examples/hf_causal_lm.py``'s Llama, built from a config), data, optimizer
settings and spec run twice on the local stack's 4 emulated workers at speeds 4:4:2:1
(per-sample 1:1:2:4 ms times ``--scale``, 5 ms intercept, global batch 256, ``minmax`` with
``policy.exclude: false``): once through Evenflow's own loop (``ctx.batches`` /
``ctx.backward``, written here) and once through ``EvenflowTrainer``. Steady-state samples/s
(the second half of the iterations, from the workers' telemetry) of each, and their ratio.
Target: the Trainer >= 0.9 of the own loop.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from contract.spec import JobSpec
from evenflow.experiment import measure
from evenflow.local_cluster import LocalCluster
from examples import hf_causal_lm

PER_SAMPLE_MS = (1.0, 1.0, 2.0, 4.0)  # speeds 4:4:2:1, times --scale
GLOBAL_BATCH = 256


def own_loop(ctx: Any) -> None:
    """The same training written against the context directly (the baseline)."""
    args = ctx.args
    model = hf_causal_lm.model_of(args)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    model, opt = ctx.prepare(model, opt)
    loader = DataLoader(
        hf_causal_lm.dataset(args), batch_size=64, shuffle=True, collate_fn=hf_causal_lm.collate
    )
    for batch in ctx.batches(loader):
        tokens = batch["labels"][:, 1:].ne(-100).sum()
        loss = model(**batch, num_items_in_batch=torch.ones(())).loss  # the sum
        ctx.backward(loss, count=tokens)
        if ctx.sync_gradients:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()


def spec(entrypoint: str, iterations: int, out: str, scale: float) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": entrypoint.split(":")[-1],
            "workload": {
                "entrypoint": entrypoint,
                "args": {
                    "sequences": 4096,
                    "logging_steps": 10,
                    "save_steps": 100_000,
                    "hf_dir": out,
                },
            },
            "global_batch": GLOBAL_BATCH,
            "iterations": iterations,
            "workers": len(PER_SAMPLE_MS),
            "emulation": [
                {"per_sample_ms": scale * ms, "intercept_ms": 5.0} for ms in PER_SAMPLE_MS
            ],
            "policy": {"name": "minmax", "exclude": False},
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--scale",
        type=float,
        default=4.0,
        help="multiplies the per-sample times: the emulated compute must stay above the real "
        "one (4 ranks share this machine's cores)",
    )
    a = parser.parse_args()
    out: dict[str, Any] = {
        "per_sample_ms": [a.scale * ms for ms in PER_SAMPLE_MS],
        "global_batch": GLOBAL_BATCH,
    }
    with tempfile.TemporaryDirectory() as d, LocalCluster(Path(d), workers=4, agents=2) as c:
        for name, entrypoint in (
            ("own_loop", "bench.hf_overhead:own_loop"),
            ("trainer", "examples.hf_causal_lm:train"),
        ):
            job = c.submit(spec(entrypoint, a.iterations, f"{d}/hf-{name}", a.scale))
            done = c.wait(job.id, timeout_s=600)
            if done.status.value != "succeeded":
                raise SystemExit(f"{name}: {done.status.value}: {done.error}")
            rows = c.client.telemetry(job.id, limit=None).items
            r = measure(rows)
            out[name] = {
                "samples_per_s": r.samples_per_s,
                "iterations": r.iterations,
                "plan_changes": r.plan_changes,
            }
    out["ratio"] = out["trainer"]["samples_per_s"] / out["own_loop"]["samples_per_s"]
    if a.json:
        print(json.dumps(out, indent=2))
        return
    for name in ("own_loop", "trainer"):
        print(f"{name:<9} {out[name]['samples_per_s']:8.0f} samples/s")
    print(f"ratio     {out['ratio']:8.3f}  (target >= 0.9)")


if __name__ == "__main__":
    main()
