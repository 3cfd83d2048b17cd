"""Per-iteration overhead of the Evenflow runtime against a plain DDP loop (CPU, gloo).

    PYTHONPATH=. python bench/runtime_overhead.py [--world 2] [--iterations 300]

Two measurements, on ``world`` spawned ranks with one torch thread each:

1. The plan agreement alone: host time spent in ``PlanAgreement.at_boundary`` per iteration,
   for each transport (channel, pipelined broadcast, blocking broadcast), with a fixed 2 ms
   sleep standing in for compute.
2. A whole training loop on the same model and the same fixed, equal batch sizes: plain
   ``DistributedDataParallel`` with a mean loss, against ``EvenflowContext`` (plan agreement,
   exact-gradient all-reduce, timing, telemetry to a no-op poster), once with the agreement
   riding in the gradient all-reduce (the default on CPU) and once as a pipelined broadcast.
   Rounds alternate between the loops so drift in machine load hits all; the medians of
   per-round mean iteration time are compared.

Prints one JSON object. Numbers from a shared 2-core machine are noisy; read them as a bound.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from datetime import timedelta
from typing import Any, TypedDict

import torch
import torch.distributed as dist
from torch import nn

from agent.runtime.context import EvenflowContext
from agent.runtime.gradients import GradientSync
from agent.runtime.plan_sync import PlanAgreement, RuntimePlan
from agent.runtime.telemetry import TelemetrySender
from contract.spec import JobSpec

FEATURES, HIDDEN, PER_RANK = 256, 512, 64


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, 1),
    )


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, FEATURES, generator=g), torch.randn(n, 1, generator=g)


class _Mode(TypedDict, total=False):
    """PlanAgreement's keyword arguments that each agreement mode sets."""

    pipelined: bool
    every: int


def _agreement_cost(rank: int, world: int, iterations: int) -> dict[str, float]:
    out = {}
    modes: dict[str, _Mode] = {
        "channel": {},
        "pipelined": {"pipelined": True},
        "blocking": {"pipelined": False},
        "blocking_every_10": {"pipelined": False, "every": 10},
    }
    for name, kwargs in modes.items():
        a = PlanAgreement(
            RuntimePlan(1, (PER_RANK,) * world),
            rank=rank,
            world_size=world,
            global_batch=PER_RANK * world,
            **kwargs,
        )
        sync = GradientSync(_model().parameters(), control_slots=a.message_length)
        if name == "channel":
            a.use_channel(sync)
        spent = 0.0
        for it in range(iterations):
            t0 = time.perf_counter()
            a.at_boundary(it)
            spent += time.perf_counter() - t0
            time.sleep(0.002)
            if name == "channel":
                sync.all_reduce(1)  # the iteration's own all-reduce, which carries the message
        a.close()
        dist.barrier()
        out[name] = spent / iterations * 1e6
    return out


def _ddp_round(rank: int, world: int, iterations: int) -> float:
    x, y = _data(PER_RANK * world * iterations)
    model = nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dist.barrier()
    t0 = time.perf_counter()
    for it in range(iterations):
        start = (it * world + rank) * PER_RANK
        xb, yb = x[start : start + PER_RANK], y[start : start + PER_RANK]
        opt.zero_grad()
        nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
    dist.barrier()
    return (time.perf_counter() - t0) / iterations * 1000


def _evenflow_round(rank: int, world: int, iterations: int, piggyback: bool = True) -> float:
    spec = JobSpec.model_validate(
        {
            "name": "bench",
            "workload": {"builtin": "mlp", "learning_rate": 0.01},
            "global_batch": PER_RANK * world,
            "iterations": iterations,
            "workers": world,
        }
    )
    agreement = PlanAgreement(
        RuntimePlan(1, (PER_RANK,) * world),
        rank=rank,
        world_size=world,
        global_batch=PER_RANK * world,
    )
    sender = TelemetrySender(lambda batch: None)
    ctx = EvenflowContext(
        spec, agreement, rank=rank, world_size=world, submit=sender.submit, piggyback=piggyback
    )
    model, _ = ctx.prepare(_model())
    data = _data(PER_RANK * world * iterations)
    dist.barrier()
    t0 = time.perf_counter()
    for xb, yb in ctx.batches(data):
        ctx.step(nn.functional.mse_loss(model(xb), yb, reduction="sum"))
    dist.barrier()
    elapsed = (time.perf_counter() - t0) / iterations * 1000
    sender.close(1.0)
    return elapsed


def _rank(rank: int, world: int, port: int, iterations: int, rounds: int, out: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    result: dict[str, Any] = {"agreement_us": _agreement_cost(rank, world, iterations)}
    _ddp_round(rank, world, 20)  # warm-up both paths (dynamo import, allocator)
    _evenflow_round(rank, world, 20)
    ddp, evenflow, broadcast = [], [], []
    for _ in range(rounds):
        ddp.append(_ddp_round(rank, world, iterations))
        evenflow.append(_evenflow_round(rank, world, iterations))
        broadcast.append(_evenflow_round(rank, world, iterations, piggyback=False))
    result.update(ddp_ms=ddp, evenflow_ms=evenflow, broadcast_ms=broadcast)
    dist.destroy_process_group()
    out.put((rank, result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, args.world + 1, is_master=True, wait_for_workers=False)
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank, args=(r, args.world, store.port, args.iterations, args.rounds, out)
        )
        for r in range(args.world)
    ]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=900) for _ in procs)
    for p in procs:
        p.join()
    r0 = results[0]
    ddp = statistics.median(r0["ddp_ms"])
    evenflow = statistics.median(r0["evenflow_ms"])
    broadcast = statistics.median(r0["broadcast_ms"])
    print(
        json.dumps(
            {
                "world": args.world,
                "iterations_per_round": args.iterations,
                "agreement_us_per_iteration": {
                    k: round(v, 1) for k, v in r0["agreement_us"].items()
                },
                "ddp_ms_per_iteration_rounds": [round(v, 3) for v in r0["ddp_ms"]],
                "evenflow_ms_per_iteration_rounds": [round(v, 3) for v in r0["evenflow_ms"]],
                "evenflow_broadcast_ms_per_iteration_rounds": [
                    round(v, 3) for v in r0["broadcast_ms"]
                ],
                "ddp_ms_median": round(ddp, 3),
                "evenflow_ms_median": round(evenflow, 3),
                "evenflow_broadcast_ms_median": round(broadcast, 3),
                "overhead_pct": round((evenflow / ddp - 1) * 100, 2),
                "overhead_broadcast_pct": round((broadcast / ddp - 1) * 100, 2),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
