"""Sharded models: PyTorch's FSDP2 (``fully_shard``) with exact weighting of unequal shares.

:class:`ShardedSync` shards the user's model over the job's ranks: ``fully_shard`` on each block
(the classes the user names in ``ctx.prepare(model, opt, shard=[Block])``, or by default the
children of every ``nn.ModuleList``: a transformer's layers), then on the root. Each rank then
holds ``1/world`` of the parameters, gradients and optimizer state; a block's parameters are
all-gathered for its forward and backward, and its gradients reduce-scattered as backward
leaves it.

Exact weighting: FSDP2 would divide the reduce-scattered gradients by the world size. With a
divide factor of 1 and sum-only collectives every rank's shard holds the *sum* over the ranks'
samples; after the iteration's last pass, a small all-reduce of the statistics slots
(:class:`~agent.runtime.gradients.SlotChannel`: loss sum, count, stop, flag, plan-agreement
control slots) gives the global count, and the shards are divided by it. The update is a single
process's on the global batch.

What sharding asks of the rest of the runtime:

- every rank takes part in every layer's collectives, so every rank runs the same number of
  passes in an iteration (:func:`equal_passes`): shares may differ, pass counts may not. A rank
  with fewer samples runs smaller passes (empty ones when its share is 0): its forward and
  backward of an empty batch still join the collectives;
- each pass's backward reduce-scatters and the shards accumulate, so passes need no ``no_sync``;
- no rank can sit out (an excluded rank would leave the others waiting in a layer's
  all-gather): the control plane never excludes a rank of an FSDP job, it re-plans instead;
- out of memory cannot be redone in smaller passes on one rank (the others' pass counts would
  differ): the rank fails and the job restarts from its checkpoint with the cap learnt;
- a rank that leaves its loop (``break``) cannot withdraw without the others' layers: use
  ``ctx.stop()``, which every rank honours at the same iteration.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from agent.runtime.errors import FatalJobError
from agent.runtime.gradients import Checksum, Reduced, SlotChannel


class ShardingError(FatalJobError):
    """The model cannot be sharded as asked (no block to shard): the job cannot run."""


def find_blocks(model: nn.Module, shard: Sequence[type[nn.Module]] | None) -> list[nn.Module]:
    """The modules ``fully_shard`` wraps before the root: instances of ``shard``'s classes, or
    by default the children of every ``nn.ModuleList`` (a transformer's layers)."""
    if shard:
        kinds = tuple(shard)
        blocks = [m for m in model.modules() if isinstance(m, kinds) and m is not model]
        if not blocks:
            names = ", ".join(k.__name__ for k in kinds)
            raise ShardingError(
                f"engine fsdp: the model has no {names} to shard (ctx.prepare(..., shard=[...]) "
                "names the block classes, e.g. a transformer layer)"
            )
        return blocks
    blocks = [
        child
        for m in model.modules()
        if isinstance(m, nn.ModuleList)
        for child in m
        if any(p.requires_grad for p in child.parameters())
    ]
    if not blocks:
        raise ShardingError(
            f"engine fsdp: {type(model).__name__} has no block to shard (no nn.ModuleList of "
            "layers); name its block classes with ctx.prepare(model, opt, shard=[Block]), or "
            "run it with engine ddp"
        )
    return blocks


def equal_passes(
    sizes: Sequence[int], caps: Sequence[int | None], rank: int, idx: torch.Tensor
) -> list[torch.Tensor]:
    """This rank's passes when every rank runs as many as the rank that needs most: its share
    ``idx`` cut into that many near-equal parts (each within its cap; empty ones when the share
    is smaller than the count)."""
    count = (
        max((math.ceil(b / cap) if cap else 1) for b, cap in zip(sizes, caps, strict=True) if b > 0)
        if any(sizes)
        else 1
    )
    return list(torch.tensor_split(idx, count))


def swap_optimizer_params(
    optimizer: torch.optim.Optimizer, names: dict[int, str], model: nn.Module
) -> None:
    """Point an optimizer built on the unsharded parameters at the sharded ones (by name), in
    place: a scheduler built on it keeps working."""
    current = dict(model.named_parameters())
    for group in optimizer.param_groups:
        swapped = []
        for p in group["params"]:
            name = names.get(id(p))
            if name is None or name not in current:
                raise ShardingError(
                    "engine fsdp: the optimizer holds a tensor that is not one of the model's "
                    "parameters; build it on model.parameters()"
                )
            swapped.append(current[name])
        group["params"] = swapped
    if optimizer.state:
        raise ShardingError(
            "engine fsdp: the optimizer has already stepped; ctx.prepare must come before the "
            "first step (its state cannot be sharded after the fact)"
        )


class ShardedSync(SlotChannel):
    """FSDP2 over the whole world with exact weighting; the synchroniser interface of
    :class:`~agent.runtime.gradients.GradientSync`."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        device: torch.device,
        shard: Sequence[type[nn.Module]] | None = None,
        control_slots: int = 0,
        flag: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        blocks = find_blocks(model, shard)
        names = {id(p): n for n, p in model.named_parameters()}
        mesh = init_device_mesh(device.type, (world_size,))
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for m in model.modules():  # every unit: sums, never FSDP's mean over the world
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
        swap_optimizer_params(optimizer, names, model)
        self.model = model
        self.blocks = len(blocks)
        self._params = [p for p in model.parameters() if p.requires_grad]
        cheap = device.type == "cpu"
        n = self._init_slots(
            cheap=cheap, control_slots=control_slots, flag=flag, rank=rank, world_size=world_size
        )
        self._slots = torch.zeros(n, device=device, dtype=torch.float64 if cheap else torch.float32)
        self._bind_slots(self._slots)
        self._group: dist.ProcessGroup | None = None
        self.last_method = "sharded"

    @property
    def overlaps(self) -> bool:
        return True

    @property
    def withdraws(self) -> bool:
        """A rank cannot leave alone: the others wait in its layers' collectives."""
        return False

    @property
    def numel(self) -> int:
        """Elements this rank holds (its shards) plus the statistics."""
        local = sum(p.to_local().numel() for p in self._params)  # type: ignore[attr-defined]
        return local + self._slots.numel()

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self._group

    @group.setter
    def group(self, group: dist.ProcessGroup | None) -> None:
        if group is not None:
            raise RuntimeError(
                "a sharded (fsdp) job cannot exclude a rank: every rank holds a shard"
            )
        self._group = group

    def expect(self, sync: bool) -> None:
        """(Every pass reduce-scatters; the shards accumulate.)"""

    def backward_empty(self) -> None:
        """(An empty pass still back-propagates through the model: see ``ctx.backward``.)"""

    def collect(self) -> Reduced:
        """The statistics' all-reduce; the summed shards divided by the global count."""
        armed = self._disarm()
        self._fill(armed["loss_sum"], armed["count"], armed["stop"], armed["withdraw"], None)
        if dist.is_initialized():
            dist.all_reduce(self._slots, op=dist.ReduceOp.SUM)
        stats = self._read(armed["read"], False)
        scale = self._scale(stats)
        if isinstance(scale, torch.Tensor):
            scale = scale.float()
        with torch.no_grad():
            for p in self._params:
                if p.grad is not None:
                    p.grad.mul_(scale)
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
        raise RuntimeError(
            "a rank of a sharded (fsdp) job cannot leave the loop alone: call ctx.stop(), which "
            "ends the job on every rank at the same iteration"
        )

    def discard(self) -> None:
        raise RuntimeError(
            "out of memory in a sharded (fsdp) job: every rank must run the same passes, so one "
            "rank cannot redo its share in smaller ones; the job restarts from its newest "
            "checkpoint with the memory cap learnt from this failure"
        )

    def zero_grad(self) -> None:
        for p in self._params:
            if p.grad is not None:
                p.grad.zero_()

    def attach(self) -> None:
        """(FSDP owns the sharded gradients.)"""

    def detached(self) -> list[str]:
        return [str(tuple(p.shape)) for p in self._params if p.grad is None]
