"""The user's data pipeline under Evenflow, measured side by side in one run.

    PYTHONPATH=. python bench/dataloading.py [--rounds 3] [--iterations 60] [--json]

1. A data-bound job: two gloo ranks whose compute is emulated (``per_sample_ms``), reading a
   dataset whose every sample waits ``--load-ms`` as a read from network storage does. Samples/s
   of the same job when loading costs nothing, when it costs ``--load-ms`` with the DataLoader's
   ``num_workers=4``, and with the serial path (``num_workers=0``); rounds alternate the
   variants. Targets: workers >= 0.9x free, >= 1.6x serial. A fourth variant changes the plan
   every ``--change-every`` iterations and reports the data wait at the iterations loaded ahead
   under the old plan, against the time to read only the samples that moved.
2. The JPEG pipeline (decode, random crop and flip in two workers; ``examples.image``) on one
   rank: Evenflow against the plain ``DataLoader(num_workers=2)`` loop of the same model.
   Target: at least 0.95x.
3. Exactness: two ranks with unequal shares and a plan change, a padding collate, a per-token
   loss, clipping after ``sync_gradients``, OneCycle and AdamW (``examples.text``), against one
   process on the same global batches. Target: 1e-5 relative.

Prints what it measured; ``--json`` prints one JSON object instead. Numbers from a shared 2-core
machine are noisy: the ratios, measured in the same rounds, are what to read.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from agent.runtime.context import EvenflowContext
from agent.runtime.plan_sync import PlanAgreement, RuntimePlan
from agent.runtime.sampler import GlobalBatchSampler
from contract.agent import TelemetryRecord
from contract.spec import JobSpec

FEATURES, B, WARMUP = 64, 64, 8


class SlowStorage(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Samples whose every read waits ``load_ms`` (a read from network storage)."""

    def __init__(self, n: int, load_ms: float) -> None:
        self.n, self.load_ms = n, load_ms

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.load_ms:
            time.sleep(self.load_ms / 1000)
        return torch.full((FEATURES,), float(i % 7)), torch.tensor([float(i % 3)])


class Alternate:
    """The leader's proposer: every ``every`` iterations, the other of two plans."""

    def __init__(self, every: int | None) -> None:
        self.every = every
        self.ctx: EvenflowContext | None = None

    def __call__(self) -> RuntimePlan | None:
        if self.every is None or self.ctx is None:
            return None
        k = self.ctx.iteration // self.every
        return RuntimePlan(1 + k, (32, 32) if k % 2 == 0 else (28, 36), B)


def _spec(world: int, iterations: int, per_sample_ms: float) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "dataloading",
            "workload": {"entrypoint": "bench.dataloading:none"},
            "global_batch": B,
            "iterations": iterations,
            "workers": world,
            "emulation": [{"per_sample_ms": per_sample_ms, "intercept_ms": 2.0}] * world,
        }
    )


def _data_bound_round(
    rank: int,
    world: int,
    *,
    iterations: int,
    load_ms: float,
    workers: int,
    per_sample_ms: float,
    change_every: int | None = None,
) -> dict[str, Any]:
    from agent.runtime.emulation import Emulator

    spec = _spec(world, iterations, per_sample_ms)
    proposer = Alternate(change_every)
    agreement = PlanAgreement(
        RuntimePlan(1, (32, 32), B), rank=rank, world_size=world, global_batch=B, propose=proposer
    )
    records: list[TelemetryRecord] = []
    assert spec.emulation is not None
    ctx = EvenflowContext(
        spec,
        agreement,
        rank=rank,
        world_size=world,
        emulator=Emulator(spec.emulation[rank]),
        submit=records.append,
    )
    proposer.ctx = ctx
    torch.manual_seed(0)
    model, _ = ctx.prepare(nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 1)))
    loader = DataLoader(
        SlowStorage(20_000, load_ms), num_workers=workers, prefetch_factor=2 if workers else None
    )
    stamps = []
    for x, y in ctx.batches(loader):
        stamps.append(time.perf_counter())
        ctx.step(nn.functional.mse_loss(model(x), y, reduction="sum"))
    seconds = stamps[-1] - stamps[WARMUP]
    data = [r.data_ms for r in records if r.iteration >= WARMUP]
    switches = {v: i for i, v in agreement.history[1:]}
    after = sorted({i + k for i in switches.values() for k in range(8)})
    return {
        "samples_per_s": B * (len(stamps) - 1 - WARMUP) / seconds,
        "data_ms_median": statistics.median(data),
        "data_ms_after_changes": [r.data_ms for r in records if r.iteration in after],
        "changes": len(switches),
    }


def _data_bound_rank(rank: int, world: int, port: int, a: Any, out: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    variants = {
        "free": {"load_ms": 0.0, "workers": 4},
        "workers": {"load_ms": a.load_ms, "workers": 4},
        "serial": {"load_ms": a.load_ms, "workers": 0},
        "workers_changing_plans": {
            "load_ms": a.load_ms,
            "workers": 4,
            "change_every": a.change_every,
        },
    }
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in variants}
    for _ in range(a.rounds):
        for name, kwargs in variants.items():
            results[name].append(
                _data_bound_round(
                    rank,
                    world,
                    iterations=a.iterations,
                    per_sample_ms=a.per_sample_ms,
                    **kwargs,
                )
            )
    dist.destroy_process_group()
    out.put((rank, results))


def data_bound(a: Any) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_data_bound_rank, args=(r, 2, store.port, a, out)) for r in range(2)
    ]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    r0 = results[0]
    rate = {k: statistics.median(x["samples_per_s"] for x in v) for k, v in r0.items()}
    after = [ms for x in r0["workers_changing_plans"] for ms in x["data_ms_after_changes"]]
    return {
        "load_ms_per_sample": a.load_ms,
        "compute_per_sample_ms": a.per_sample_ms,
        "samples_per_s": {k: round(v, 1) for k, v in rate.items()},
        "rounds": {k: [round(x["samples_per_s"], 1) for x in v] for k, v in r0.items()},
        "workers_vs_free": round(rate["workers"] / rate["free"], 3),
        "workers_vs_serial": round(rate["workers"] / rate["serial"], 3),
        "changing_plans_vs_workers": round(rate["workers_changing_plans"] / rate["workers"], 3),
        "data_ms_median_workers": round(
            statistics.median(x["data_ms_median"] for x in r0["workers"]), 2
        ),
        "data_ms_after_plan_changes_max": round(max(after), 2) if after else None,
        "data_ms_after_plan_changes_median": round(statistics.median(after), 2) if after else None,
        "moved_samples_read_ms": 4 * a.load_ms,  # (32, 32) <-> (28, 36): 4 samples move
        "plan_changes_per_round": r0["workers_changing_plans"][0]["changes"],
    }


# ------------------------------------------------------------------------------------- JPEG


def _jpeg_round(evenflow: bool, iterations: int, data_dir: str) -> float:
    from examples import image

    args = {"data_dir": data_dir, "images": 4096, "batch": 128, "workers": 2}
    train_set, _ = image.datasets(args)
    model, opt, _, _ = image.build(args, iterations)
    loader = image.loader_of(train_set, args)
    stamps = []
    if evenflow:
        spec = JobSpec.model_validate(
            {
                "name": "jpeg",
                "workload": {"entrypoint": "examples.image:train"},
                "global_batch": 128,
                "iterations": iterations,
                "workers": 1,
            }
        )
        agreement = PlanAgreement(RuntimePlan(1, (128,)), rank=0, world_size=1, global_batch=128)
        ctx = EvenflowContext(spec, agreement, rank=0, world_size=1)
        model, opt = ctx.prepare(model, opt)
        for x, y in ctx.batches(loader):
            stamps.append(time.perf_counter())
            ctx.backward(nn.functional.cross_entropy(model(x), y, reduction="sum"))
            if ctx.sync_gradients:
                opt.step()
                opt.zero_grad()
    else:
        while len(stamps) < iterations:
            for x, y in loader:
                stamps.append(time.perf_counter())
                loss = nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                if len(stamps) == iterations:
                    break
        del loader  # its persistent workers end
    return 128 * (len(stamps) - 1 - WARMUP) / (stamps[-1] - stamps[WARMUP])


def jpeg(a: Any) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        plain, ours = [], []
        for _ in range(a.rounds):
            plain.append(_jpeg_round(False, a.jpeg_iterations, d))
            ours.append(_jpeg_round(True, a.jpeg_iterations, d))
    return {
        "plain_samples_per_s": [round(v, 1) for v in plain],
        "evenflow_samples_per_s": [round(v, 1) for v in ours],
        "evenflow_vs_plain": round(statistics.median(ours) / statistics.median(plain), 3),
    }


# ------------------------------------------------------------------------------- exactness

EXACT_ITERATIONS = 16
EXACT_SCRIPT = [
    (3, RuntimePlan(2, (22, 10), 32)),
    (7, RuntimePlan(3, (9, 23), 32, memory_caps=(0, 6))),
]
TEXT_ARGS = {"sequences": 300, "dropout": 0.0, "workers": 2, "seed": 2}


class _Script:
    def __init__(self) -> None:
        self.ctx: EvenflowContext | None = None

    def __call__(self) -> RuntimePlan | None:
        assert self.ctx is not None
        due = [p for at, p in EXACT_SCRIPT if self.ctx.iteration >= at]
        return due[-1] if due else None


def _exact_rank(rank: int, world: int, port: int, out: Any) -> None:
    from examples import text

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    spec = JobSpec.model_validate(
        {
            "name": "exact",
            "workload": {"entrypoint": "examples.text:train", "seed": 7},
            "global_batch": 32,
            "iterations": EXACT_ITERATIONS,
            "workers": world,
        }
    )
    script = _Script()
    agreement = PlanAgreement(
        RuntimePlan(1, (16, 16), 32), rank=rank, world_size=world, global_batch=32, propose=script
    )
    ctx = EvenflowContext(spec, agreement, rank=rank, world_size=world)
    script.ctx = ctx
    loader = DataLoader(text.dataset(TEXT_ARGS), collate_fn=text.pad_collate, num_workers=2)
    model, opt, sched = text.build(TEXT_ARGS, EXACT_ITERATIONS)
    model, opt = ctx.prepare(model, opt)
    for batch in ctx.batches(loader):
        loss, tokens = text.token_loss(model, batch)
        ctx.backward(loss, count=tokens)
        if ctx.sync_gradients:
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
    dist.destroy_process_group()
    out.put((rank, [p.detach().tolist() for p in model.parameters()], agreement.history))


def exactness() -> dict[str, Any]:
    from examples import text

    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    out = ctx.Queue()
    procs = [ctx.Process(target=_exact_rank, args=(r, 2, store.port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = {r: (params, history) for r, params, history in (out.get(timeout=600) for _ in procs)}
    for p in procs:
        p.join()
    data = text.dataset(TEXT_ARGS)
    model, opt, sched = text.build(TEXT_ARGS, EXACT_ITERATIONS)
    sampler = GlobalBatchSampler(len(data), 32, seed=7)
    for it in range(EXACT_ITERATIONS):
        epoch, k = sampler.position(it)
        idx = sampler.permutation(epoch)[k * 32 : k * 32 + sampler.global_count(it)]
        loss, tokens = text.token_loss(model, text.pad_collate([data[int(i)] for i in idx]))
        (loss / tokens).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    worst = 0.0
    for p, q in zip(results[0][0], model.parameters(), strict=True):
        a, b = torch.tensor(p), q.detach()
        worst = max(worst, ((a - b).abs() / b.abs().clamp(min=1e-3)).max().item())
    return {
        "plans": results[0][1],
        "max_relative_difference": worst,
        "ranks_identical": results[0][0] == results[1][0],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--jpeg-iterations", type=int, default=40)
    p.add_argument("--load-ms", type=float, default=3.0)
    p.add_argument("--per-sample-ms", type=float, default=1.0)
    p.add_argument("--change-every", type=int, default=20)
    p.add_argument("--json", action="store_true")
    p.add_argument("--only", choices=["data-bound", "jpeg", "exactness"])
    a = p.parse_args()
    report: dict[str, Any] = {}
    if a.only in (None, "data-bound"):
        report["data_bound"] = data_bound(a)
    if a.only in (None, "jpeg"):
        report["jpeg"] = jpeg(a)
    if a.only in (None, "exactness"):
        report["exactness"] = exactness()
    print(json.dumps(report, indent=None if a.json else 2))


if __name__ == "__main__":
    main()
