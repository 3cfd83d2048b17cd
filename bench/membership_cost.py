"""What partial all-reduce costs: regrouping and re-synchronising (CPU, gloo).

    PYTHONPATH=. python bench/membership_cost.py [--world 3] [--cycles 6]

On ``world`` spawned ranks (one torch thread each), ``EvenflowContext`` trains an MLP while a
scripted leader excludes the last rank and readmits it, ``cycles`` times, three iterations apart
(momentum SGD, so the optimizer state is one tensor per parameter). Per model size it reports,
in milliseconds (medians over cycles unless said otherwise):

- ``create_group_ms``: the first exclusion, on an active rank: making the subgroup (gloo
  connects its members through the store). Once per distinct set of active ranks per job.
- ``switch_group_ms``: later exclusions, on an active rank: the group is reused.
- ``notify_ms``: at a readmission, on the root: writing the join notice and switching back to
  the world group (before the re-synchronisation).
- ``resync_ms``: at a readmission, on the readmitted rank, which arrives last, so this is the
  transfer itself: the skeleton object plus parameters, buffers and momentum.
- ``join_wait_ms``: the same boundary on the root: the transfer plus the wait for the excluded
  rank to see its notice (poll interval, or the end of a probe under way).

These are the figures behind the server's cost model ``regroup_ms`` and ``resync_ms``. Prints one
JSON object; numbers from a shared 2-core machine are noisy, read them as a bound.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from agent.runtime.context import EvenflowContext
from agent.runtime.membership import ExclusionOptions
from agent.runtime.plan_sync import PlanAgreement, RuntimePlan
from contract.spec import JobSpec

B, FEATURES = 48, 64
SIZES = {"small": (64, 1), "medium": (512, 2), "large": (1024, 4)}
"""name: (hidden width, hidden layers)."""


def _model(hidden: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    parts: list[nn.Module] = [nn.Linear(FEATURES, hidden), nn.ReLU()]
    for _ in range(layers - 1):
        parts += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*parts, nn.Linear(hidden, 1))


class Script:
    """Exclude the last rank at 2, readmit at 5, exclude at 8, ... (three iterations apart)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.ctx: EvenflowContext | None = None

    def __call__(self) -> RuntimePlan:
        assert self.ctx is not None
        k = (self.ctx.iteration - 1) // 3 + 1  # the k-th change, proposed at 3k - 2
        even = [B // self.world] * self.world
        if k % 2 == 0:
            return RuntimePlan(1 + k, tuple(even), B)
        active = B // (self.world - 1)
        return RuntimePlan(1 + k, (*[active] * (self.world - 1), 0), B, (self.world - 1,))


def _run(rank: int, world: int, cycles: int, hidden: int, layers: int) -> dict[str, Any]:
    iterations = 6 * cycles + 2
    spec = JobSpec.model_validate(
        {
            "name": "membership-cost",
            "workload": {"builtin": "mlp"},
            "global_batch": B,
            "iterations": iterations,
            "workers": world,
        }
    )
    script = Script(world)
    agreement = PlanAgreement(
        RuntimePlan(1, tuple([B // world] * world), B),
        rank=rank,
        world_size=world,
        global_batch=B,
        propose=script,
    )
    ctx = EvenflowContext(
        spec, agreement, rank=rank, world_size=world, exclusion=ExclusionOptions(probe_every=1)
    )
    script.ctx = ctx
    model = _model(hidden, layers)
    model, _ = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    g = torch.Generator().manual_seed(1)
    data = (torch.randn(4 * B, FEATURES, generator=g), torch.randn(4 * B, 1, generator=g))
    for x, y in ctx.batches(data):
        ctx.step(nn.functional.mse_loss(model(x), y, reduction="sum"))
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "regroup_ms": ctx.membership.regroup_ms,
        "resync_ms": ctx.stats.resync_ms,
    }


def _rank(rank: int, world: int, port: int, cycles: int, out: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        out.put((rank, {n: _run(rank, world, cycles, *s) for n, s in SIZES.items()}))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--cycles", type=int, default=6)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, args.world + 1, is_master=True, wait_for_workers=False)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, args.world, store.port, args.cycles, out))
        for r in range(args.world)
    ]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    last = args.world - 1
    report: dict[str, Any] = {"world": args.world, "cycles": args.cycles, "backend": "gloo"}
    for name in SIZES:
        root, back = results[0][name], results[last][name]
        # root: [exclude (create), readmit, exclude (reuse), readmit, ...]
        excludes, readmits = root["regroup_ms"][0::2], root["regroup_ms"][1::2]
        report[name] = {
            "params": root["params"],
            "create_group_ms": round(excludes[0], 3),
            "switch_group_ms": round(statistics.median(excludes[1:]), 3),
            "notify_ms": round(statistics.median(readmits), 3),
            "resync_ms": round(statistics.median(back["resync_ms"]), 3),
            "join_wait_ms": round(statistics.median(root["resync_ms"]), 3),
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
