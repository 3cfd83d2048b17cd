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
