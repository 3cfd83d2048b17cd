"""A user's training code, as the runtime's entrypoint API expects it (used by the tests).

``make`` hands the runtime a Workload; ``train`` keeps its own loop (three calls changed).
"""

from __future__ import annotations

import torch
from torch import nn

from agent.runtime.context import EvenflowContext
from agent.runtime.workloads import Workload

BODY_RUNS: list[int] = []
"""Iterations whose loop body ran in this process (``train`` only)."""
BATCH_ROWS: list[int] = []
"""Rows of each batch the body got (``train`` only)."""


def _data(seed: int, n: int = 600) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])


def make(ctx: EvenflowContext) -> Workload:
    torch.manual_seed(ctx.seed)
    return Workload(
        nn.Linear(4, 1),
        _data(ctx.seed),
        lambda out, y: nn.functional.mse_loss(out, y, reduction="sum"),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.5),
    )


def train(ctx: EvenflowContext) -> None:
    torch.manual_seed(ctx.seed)
    model = nn.Linear(4, 1)
    x_all, y_all = _data(ctx.seed, n=int(ctx.args.get("samples", 600)))
    model, _ = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    for x, y in ctx.batches((x_all, y_all)):
        BODY_RUNS.append(ctx.iteration)
        BATCH_ROWS.append(x.shape[0])
        loss = nn.functional.mse_loss(model(x), y, reduction="sum")
        ctx.step(loss)


def not_a_workload(ctx: EvenflowContext) -> int:
    return 42


def does_nothing(ctx: EvenflowContext) -> None:
    return None


def train_logged(ctx: EvenflowContext) -> None:
    """``train`` reporting metrics: the learning rate once before the loop (iteration 0), and
    each iteration the samples this rank trained on."""
    torch.manual_seed(ctx.seed)
    model = nn.Linear(4, 1)
    x_all, y_all = _data(ctx.seed, n=int(ctx.args.get("samples", 600)))
    model, _ = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    ctx.log("lr", 0.05)
    for x, y in ctx.batches((x_all, y_all)):
        ctx.step(nn.functional.mse_loss(model(x), y, reduction="sum"))
        ctx.log("local_batch", torch.tensor(float(x.shape[0])))


class _Pairs(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def train_loader(ctx: EvenflowContext) -> None:
    """A loop as ported from a DDP script: a DataLoader with workers, AdamW with a schedule
    registered, clipping and stepping on synchronised gradients, the final model saved."""
    torch.manual_seed(ctx.seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x_all, y_all = _data(ctx.seed, n=int(ctx.args.get("samples", 600)))
    loader = torch.utils.data.DataLoader(_Pairs(x_all, y_all), batch_size=16, num_workers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    steps = int(ctx.args.get("steps", 0)) or ctx.total_iterations(loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=steps)
    ctx.register_state("sched", sched)
    model, opt = ctx.prepare(model, opt)
    for x, y in ctx.batches(loader):
        ctx.backward(nn.functional.mse_loss(model(x), y, reduction="sum"))
        if ctx.sync_gradients:
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
    ctx.save_final()


def train_until_good_enough(ctx: EvenflowContext) -> None:
    """``train``, ended early from one rank once its own loss is small (an early stop)."""
    torch.manual_seed(ctx.seed)
    model = nn.Linear(4, 1)
    x_all, y_all = _data(ctx.seed, n=int(ctx.args.get("samples", 600)))
    model, _ = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    for x, y in ctx.batches((x_all, y_all)):
        loss = nn.functional.mse_loss(model(x), y, reduction="sum")
        ctx.step(loss)
        if ctx.rank == ctx.world_size - 1 and ctx.iteration == int(ctx.args.get("stop_at", 5)):
            ctx.stop()


HELD: list[object] = []


def train_and_leave(ctx: EvenflowContext) -> None:
    """``train`` that leaves after one batch with its loop held open (so the runtime never hears
    of it): the rank's process would end while its peers wait for it."""
    model = nn.Linear(4, 1)
    x_all, y_all = _data(ctx.seed)
    model, _ = ctx.prepare(model)
    batches = ctx.batches((x_all, y_all))
    x, y = next(batches)
    ctx.step(nn.functional.mse_loss(model(x), y, reduction="sum"))
    HELD.append(batches)
