"""Speed probes of an excluded rank: a timed forward + backward nobody waits for.

While excluded, a rank still has to show the control plane whether it has recovered. On each tick
from the leader (see :mod:`agent.runtime.membership`) it times one forward + backward of a small
batch (the plan's mean local batch, capped), pads it to its emulated speed when the job is
emulated, throws the gradients away, and reports a :class:`~contract.agent.TelemetryRecord` with
``probe=True``, numbered with the active ranks' iteration the tick carried. The samples are read,
never trained on: the probe does not count towards any epoch.

The loss comes from ``probe_loss(batch)`` when the workload gave one (built-in workloads do), else
:func:`forward_sum`: the model's output summed, which costs the same forward and backward.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from agent.runtime.emulation import Emulator

ProbeLoss = Callable[[Any], torch.Tensor]
"""``probe_loss(batch) -> scalar`` for a batch as ``ctx.batches`` would yield it."""


@dataclass(frozen=True)
class ProbeTiming:
    data_ms: float
    compute_ms: float
    """Forward + backward, plus emulation padding."""


def forward_sum(model: nn.Module) -> ProbeLoss:
    """A loss for probing any model: its output on the batch's inputs, summed.

    Inputs are the first element of a tuple or list batch, the batch itself otherwise; a dict is
    passed as keyword arguments. An output with a ``loss`` attribute (Hugging Face style) uses it.
    """

    def loss(batch: Any) -> torch.Tensor:
        inputs = batch[0] if isinstance(batch, tuple | list) else batch
        out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
        if getattr(out, "loss", None) is not None:
            return out.loss
        if isinstance(out, tuple | list):
            out = out[0]
        return out.float().sum()

    return loss


def probe(
    take: Callable[[], Any],
    loss_fn: ProbeLoss,
    *,
    iteration: int,
    batch_size: int,
    device: torch.device,
    emulator: Emulator | None = None,
) -> ProbeTiming:
    """Time ``take()`` (the data) and a forward + backward of ``loss_fn`` on it.

    The caller discards the gradients afterwards. On CUDA it synchronises the device: the probe
    is off the critical path, and only the host clock can include the emulation padding.
    """
    t0 = time.perf_counter()
    batch = take()
    t1 = time.perf_counter()
    loss_fn(batch).backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    compute_ms = (time.perf_counter() - t1) * 1000.0
    if emulator is not None:
        compute_ms += emulator.pad(iteration, batch_size, compute_ms)
    return ProbeTiming((t1 - t0) * 1000.0, compute_ms)


def probe_size(plan_active: int, global_batch: int, *caps: int | None) -> int:
    """The plan's mean local batch (``ceil(B / active ranks)``), at most every given cap."""
    b = -(-global_batch // max(1, plan_active))
    for cap in caps:
        if cap is not None:
            b = min(b, cap)
    return max(1, b)
