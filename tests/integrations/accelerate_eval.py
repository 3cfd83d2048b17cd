"""An Accelerate job that also prepares an evaluation DataLoader and combines a metric with
``reduce`` and ``gather``: rank 0 writes what it saw to ``args.out`` (JSON)."""

from __future__ import annotations

import json
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from evenflow.integrations.accelerate import EvenflowAccelerator


def train(ctx: Any) -> None:
    accelerator = EvenflowAccelerator(ctx)
    x, y = torch.randn(256, 4), torch.randn(256, 1)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_dl = DataLoader(TensorDataset(x, y), batch_size=8)
    eval_dl = DataLoader(TensorDataset(torch.arange(37.0)), batch_size=5)
    model, opt, train_dl, eval_dl = accelerator.prepare(model, opt, train_dl, eval_dl)
    for xb, yb in train_dl:
        accelerator.backward(torch.nn.functional.mse_loss(model(xb), yb))
        if accelerator.sync_gradients:
            opt.step()
            opt.zero_grad()
    seen, total = 0, 0.0
    for (items,) in eval_dl:
        seen += len(items)
        total += float(items.sum())
    counts = accelerator.reduce(torch.tensor([float(seen), total]))
    ranks = accelerator.gather(torch.tensor([float(accelerator.process_index)]))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with open(ctx.args["out"], "w") as f:
            json.dump({"counts": counts.tolist(), "ranks": ranks.tolist()}, f)
