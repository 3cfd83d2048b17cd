"""Exact data-parallel gradients when ranks have unequal local batches.

DDP averages gradients with equal weight per rank, which is wrong when rank ``r`` has ``b_r``
samples and the ``b_r`` differ: the update would weight a sample on a small rank more than one on a
large rank. Here every rank back-propagates the **sum** of its per-sample losses, the gradients are
all-reduced with ``SUM``, and the result is multiplied by ``1 / B_global`` (the actual number of
samples in this iteration's global batch). The update is then exactly the one single-process SGD
makes on the concatenated global batch, up to floating-point reassociation.

Why an explicit coalesced all-reduce rather than ``DistributedDataParallel``:

- A rank given 0 samples must compute nothing, yet still join the collective. DDP's reducer is
  driven by autograd hooks fired during ``backward``; with no forward there are no hooks, the rank
  never launches its buckets and the job hangs (or needs a fake forward, which is compute).
- The gradients of each parameter live in one pre-allocated flat buffer per (device, dtype), and
  ``param.grad`` is a *view* into it (as DDP's ``gradient_as_bucket_view``). Backward accumulates
  straight into the buffer, so an iteration costs one collective per buffer (one for a usual
  model), no per-iteration allocation and no copies. A zero-sample rank contributes the zeros it
  already holds.
- One extra float slot at the end of the first buffer carries the rank's loss sum, so the global
  mean loss comes out of the same collective for free.
- Optionally (``control_slots``), a few more slots carry small integers from one rank to all:
  the sender writes them, every other rank writes zeros, and the SUM delivers them exactly
  (float32 holds integers below 2**24 exactly; ``x + 0 == x``). The plan agreement uses this to
  ride on the gradient all-reduce instead of a collective of its own
  (:class:`~agent.runtime.plan_sync.PlanAgreement`). Only for float32/float64 buffers on the CPU:
  reading the slots back from a GPU every iteration would synchronise the host with the device.

How the buffers are summed (``exchange``): NCCL and large CPU buffers use ``all_reduce``. A
small CPU buffer on gloo is summed by a **direct exchange** instead: one ``all_to_all_single`` in
which every rank sends its whole buffer to every other, then each rank adds the k copies in rank
order. Gloo's ring all-reduce takes 2(k-1) dependent network steps whatever the size, and for a
small buffer those steps are all latency: on a 2-core machine with 4 ranks a 2,200-float
all-reduce takes ~5-8 ms, the direct exchange ~1.5 ms (``bench/collectives.py``). It sends k
times the data, so it is used only while ``numel * k <= DIRECT_MAX_ELEMENTS``. The sum is still
bitwise identical on every rank: each rank performs the same elementwise IEEE additions in the
same order, so parameters never drift apart.

What this gives up: DDP overlaps bucket all-reduces with the rest of backward. This synchroniser
reduces once, after backward. For the small and medium models this runtime targets that costs
little; overlapping would mean per-bucket hooks plus an explicit path for zero-sample ranks.
Module buffers (e.g. BatchNorm statistics) are broadcast once at start by
:func:`broadcast_module`, not on every forward as DDP does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

DIRECT_MAX_ELEMENTS = 1 << 18
"""Largest ``numel * group size`` summed by the direct exchange on gloo (1 MiB of float32 received
per rank); beyond it the ring all-reduce moves less data and wins. ``bench/collectives.py`` on a
2-core machine, 4 ranks: 2,200 elements 1.6 vs 5.7 ms, 65,536: 4.6 vs 6.8 ms, 131,072: 7.7 vs
7.9 ms (even), 262,144: 16 vs 9.8 ms."""

Exchange = Literal["auto", "all_reduce", "direct"]

ControlValues = list[int] | Callable[[], list[int] | None] | None
"""What a rank sends in the control slots: values, a callable asked as the all-reduce starts,
or nothing (zeros)."""

CONTROL_MAX = 2**24
"""Control slot values must lie in (-CONTROL_MAX, CONTROL_MAX) to travel exactly in float32."""


@dataclass
class _Bucket:
    flat: torch.Tensor
    params: list[nn.Parameter]
    views: list[torch.Tensor]
    scaled: torch.Tensor
    """The part scaled by 1/global_count: gradients (and the loss slot), not control slots."""


class GradientSync:
    """Owns the gradient buffers of a set of parameters and all-reduces them exactly.

    Use it in place of ``optimizer.zero_grad()`` and DDP::

        sync = GradientSync(model.parameters())
        loss_sum.backward()            # skipped on a rank with 0 samples
        mean_loss = sync.all_reduce(global_count, loss_sum)
        optimizer.step()
        sync.zero_grad()

    If something replaces ``param.grad`` (``optimizer.zero_grad(set_to_none=True)``, a user
    assignment), the next ``all_reduce`` copies it back into the buffer and rebinds the view, so
    results stay right; only the zero-copy property is lost for that iteration.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        group: dist.ProcessGroup | None = None,
        *,
        control_slots: int = 0,
        flag: bool = False,
        exchange: Exchange = "auto",
        direct_max_elements: int = DIRECT_MAX_ELEMENTS,
    ) -> None:
        self.group = group  # (the setter)
        self.exchange: Exchange = exchange
        """``auto``: the direct exchange for small CPU buffers on gloo, else ``all_reduce``."""
        self.direct_max_elements = direct_max_elements
        self.last_method: str = ""
        """How the last :meth:`all_reduce` summed its (last) buffer: "all_reduce", "direct"
        or "local" (no process group)."""
        by_key: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
        for p in params:
            if p.requires_grad:
                by_key.setdefault((p.device, p.dtype), []).append(p)
        if not by_key:
            raise ValueError("no parameters require gradients")
        self._buckets: list[_Bucket] = []
        self.control_capacity = 0
        """Control slots available (0 when no CPU float32/float64 buffer can carry them)."""
        self.has_flag = False
        """Whether :meth:`raise_flag` reaches the other ranks (a CPU float buffer carries it)."""
        control_bucket = -1
        for i, ((device, dtype), ps) in enumerate(by_key.items()):
            extra = 1 if i == 0 else 0  # loss slot
            if (
                (control_slots or flag)
                and control_bucket < 0
                and device.type == "cpu"
                and dtype in (torch.float32, torch.float64)
            ):
                control_bucket, self.control_capacity, self.has_flag = i, control_slots, flag
            n = sum(p.numel() for p in ps) + extra
            control = self.control_capacity + self.has_flag if control_bucket == i else 0
            flat = torch.zeros(n + control, device=device, dtype=dtype)
            views = []
            offset = 0
            for p in ps:
                view = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
                views.append(view)
            self._buckets.append(_Bucket(flat, ps, views, flat[:n]))
        self._loss_slot = self._buckets[0].scaled[-1:]
        carrier = self._buckets[control_bucket].flat if control_bucket >= 0 else torch.empty(0)
        n = carrier.numel() - self.control_capacity - self.has_flag
        self._tail = carrier[n:]
        """The control slots, then the flag slot: read back with one copy per iteration."""
        self._control = self._tail[: self.control_capacity]
        self._flag = self._tail[self.control_capacity :]
        self._flag_out = False
        self._flag_seen = False
        self._outgoing: ControlValues = None
        self._received: list[int] | None = None

    def send_control(self, values: ControlValues) -> None:
        """Values this rank adds to the control slots at the next all-reduce (``None``: zeros).

        Exactly one rank should send; the others send ``None``. A callable is asked for the
        values only as the all-reduce starts, so what it reports is as fresh as it can be (the
        plan agreement's leader passes its newest candidate this way).
        """
        if values is not None and not callable(values):
            self._check_control(values)
        self._outgoing = values

    def _check_control(self, values: list[int]) -> None:
        if len(values) > self.control_capacity:
            raise ValueError(f"{len(values)} control values, capacity {self.control_capacity}")
        if any(abs(v) >= CONTROL_MAX for v in values):
            raise ValueError(f"control values must be below {CONTROL_MAX} in magnitude")

    def raise_flag(self) -> None:
        """Tell every rank something at the next all-reduce (any rank may; see
        :meth:`flag_seen`). The runtime uses it so that all ranks post their telemetry when one
        of them saw its iteration time jump."""
        self._flag_out = True

    def flag_seen(self) -> bool:
        """Whether any rank raised the flag for the last all-reduce (once; then ``False``)."""
        seen, self._flag_seen = self._flag_seen, False
        return seen

    def received_control(self) -> list[int] | None:
        """The control slots after the last all-reduce (once; then ``None`` until the next)."""
        received, self._received = self._received, None
        return received

    @property
    def numel(self) -> int:
        """Elements all-reduced per iteration (gradients, loss slot and control slots)."""
        return sum(b.flat.numel() for b in self._buckets)

    def zero_grad(self) -> None:
        """Zero the buffers (and so every ``param.grad``) in place."""
        for b in self._buckets:
            b.flat.zero_()
            self._rebind(b, copy=False)

    def all_reduce(self, global_count: int, loss_sum: torch.Tensor | None = None) -> torch.Tensor:
        """Sum gradients over ranks, scale by ``1/global_count``; return the global mean loss.

        ``loss_sum`` is this rank's summed loss (``None`` or absent on a rank with 0 samples).
        The returned 1-element tensor lives on the buffer's device; reading it on CUDA syncs.
        """
        if global_count < 1:
            raise ValueError("global_count must be at least 1")
        for b in self._buckets:
            self._rebind(b, copy=True)
        if loss_sum is None:
            self._loss_slot.zero_()
        else:
            self._loss_slot.copy_(loss_sum.detach().reshape(1))
        if self.has_flag:
            self._flag.fill_(1.0 if self._flag_out else 0.0)
            self._flag_out = False
        if self.control_capacity:
            self._control.zero_()
            outgoing, self._outgoing = self._outgoing, None
            if callable(outgoing):
                outgoing = outgoing()
                if outgoing is not None:
                    self._check_control(outgoing)
            if outgoing:
                self._control[: len(outgoing)] = torch.tensor(outgoing, dtype=self._control.dtype)
        scale = 1.0 / global_count
        for b in self._buckets:
            self._sum(b.flat)
            b.scaled.mul_(scale)
        if self._tail.numel():
            tail = self._tail.tolist()
            if self.control_capacity:
                self._received = [round(v) for v in tail[: self.control_capacity]]
            self._flag_seen = self.has_flag and tail[-1] > 0.5
        return self._loss_slot

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group gradients are summed over (``None``: the default group)."""
        return self._group

    @group.setter
    def group(self, group: dist.ProcessGroup | None) -> None:
        self._group = group
        self._peers: tuple[int, bool] | None = None
        """(group size, gloo backend), read from torch.distributed once per group."""

    def _sum(self, flat: torch.Tensor) -> None:
        """Sum ``flat`` over the group's ranks in place."""
        if not dist.is_initialized():
            self.last_method = "local"
            return
        if self._peers is None:
            self._peers = (dist.get_world_size(self.group), dist.get_backend(self.group) == "gloo")
        k, gloo = self._peers
        if self._direct(flat, k, gloo):
            received = torch.empty(k * flat.numel(), dtype=flat.dtype)
            dist.all_to_all_single(received, flat.repeat(k), group=self.group)
            parts = received.view(k, -1)
            flat.copy_(parts[0])
            for j in range(1, k):  # rank order, elementwise: identical bits on every rank
                flat.add_(parts[j])
            self.last_method = "direct"
        else:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            self.last_method = "all_reduce"

    def _direct(self, flat: torch.Tensor, k: int, gloo: bool) -> bool:
        if self.exchange == "all_reduce" or k == 1:
            return False
        usable = flat.device.type == "cpu" and gloo
        if self.exchange == "direct":
            if not usable:
                raise ValueError("the direct exchange needs CPU buffers on a gloo group")
            return True
        return usable and flat.numel() * k <= self.direct_max_elements

    @staticmethod
    def _rebind(bucket: _Bucket, *, copy: bool) -> None:
        for p, view in zip(bucket.params, bucket.views, strict=True):
            if p.grad is view:
                continue
            if p.grad is None or not copy:
                view.zero_()
            else:
                view.copy_(p.grad)
            p.grad = view


def broadcast_module(
    module: nn.Module, src: int = 0, group: dist.ProcessGroup | None = None
) -> None:
    """Make every rank's parameters and buffers equal to rank ``src``'s (once, at start)."""
    if not dist.is_initialized():
        return
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=src, group=group)
