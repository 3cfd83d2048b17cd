"""A job entrypoint that keeps a plain ``Accelerator`` (what a user would try first)."""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator


def train(ctx: Any) -> None:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    Accelerator().prepare(model, opt)
