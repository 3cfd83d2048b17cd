"""The causal language model of ``examples/text.py`` trained by an ordinary Accelerate loop under
Evenflow: ``EvenflowAccelerator(ctx)`` in place of ``Accelerator()``, and the loss's count.

The loop is the one Accelerate's own examples write (``prepare``, ``backward`` of a MEAN loss,
clip and step under ``sync_gradients``); each rank's batch is its share from Evenflow's plan,
and the per-token mean is weighted by the rank's real target tokens (``count=``) so the update
is exactly that of one process on the whole global batch. The lines that differ from the same
script under ``accelerate launch`` are marked ``# evenflow``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from evenflow.integrations.accelerate import EvenflowAccelerator
from examples.text import build, dataset, pad_collate


def token_mean(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
    """Next-token cross-entropy, the mean over the real target tokens, and their number."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = model(ids[:, :-1], mask[:, :-1])
    target = ids[:, 1:].masked_fill(~mask[:, 1:], -100)  # padding is not a target
    return F.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100), mask[:, 1:].sum()


def train(ctx: Any) -> None:
    """The job's entrypoint (``workload.entrypoint: examples.accelerate_text:train``)."""
    args = ctx.args
    accelerator = EvenflowAccelerator(ctx)  # evenflow: was Accelerator()
    loader = DataLoader(
        dataset(args),
        batch_size=int(args.get("batch", 64)),  # replaced by the plan's share
        shuffle=True,
        collate_fn=pad_collate,
        num_workers=int(args.get("workers", 1)),
    )
    model, opt, sched = build(args, ctx.total_iterations(loader))  # evenflow: the job's length
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    for batch in loader:
        loss, tokens = token_mean(model, batch)
        accelerator.backward(loss, count=tokens)  # evenflow: count= (a per-token mean)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), float(args.get("clip", 1.0)))
            opt.step()
            sched.step()
            opt.zero_grad()
    if args.get("out") or ctx.checkpointer is not None:
        ctx.save_final(str(args["out"]) if args.get("out") else None)  # evenflow
