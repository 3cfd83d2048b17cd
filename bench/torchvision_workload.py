"""ResNet-50 from torchvision as an Evenflow job's workload (``bench.torchvision_workload:resnet50``),
used by ``bench/cuda_host.py``. A module of its own so that each worker imports torch and
torchvision only, not the benchmark's control-plane stack."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from agent.runtime.workloads import Workload


def images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` synthetic 224x224 RGB images and labels of 1000 classes, seeded (no download)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 224, 224, generator=g), torch.randint(0, 1000, (n,), generator=g)


def model(seed: int) -> nn.Module:
    from torchvision.models import resnet50 as build

    torch.manual_seed(seed)
    net: nn.Module = build(weights=None)  # torchvision is untyped where it is not installed
    return net


def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, target, reduction="sum")


def resnet50(ctx: Any) -> Workload:
    """ResNet-50, fp32, on ``args.images`` (2048) synthetic images."""
    return Workload(model(ctx.seed), images(int(ctx.args.get("images", 2048)), ctx.seed), loss)
