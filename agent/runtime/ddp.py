"""Exact gradients with unequal batches through PyTorch's ``DistributedDataParallel``.

:class:`OverlapSync` wraps the user's model in DDP and registers a communication hook that sums
each bucket over the ranks training the iteration (``SUM``, not DDP's mean over the world), as
backward produces it, so the all-reduces overlap with the rest of backward. Once a hook is
registered DDP no longer divides by the world size; after backward the gradients are divided by
the iteration's global count (samples, or tokens: whatever ``ctx.backward``'s ``count`` says),
which every rank learns from the statistics slots of :class:`~agent.runtime.gradients.SlotChannel`
(loss sum, count, stop, withdrawal, flag, plan-agreement control slots and checksums). Those
slots travel in one small all-reduce of their own, launched from the hook of DDP's first bucket,
so it too runs while backward continues. The update equals a single process's on the global
batch, as with :class:`~agent.runtime.gradients.GradientSync`.

How the runtime's steps map onto DDP:

- passes of one iteration (a share above the memory cap): every pass but the last runs with
  ``require_backward_grad_sync`` off (what ``no_sync()`` sets), so gradients accumulate
  locally and only the last pass's backward all-reduces;
- a rank whose share is 0 samples, or that leaves its loop (a withdrawal), still takes part in
  every bucket's all-reduce: it runs DDP's forward on a zero loss over the parameters and
  back-propagates it (zeros into every bucket), so the collectives stay matched;
- exclusion and readmission: the hook sums over the gradient group in force (``group``), which
  the runtime switches between subgroups; DDP's own process group (the world) is used only at
  construction and for the one-time bucket rebuild, which :class:`OverlapSync` triggers there,
  with every rank present, so it never happens under a subgroup;
- buffers (BatchNorm statistics) are broadcast once at start, not on every forward
  (``forward_sync_buffers=False``): ranks run different numbers of forwards per iteration.

What it cannot do that the coalesced synchroniser can: redo a share in smaller passes after the
device ran out of memory *inside* a backward whose buckets had started to all-reduce (the other
ranks already summed those buckets); the rank then fails and the job restarts from its newest
checkpoint with the memory cap learnt from the failure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from agent.runtime.gradients import Checksum, Reduced, SlotChannel


class _ZeroLoss(nn.Module):
    """A loss of exactly 0 that depends on every parameter, in their order (so autograd readies
    them last-to-first, the order DDP's buckets assume)."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        super().__init__()
        self._targets = list(params)  # a plain list: not registered, not in any state_dict

    def forward(self) -> torch.Tensor:
        total = torch.zeros((), device=self._targets[0].device, dtype=torch.float32)
        for p in self._targets:
            total = total + (p.reshape(-1)[:1] * 0).sum().float()
        return total


class OverlapSync(SlotChannel):
    """DDP with an exact weighting hook; the same interface as :class:`GradientSync`.

    ``module`` is wrapped at construction (a collective: every rank constructs it together,
    with the whole world present); :attr:`ddp` is what ``ctx.prepare`` hands back.
    """

    def __init__(
        self,
        module: nn.Module,
        group: dist.ProcessGroup | None = None,
        *,
        control_slots: int = 0,
        flag: bool = False,
        rank: int = 0,
        world_size: int = 1,
        bucket_cap_mb: float | None = None,
    ) -> None:
        self._params = [p for p in module.parameters() if p.requires_grad]
        if not self._params:
            raise ValueError("no parameters require gradients")
        device = self._params[0].device
        cheap = device.type == "cpu"
        n = self._init_slots(
            cheap=cheap, control_slots=control_slots, flag=flag, rank=rank, world_size=world_size
        )
        dtype = torch.float64 if cheap else torch.float32
        self._slots = torch.zeros(n, device=device, dtype=dtype)
        self._bind_slots(self._slots)
        self.group = group
        self.last_method = "overlap"
        kwargs: dict[str, Any] = {}
        if bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = bucket_cap_mb
        self.ddp = DistributedDataParallel(
            module,
            device_ids=[device.index] if device.type == "cuda" else None,
            forward_sync_buffers=False,
            gradient_as_bucket_view=True,
            **kwargs,
        )
        # (a lambda: DDP checks a hook's annotations, which postponed evaluation makes strings)
        self.ddp.register_comm_hook(self, lambda state, bucket: state._hook(bucket))
        self._stats_work: Any = None
        self.buckets = 0
        """Buckets all-reduced in the last backward."""
        self._launched = False
        """The armed reduction's statistics left with the first bucket (until collected)."""
        self._warm_up()

    # -------------------------------------------------------------------------- DDP's hook

    def _hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Sum one bucket over the gradient group (DDP's mean is not what unequal shares need);
        the first bucket also launches the statistics' all-reduce."""
        if bucket.index() == 0:
            self._launch_stats()
            self.buckets = 0
        self.buckets += 1
        buffer = bucket.buffer()
        if not dist.is_initialized():
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(buffer)
            return done
        work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self._group, async_op=True)
        assert work is not None
        return work.get_future().then(lambda fut: fut.value()[0])

    def _launch_stats(self) -> None:
        armed = self._armed or {}
        if self._on_launch is not None:
            on_launch, self._on_launch = self._on_launch, None
            on_launch()
        self._fill(
            armed.get("loss_sum"),
            armed.get("count", 0.0),
            armed.get("stop", False),
            armed.get("withdraw", False),
            armed.get("checksum"),
        )
        if dist.is_initialized():
            self._stats_work = dist.all_reduce(
                self._slots, op=dist.ReduceOp.SUM, group=self._group, async_op=True
            )
        else:
            self._stats_work = None
        self._launched = True

    def _warm_up(self) -> None:
        """One zero backward (DDP records the order gradients become ready), then the forward
        that rebuilds its buckets in that order: a broadcast over DDP's process group, which
        must happen now, while every rank is present, not later under a subgroup."""
        self.arm(None, 0.0)
        self._zero_backward()
        self.collect()
        self.zero_grad()
        self.ddp.require_backward_grad_sync = False  # a forward only: no backward follows
        real = self.ddp.module
        self.ddp.module = _ZeroLoss(self._params)
        try:
            self.ddp()
        finally:
            self.ddp.module = real
            self.ddp.require_backward_grad_sync = True

    def _zero_backward(self) -> None:
        """Every bucket's all-reduce without a batch: DDP's forward on a zero loss over the
        parameters, then its backward (zeros accumulate into every gradient)."""
        real = self.ddp.module
        self.ddp.require_backward_grad_sync = True
        self.ddp.module = _ZeroLoss(self._params)
        try:
            loss = self.ddp()
        finally:
            self.ddp.module = real
        loss.backward()

    # ---------------------------------------------------------------- the runtime's steps

    @property
    def overlaps(self) -> bool:
        """Gradients are summed during the last pass's backward (the statistics too)."""
        return True

    @property
    def withdraws(self) -> bool:
        """A rank that leaves its loop joins every bucket's all-reduce with zeros."""
        return True

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self._params) + self._slots.numel()

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group gradients are summed over (``None``: the default group)."""
        return self._group

    @group.setter
    def group(self, group: dist.ProcessGroup | None) -> None:
        self._group = group

    def expect(self, sync: bool) -> None:
        """Before a pass's forward: whether its backward all-reduces (the iteration's last pass
        with samples) or accumulates locally (``no_sync``)."""
        self.ddp.require_backward_grad_sync = sync

    def backward_empty(self) -> None:
        """The iteration's last pass had no samples: take part in every bucket's all-reduce."""
        self._zero_backward()

    def launch(self) -> None:
        """(The coalesced synchroniser reduces here; DDP already did, in backward.)"""

    def collect(self) -> Reduced:
        """Wait for the statistics, divide the summed gradients and loss by the global count."""
        armed = self._armed
        if armed is None or not self._launched:
            raise RuntimeError(
                "the iteration's backward did not reach DDP: compute the loss with the model "
                "ctx.prepare() returned (the DistributedDataParallel wrapper), not with the "
                "module it wraps"
            )
        self._armed, self._launched = None, False
        if self._stats_work is not None:
            self._stats_work.wait()
        stats = self._read(armed["read"], armed["checksum"] is not None)
        scale = self._scale(stats)
        grads = [p.grad for p in self._params if p.grad is not None]
        if isinstance(scale, torch.Tensor):
            torch._foreach_mul_(grads, scale.float())
        else:
            torch._foreach_mul_(grads, scale)
        self._loss_slot.mul_(scale)
        return self._take(stats)

    def reduce(
        self,
        loss_sum: torch.Tensor | None,
        count: float | torch.Tensor = 0.0,
        *,
        stop: bool = False,
        withdraw: bool = False,
        checksum: Checksum | None = None,
        read: bool = True,
    ) -> Reduced:
        """A whole reduction without a batch of this rank's (a withdrawal)."""
        self.arm(loss_sum, count, stop=stop, withdraw=withdraw, checksum=checksum, read=read)
        self._zero_backward()
        return self.collect()

    def discard(self) -> None:
        """Drop the gradients of a failed attempt (out of memory) so the share can be redone;
        impossible once its buckets started to all-reduce."""
        if self._armed is not None and self._launched:
            raise RuntimeError(
                "out of memory in a backward whose gradients were already being all-reduced "
                "(DDP overlaps them with backward), so this rank cannot redo its share alone; "
                "the job restarts from its newest checkpoint"
            )
        self._armed = None
        self.ddp.require_backward_grad_sync = True
        self.zero_grad()

    def zero_grad(self) -> None:
        """Zero every gradient in place (they are views into DDP's buckets)."""
        for p in self._params:
            if p.grad is not None:
                p.grad.zero_()

    def attach(self) -> None:
        """(DDP points a gradient set to None back at its bucket view itself.)"""

    def detached(self) -> list[str]:
        """Shapes of the parameters whose gradient is None now (zeroed with set_to_none)."""
        return [str(tuple(p.shape)) for p in self._params if p.grad is None]
