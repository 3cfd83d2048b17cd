"""A streaming dataset under Evenflow: an ``IterableDataset`` with no length and no index (as
read from a web-scale corpus shard by shard), split among ranks of unequal shares.

Every rank reads the same stream and keeps its slice of each global batch, so no sample is used
twice or skipped whatever the plans; the job's length is given in ``iterations`` (a stream has
no epochs). With the DataLoader's ``batch_size`` equal to the job's ``global_batch``, global
batch ``i`` is exactly the ``i``-th batch this DataLoader yields in one process. The lines that
differ from the same loop in one process are marked ``# evenflow``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from examples.text import pad_collate

VOCAB, MARKERS = 48, 4


class MarkedStream(IterableDataset[torch.Tensor]):
    """Endless token sequences, each with one of ``MARKERS`` marker tokens repeated in it; the
    label (the marker) is the sequence's first token. Each DataLoader worker reads its own shards
    (here: its own seeded generator), as a sharded corpus would be split among workers."""

    def __init__(self, seed: int = 0, longest: int = 24) -> None:
        self.seed, self.longest = seed, longest

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        shard = info.id if info is not None else 0
        rng = np.random.default_rng(self.seed * 1000 + shard)
        while True:
            n = int(rng.integers(8, self.longest + 1))
            label = int(rng.integers(0, MARKERS))
            seq = rng.integers(MARKERS + 1, VOCAB, n)
            seq[rng.choice(n, n // 3, replace=False)] = 1 + label
            yield torch.tensor([label, *seq.tolist()])


class Classifier(nn.Module):
    def __init__(self, width: int = 32, dropout: float = 0.1) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, width, padding_idx=0)
        block = nn.TransformerEncoderLayer(  # no biases: see examples/text.py
            width, 4, 2 * width, dropout, batch_first=True, bias=False
        )
        self.blocks = nn.TransformerEncoder(block, 1, enable_nested_tensor=False)
        self.head = nn.Linear(width, MARKERS)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.tokens(ids), src_key_padding_mask=~mask)
        m = mask.unsqueeze(-1).float()
        return self.head((h * m).sum(1) / m.sum(1).clamp(min=1))


def loss_sum(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy summed over the batch's sequences (the label is the first token)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = model(ids[:, 1:], mask[:, 1:])
    return F.cross_entropy(logits, ids[:, 0], reduction="sum")


def build(args: dict[str, Any]) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(int(args.get("seed", 0)))
    model = Classifier(dropout=float(args.get("dropout", 0.1)))
    return model, torch.optim.AdamW(model.parameters(), lr=float(args.get("lr", 2e-3)))


def loader_of(args: dict[str, Any], global_batch: int) -> DataLoader[Any]:
    return DataLoader(
        MarkedStream(seed=int(args.get("seed", 0))),
        batch_size=global_batch,  # the stream is read in pieces of it
        collate_fn=pad_collate,
        num_workers=int(args.get("workers", 2)),
    )


def train(ctx: Any) -> None:
    """The job's entrypoint (``workload.entrypoint: examples.stream:train``)."""
    args = ctx.args
    model, opt = build(args)
    model, opt = ctx.prepare(model, opt)  # evenflow
    for batch in ctx.batches(loader_of(args, ctx.spec.global_batch)):  # evenflow
        ctx.backward(loss_sum(model, batch))  # evenflow
        if ctx.sync_gradients:  # evenflow
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    if args.get("out") or ctx.checkpointer is not None:
        ctx.save_final(str(args["out"]) if args.get("out") else None)  # evenflow
