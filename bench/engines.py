"""The two ways a ``ddp`` job sums gradients, side by side (CPU, gloo).

    PYTHONPATH=. python bench/engines.py [--world 2] [--iterations 40] [--rounds 3]

On ``world`` spawned ranks (one torch thread each), the runtime's whole loop
(``EvenflowContext``: plan agreement, exact weighting, timing) trains the same model on the same
unequal shares with ``gradient_sync=coalesced`` (one all-reduce after backward) and
``gradient_sync=overlap`` (PyTorch's DistributedDataParallel with the exact weighting hook:
bucketed all-reduces during backward). Rounds alternate between the two so drift in the
machine's load hits both; medians of the per-round mean iteration times are compared. Two
models: the demo's (``mlp``: 32 features, 64 hidden, global batch 256) and a 25M-parameter
stack of linear layers (global batch 32).

It also checks exactness: each way's final parameters against a single process replaying the
same global batches (max relative difference).

Then memory: a 12-block model (4.2M parameters) trained a few iterations with AdamW under
``engine: ddp`` and ``engine: fsdp`` on 2 and 4 ranks; on each rank, the bytes of the
parameters, gradients and optimizer state it holds (local shards under fsdp), and fsdp's share of
ddp's (the target: at most 1/world + 10%).

Prints one JSON object. On a shared 2-core machine absolute times move from day to day; read the
ratios, which are measured in one run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from agent.runtime.context import EvenflowContext
from agent.runtime.plan_sync import PlanAgreement, RuntimePlan
from agent.runtime.sampler import GlobalBatchSampler
from contract.spec import JobSpec

MODELS: dict[str, dict[str, int]] = {
    "demo_mlp": {"features": 32, "hidden": 64, "layers": 1, "batch": 256, "samples": 4096},
    "linear_25m": {"features": 2240, "hidden": 2240, "layers": 5, "batch": 32, "samples": 512},
}
SYNCS = ("coalesced", "overlap")


def _model(name: str) -> nn.Module:
    m = MODELS[name]
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(m["features"], m["hidden"]), nn.Tanh()]
    for _ in range(m["layers"] - 1):
        layers += [nn.Linear(m["hidden"], m["hidden"]), nn.Tanh()]
    layers.append(nn.Linear(m["hidden"], 1))
    return nn.Sequential(*layers)


def _data(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    m = MODELS[name]
    g = torch.Generator().manual_seed(1)
    return torch.randn(m["samples"], m["features"], generator=g), torch.randn(
        m["samples"], 1, generator=g
    )


def _shares(batch: int, world: int) -> tuple[int, ...]:
    """Unequal shares summing to the batch: rank r gets weight r + 1."""
    weights = list(range(1, world + 1))
    shares = [batch * w // sum(weights) for w in weights]
    shares[-1] += batch - sum(shares)
    return tuple(shares)


def _round(rank: int, world: int, name: str, sync: str, iterations: int) -> tuple[float, Any]:
    m = MODELS[name]
    spec = JobSpec.model_validate(
        {
            "name": "bench",
            "workload": {"builtin": "mlp", "learning_rate": 0.01, "seed": 3},
            "global_batch": m["batch"],
            "iterations": iterations,
            "workers": world,
        }
    )
    plan = RuntimePlan(1, _shares(m["batch"], world))
    agreement = PlanAgreement(plan, rank=rank, world_size=world, global_batch=m["batch"])
    ctx = EvenflowContext(spec, agreement, rank=rank, world_size=world, gradient_sync=sync)
    model, _ = ctx.prepare(_model(name))
    data = _data(name)
    dist.barrier()
    t0 = time.perf_counter()
    for xb, yb in ctx.batches(data):
        ctx.step(nn.functional.mse_loss(model(xb), yb, reduction="sum"))
    dist.barrier()
    elapsed = (time.perf_counter() - t0) / iterations * 1000
    params = torch.cat([p.detach().flatten() for p in ctx.model.parameters()])  # type: ignore[union-attr]
    return elapsed, params


def _replay(name: str, iterations: int) -> torch.Tensor:
    """One process, the same global batches, mean loss: what every rank must end with."""
    m = MODELS[name]
    model = _model(name)
    x, y = _data(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler = GlobalBatchSampler(m["samples"], m["batch"], seed=3)
    for it in range(iterations):
        epoch, k = sampler.position(it)
        idx = sampler.permutation(epoch)[k * m["batch"] : k * m["batch"] + m["batch"]]
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x[idx]), y[idx])
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _rank(rank: int, world: int, port: int, iterations: int, rounds: int, out: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    result: dict[str, Any] = {}
    for name in MODELS:
        for sync in SYNCS:  # warm-up
            _round(rank, world, name, sync, 5)
        times: dict[str, list[float]] = {s: [] for s in SYNCS}
        finals: dict[str, torch.Tensor] = {}
        for _ in range(rounds):
            for sync in SYNCS:
                ms, finals[sync] = _round(rank, world, name, sync, iterations)
                times[sync].append(ms)
        result[name] = {"times": times, "finals": {s: p.tolist() for s, p in finals.items()}}
    dist.destroy_process_group()
    out.put((rank, result))


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ff = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.ff(x))


class _Layered(nn.Module):
    def __init__(self, width: int = 592, depth: int = 12) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(_Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        out: torch.Tensor = self.head(x)
        return out


def _held_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the parameters, gradients and optimizer state this rank holds."""

    def local(t: torch.Tensor) -> torch.Tensor:
        to_local = getattr(t, "to_local", None)
        return t if to_local is None else cast(torch.Tensor, to_local())

    def size(t: torch.Tensor) -> int:
        return local(t).numel() * t.element_size()

    params = list(model.parameters())
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {
        "parameters": sum(size(p) for p in params),
        "gradients": sum(size(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(size(t) for t in state if t.dim() > 0),
    }


def _memory_rank(rank: int, world: int, port: int, out: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    held = {}
    for engine in ("ddp", "fsdp"):
        spec = JobSpec.model_validate(
            {
                "name": "memory",
                "workload": {"entrypoint": "bench:memory", "seed": 3},
                "global_batch": 8 * world,
                "iterations": 3,
                "workers": world,
                "engine": engine,
            }
        )
        plan = RuntimePlan(1, _shares(8 * world, world))
        agreement = PlanAgreement(plan, rank=rank, world_size=world, global_batch=8 * world)
        ctx = EvenflowContext(spec, agreement, rank=rank, world_size=world)
        layered = _Layered()
        opt = torch.optim.AdamW(layered.parameters(), lr=1e-3)
        model, _ = ctx.prepare(layered, opt)
        g = torch.Generator().manual_seed(1)
        data = (torch.randn(64 * world, 592, generator=g), torch.randn(64 * world, 1, generator=g))
        for xb, yb in ctx.batches(data):
            ctx.backward(nn.functional.mse_loss(model(xb), yb, reduction="sum"))
            if ctx.sync_gradients:
                opt.step()  # gradients kept (not zeroed) so they are counted
        held[engine] = _held_bytes(model, opt)
    dist.destroy_process_group()
    out.put((rank, held))


def _memory(world: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_memory_rank, args=(r, world, store.port, out)) for r in range(world)
    ]
    for p in procs:
        p.start()
    held = dict(out.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    worst = max(sum(h["fsdp"].values()) / sum(h["ddp"].values()) for h in held.values())
    return {
        "bytes_per_rank": {r: h for r, h in sorted(held.items())},
        "fsdp_over_ddp_worst_rank": round(worst, 4),
        "target": round(1 / world * 1.1, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
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
    results = dict(out.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    report: dict[str, Any] = {"world": args.world, "iterations_per_round": args.iterations}
    for name in MODELS:
        r0 = results[0][name]
        medians = {s: statistics.median(r0["times"][s]) for s in SYNCS}
        reference = _replay(name, args.iterations)
        exact = {}
        for s in SYNCS:
            worst = 0.0
            for r in range(args.world):
                final = torch.tensor(results[r][name]["finals"][s], dtype=reference.dtype)
                worst = max(worst, ((final - reference).abs().max() / reference.abs().max()).item())
            exact[s] = worst
        report[name] = {
            "parameters": sum(p.numel() for p in _model(name).parameters()),
            "ms_per_iteration_rounds": {s: [round(v, 2) for v in r0["times"][s]] for s in SYNCS},
            "median_ms": {s: round(v, 2) for s, v in medians.items()},
            "overlap_over_coalesced": round(medians["overlap"] / medians["coalesced"], 3),
            "max_rel_diff_vs_single_process": {s: float(f"{v:.2e}") for s, v in exact.items()},
        }
    report["memory"] = {f"world_{w}": _memory(w) for w in (2, 4)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
