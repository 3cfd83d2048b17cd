"""An image classifier as people write it, under Evenflow: JPEGs decoded and augmented in
DataLoader workers, AdamW with a one-cycle schedule, clipping, an EMA of the weights, a held-out
evaluation now and then, checkpoints, and the final model saved.

Run it as a job from the repository root (where a local cluster's workers start, so that
``examples`` can be imported; your own code travels with ``--context``)::

    evenflow jobs submit examples/image.yaml

The lines that differ from the same loop in one process are marked ``# evenflow``.
"""

from __future__ import annotations

import io
import os
import pickle
import random
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, Dataset

CLASSES, SIDE, CROP = 10, 40, 32
PALETTE = [(210, 50, 50), (50, 190, 60), (50, 70, 210), (210, 190, 50), (190, 50, 190)]


def make_jpegs(directory: str, count: int, seed: int = 0) -> str:
    """Write ``count`` small labelled JPEGs (stripes of a class's orientation and colour, with
    noise) into one file, once; return its path. Safe when several ranks race to write it."""
    from PIL import Image

    path = os.path.join(directory, f"jpegs-{count}-{seed}.pkl")
    if os.path.exists(path):
        return path
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, count).tolist()
    yy, xx = np.mgrid[0:SIDE, 0:SIDE]
    blobs = []
    for label in labels:
        vertical, colour = divmod(label, len(PALETTE))
        wave = 0.5 + 0.5 * np.sin(2 * np.pi * (yy if vertical else xx) / rng.uniform(5, 9))
        img = wave[..., None] * np.array(PALETTE[colour]) + (1 - wave[..., None]) * 128.0
        img = np.clip(img + rng.normal(0, 25, img.shape), 0, 255).astype(np.uint8)
        out = io.BytesIO()
        Image.fromarray(img).save(out, format="JPEG", quality=85)
        blobs.append(out.getvalue())
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump({"jpeg": blobs, "label": labels}, f)
    os.replace(tmp, path)
    return path


class Jpegs(Dataset[tuple[torch.Tensor, int]]):
    """Decode a JPEG held in memory; random crop and flip when augmenting, else centre crop."""

    def __init__(self, path: str, start: int = 0, stop: int | None = None, augment: bool = True):
        with open(path, "rb") as f:
            data = pickle.load(f)
        self.jpeg, self.label = data["jpeg"][start:stop], data["label"][start:stop]
        self.augment = augment

    def __len__(self) -> int:
        return len(self.jpeg)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        img = Image.open(io.BytesIO(self.jpeg[i])).convert("RGB")
        if self.augment:
            x0, y0 = random.randint(0, SIDE - CROP), random.randint(0, SIDE - CROP)
            img = img.crop((x0, y0, x0 + CROP, y0 + CROP))
            if random.random() < 0.5:
                img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        else:
            o = (SIDE - CROP) // 2
            img = img.crop((o, o, o + CROP, o + CROP))
        x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
        return (x - 0.5) / 0.25, self.label[i]


class SmallCNN(nn.Module):
    """Three conv blocks. GroupNorm, not BatchNorm: BatchNorm's statistics are each rank's own
    (as under DDP), so its forward differs from one process's on the whole global batch."""

    def __init__(self, width: int = 16, dropout: float = 0.1) -> None:
        super().__init__()
        c = width
        self.net = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), nn.GroupNorm(4, c), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.GroupNorm(4, 2 * c), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * c, 4 * c, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
            nn.Flatten(), nn.Dropout(dropout), nn.Linear(4 * c, CLASSES),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def build(args: dict[str, Any], total_steps: int) -> tuple[nn.Module, Any, Any, AveragedModel]:
    """The model, AdamW, its one-cycle schedule and an EMA: the same in one process."""
    torch.manual_seed(int(args.get("seed", 0)))
    model = SmallCNN(dropout=float(args.get("dropout", 0.1)))
    lr = float(args.get("lr", 3e-3))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total_steps)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99))
    return model, opt, sched, ema


def datasets(args: dict[str, Any]) -> tuple[Jpegs, Jpegs]:
    count = int(args.get("images", 2048))
    path = make_jpegs(str(args.get("data_dir", "data")), count)
    held_out = count // 8
    augment = bool(args.get("augment", True))
    return Jpegs(path, stop=count - held_out, augment=augment), Jpegs(
        path, start=count - held_out, augment=False
    )


def after_sync(model: nn.Module, opt: Any, sched: Any, ema: AveragedModel, clip: float) -> None:
    """What the loop does with synchronised gradients: clip, step, schedule, average, zero."""
    nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    sched.step()
    ema.update_parameters(model)
    opt.zero_grad()


@torch.no_grad()
def evaluate(ctx: Any, model: nn.Module, held_out: Dataset[Any]) -> float:
    """Accuracy on the held-out images, each rank scoring its part."""
    model.eval()
    correct = total = 0
    for x, y in DataLoader(ctx.shard(held_out), batch_size=256):  # evenflow: ctx.shard
        correct += int((model(x.to(ctx.device)).argmax(1).cpu() == y).sum())
        total += len(y)
    model.train()
    return ctx.all_reduce(correct) / ctx.all_reduce(total)  # evenflow: ctx.all_reduce


def loader_of(train_set: Jpegs, args: dict[str, Any]) -> DataLoader[Any]:
    """The DataLoader the script had: workers decode and augment, two batches ahead each."""
    return DataLoader(
        train_set,
        batch_size=int(args.get("batch", 128)),  # replaced by the plan's share
        shuffle=True,  # replaced by one seeded permutation per epoch
        num_workers=int(args.get("workers", 2)),
        prefetch_factor=2,
        persistent_workers=True,
        drop_last=True,
    )


def train(ctx: Any) -> None:
    """The job's entrypoint (``workload.entrypoint: examples.image:train``)."""
    args = ctx.args
    train_set, held_out = datasets(args)
    loader = loader_of(train_set, args)
    model, opt, sched, ema = build(args, ctx.total_iterations(loader))  # evenflow: job length
    model, opt = ctx.prepare(model, opt)  # evenflow
    ema.to(ctx.device)
    ctx.register_state("sched", sched)  # evenflow: checkpointed, re-synchronised
    ctx.register_state("ema", ema)  # evenflow
    eval_every = int(args.get("eval_every", 50))
    for x, y in ctx.batches(loader):  # evenflow: this rank's share of each global batch
        loss = F.cross_entropy(model(x), y, reduction="sum")  # evenflow: a sum, not a mean
        ctx.backward(loss)  # evenflow: instead of loss.backward()
        if ctx.sync_gradients:  # evenflow
            after_sync(model, opt, sched, ema, float(args.get("clip", 1.0)))
        if (ctx.iteration + 1) % eval_every == 0:
            accuracy = evaluate(ctx, model, held_out)
            if ctx.rank == ctx.plan.leader:
                ctx.log("val_acc", accuracy)
    accuracy = evaluate(ctx, ema.module, held_out)
    if ctx.rank == 0:
        ctx.log("ema_val_acc", accuracy)
    if args.get("out") or ctx.checkpointer is not None:
        ctx.save_final(str(args["out"]) if args.get("out") else None)  # evenflow: rank 0 writes
