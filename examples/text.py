"""A small causal language model under Evenflow: variable-length sequences padded by a custom
``collate_fn``, and a per-token loss normalised over every real token of the global batch.

Each rank's share has its own number of tokens, so the loss is summed over the rank's tokens and
``ctx.backward(loss_sum, count=tokens)`` divides by the tokens of all ranks together: the update
is exactly the one a single process makes on the whole global batch (a per-rank mean would
weight a token on a rank with short sequences more). The lines that differ from the same loop in
one process are marked ``# evenflow``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

PAD = 0


class Sequences(Dataset[torch.Tensor]):
    """Token sequences of 6 to ``longest`` tokens that follow a rule a model can learn: each
    sequence counts up from a random start, in steps of its own stride, modulo the vocabulary."""

    def __init__(self, count: int, vocab: int, longest: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.seqs = []
        for _ in range(count):
            n = int(torch.randint(6, longest + 1, (1,), generator=g))
            start, stride = torch.randint(1, vocab, (2,), generator=g).tolist()
            self.seqs.append(1 + (start + stride * torch.arange(n)) % (vocab - 1))

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.seqs[i]


def pad_collate(seqs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pad to the batch's longest sequence; the mask marks real tokens."""
    longest = max((len(s) for s in seqs), default=1)
    ids = torch.full((len(seqs), longest), PAD, dtype=torch.long)
    mask = torch.zeros(len(seqs), longest, dtype=torch.bool)
    for j, s in enumerate(seqs):
        ids[j, : len(s)] = s
        mask[j, : len(s)] = True
    return {"input_ids": ids, "attention_mask": mask}


class TinyCausalLM(nn.Module):
    """Embeddings, a few causal self-attention blocks, tied output weights."""

    def __init__(self, vocab: int, width: int, layers: int, longest: int, dropout: float):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width, padding_idx=PAD)
        self.positions = nn.Parameter(torch.randn(1, longest, width) / math.sqrt(width))
        # No biases, as in most current language models. (The attention's key bias gets no
        # gradient at all, softmax being blind to a shift, and Adam makes float noise there
        # into full-size steps, so it is noise and not training that moves it.)
        block = nn.TransformerEncoderLayer(
            width, 4, 4 * width, dropout=dropout, batch_first=True, bias=False
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        if ids.shape[0] == 0:  # a rank's empty share: attention cannot take 0 rows, so every
            # layer runs on one blank row (a sharded job's collectives need each layer), cut off
            blank = ids.new_full((1, max(n, 1)), PAD)
            return self(blank, torch.ones_like(blank, dtype=torch.bool))[:0, :n]
        h = self.tokens(ids) + self.positions[:, :n]
        causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).triu(1)  # True: hidden
        h = self.blocks(h, mask=causal, src_key_padding_mask=~mask, is_causal=True)
        return self.norm(h) @ self.tokens.weight.T


def token_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
    """Next-token cross-entropy summed over the real target tokens, and their number."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = model(ids[:, :-1], mask[:, :-1])
    target = ids[:, 1:].masked_fill(~mask[:, 1:], -100)  # padding is not a target
    loss = F.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100, reduction="sum")
    return loss, mask[:, 1:].sum()


def build(args: dict[str, Any], total_steps: int) -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(int(args.get("seed", 0)))
    model = TinyCausalLM(
        vocab=int(args.get("vocab", 64)),
        width=int(args.get("width", 32)),
        layers=int(args.get("layers", 2)),
        longest=int(args.get("longest", 32)),
        dropout=float(args.get("dropout", 0.1)),
    )
    lr = float(args.get("lr", 3e-3))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total_steps)
    return model, opt, sched


def dataset(args: dict[str, Any]) -> Sequences:
    return Sequences(
        int(args.get("sequences", 4096)), int(args.get("vocab", 64)), int(args.get("longest", 32))
    )


def train(ctx: Any) -> None:
    """The job's entrypoint (``workload.entrypoint: examples.text:train``)."""
    args = ctx.args
    loader = DataLoader(
        dataset(args),
        batch_size=int(args.get("batch", 64)),  # replaced by the plan's share
        shuffle=True,  # replaced by one seeded permutation per epoch
        collate_fn=pad_collate,  # kept: runs in the workers
        num_workers=int(args.get("workers", 1)),
    )
    model, opt, sched = build(args, ctx.total_iterations(loader))  # evenflow: job length
    model, opt = ctx.prepare(model, opt)  # evenflow
    ctx.register_state("sched", sched)  # evenflow
    for batch in ctx.batches(loader):  # evenflow
        loss, tokens = token_loss(model, batch)
        ctx.backward(loss, count=tokens)  # evenflow: normalised by every rank's tokens
        if ctx.sync_gradients:  # evenflow
            nn.utils.clip_grad_norm_(model.parameters(), float(args.get("clip", 1.0)))
            opt.step()
            sched.step()
            opt.zero_grad()
    if args.get("out") or ctx.checkpointer is not None:
        ctx.save_final(str(args["out"]) if args.get("out") else None)  # evenflow
