"""Exact data-parallel gradients when ranks have unequal local batches.

DDP averages gradients with equal weight per rank, which is wrong when rank ``r`` has ``b_r``
samples and the ``b_r`` differ: the update would weight a sample on a small rank more than one on a
large rank. Here every rank back-propagates the **sum** of its per-sample losses, the gradients are
all-reduced with ``SUM``, and the result is divided by the iteration's global *count*: the samples
of the global batch, or whatever the loss is normalised by (the tokens of a language model), summed
over the ranks in the same collective. The update is then exactly the one a single process makes on
the concatenated global batch, up to floating-point reassociation.

Why an explicit coalesced all-reduce rather than ``DistributedDataParallel``:

- The gradients of each parameter live in one pre-allocated flat buffer per (device, dtype), and
  ``param.grad`` is a *view* into it (as DDP's ``gradient_as_bucket_view``). Backward accumulates
  straight into the buffer, so an iteration costs one collective per buffer (one for a usual
  model), no per-iteration allocation and no copies. A rank whose batch is empty contributes the
  zeros it already holds.
- A few extra slots at the end of one float32/float64 buffer (the *carrier*) carry the
  iteration's statistics in the same collective: the rank's loss sum (so the global mean loss
  comes for free), its count, a stop request any rank may raise, and, on the iterations that
  check it, every rank's checksum of its parameters (rank ``r`` writes slots ``r``, the others
  zeros, so after the sum every rank holds every rank's value). A model whose gradients are all
  16-bit gets a small float32 buffer of its own for them: a count or checksum in bfloat16 would
  not be exact.
- Optionally (``control_slots``), a few more slots carry small integers from one rank to all:
  the sender writes them, every other rank writes zeros, and the SUM delivers them exactly
  (float32 holds integers below 2**24 exactly; ``x + 0 == x``). The plan agreement uses this to
  ride on the gradient all-reduce instead of a collective of its own
  (:class:`~agent.runtime.plan_sync.PlanAgreement`). Only for a carrier on the CPU: reading the
  slots back from a GPU every iteration would synchronise the host with the device.

How the buffers are summed (``exchange``): NCCL and large CPU buffers use ``all_reduce``. A
small CPU buffer on gloo is summed by a **direct exchange** instead: one ``all_to_all_single`` in
which every rank sends its whole buffer to every other, then each rank adds the k copies in rank
order. Gloo's ring all-reduce takes 2(k-1) dependent network steps whatever the size, and for a
small buffer those steps are all latency, so one exchange takes a fraction of its time. It sends
k times the data, so it is used only while ``numel * k <= DIRECT_MAX_ELEMENTS``. The sum is still
bitwise identical on every rank: each rank performs the same elementwise IEEE additions in the
same order, so parameters never drift apart.

What this gives up: DDP overlaps bucket all-reduces with the rest of backward. This synchroniser
reduces once, after backward. Module buffers (e.g. BatchNorm statistics) are broadcast once at
start by :func:`broadcast_module`, not on every forward as DDP does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

DIRECT_MAX_ELEMENTS = 1 << 18
"""Largest ``numel * group size`` summed by the direct exchange on gloo (1 MiB of float32 received
per rank): about where the two cost the same; beyond it the ring all-reduce, which moves less
data, wins."""

Exchange = Literal["auto", "all_reduce", "direct"]

ControlValues = list[int] | Callable[[], list[int] | None] | None
"""What a rank sends in the control slots: values, a callable asked as the all-reduce starts,
or nothing (zeros)."""

CONTROL_MAX = 2**24
"""Control slot values must lie in (-CONTROL_MAX, CONTROL_MAX) to travel exactly in float32."""

Checksum = tuple[float, float]
"""A rank's parameters summarised: (sum of the values, sum of their magnitudes)."""


@dataclass
class _Bucket:
    flat: torch.Tensor
    params: list[nn.Parameter]
    views: list[torch.Tensor]
    scaled: torch.Tensor
    """The part divided by the global count: gradients (and, in the carrier, the loss slot)."""


@dataclass(frozen=True)
class Reduced:
    """What one all-reduce delivered besides the gradients."""

    loss: torch.Tensor
    """The global mean loss (1 element, on the carrier's device; reading it on CUDA syncs)."""
    count: torch.Tensor
    """The global count the gradients were divided by (1 element, on the carrier's device)."""
    stop: bool | None
    """Whether any rank asked to stop; None when the statistics were not read back."""
    withdrawn: bool | None
    """Whether a rank left the loop: its gradients are missing, the update must not be made."""
    checksums: dict[int, Checksum] | None
    """Rank -> its checksum, for the ranks that sent one; None when none was asked for."""


class SlotChannel:
    """The statistics and signals an iteration's all-reduce carries besides the gradients.

    The slots follow one layout, whoever sums them: ``loss | count, stop, withdraw, [flag],
    control..., then 2 checksum slots per rank``. :class:`GradientSync` keeps them at the end of
    its carrier buffer; :class:`~agent.runtime.ddp.OverlapSync` sums them in a small collective
    of their own launched with DDP's first bucket.
    """

    def _init_slots(
        self, *, cheap: bool, control_slots: int, flag: bool, rank: int, world_size: int
    ) -> int:
        """Lay the slots out; return how many elements they take. ``cheap``: the slots are read
        back without a device sync (a CPU tensor), which control slots and the flag need."""
        self.rank, self.world_size = rank, world_size
        self.control_capacity = 0
        """Control slots available (0 when the slots do not live on the CPU)."""
        self.has_flag = False
        """Whether :meth:`raise_flag` reaches the other ranks (slots on the CPU carry it)."""
        if cheap and (control_slots or flag):
            self.control_capacity, self.has_flag = control_slots, flag
        self._head = 3 + self.has_flag + self.control_capacity
        self._cpu_carrier = cheap
        self._outgoing: ControlValues = None
        self._received: list[int] | None = None
        self._flag_out = False
        self._flag_seen = False
        self._armed: dict[str, Any] | None = None
        """What :meth:`arm` set up for the iteration's reduction (None: nothing armed)."""
        self._on_launch: Callable[[], None] | None = None
        return 1 + self._head + 2 * world_size

    def _bind_slots(self, slots: torch.Tensor) -> None:
        """Where the slots live: ``slots`` holds the loss, then the statistics."""
        self._loss_slot = slots[:1]
        self._stats = slots[1:]
        """count, stop, withdraw, [flag], control..., then the checksums: read back in one
        copy."""

    def arm(
        self,
        loss_sum: torch.Tensor | None,
        count: float | torch.Tensor = 0.0,
        *,
        stop: bool = False,
        withdraw: bool = False,
        checksum: Checksum | None = None,
        read: bool = True,
        on_launch: Callable[[], None] | None = None,
    ) -> None:
        """What the iteration's reduction carries (see :meth:`GradientSync.reduce`);
        ``on_launch`` runs just before the gradients leave this rank."""
        self._armed = {
            "loss_sum": loss_sum,
            "count": count,
            "stop": stop,
            "withdraw": withdraw,
            "checksum": checksum,
            "read": read,
        }
        self._on_launch = on_launch

    def _disarm(self) -> dict[str, Any]:
        """What :meth:`arm` set up, taken once (for :meth:`collect`)."""
        armed, self._armed = self._armed, None
        if armed is None:
            raise RuntimeError("collect() without arm()")
        return armed

    def launch(self) -> None:
        """The last pass's backward is done: run ``on_launch`` (an emulated device pads its
        compute there)."""
        on_launch, self._on_launch = self._on_launch, None
        if on_launch is not None:
            on_launch()

    def _read(self, read: bool, checksums: bool) -> list[float] | None:
        """The summed statistics, read back when asked, always from the CPU, and with the
        checksum slots when they were sent; None otherwise (a GPU not waited for)."""
        if not (read or self._cpu_carrier or checksums):
            return None
        return (self._stats if checksums else self._stats[: self._head]).tolist()

    def _scale(self, stats: list[float] | None) -> float | torch.Tensor:
        """1 / the summed count (0 when nothing was counted), from the statistics read back,
        or on the device without waiting for it."""
        if stats is not None:
            return 1.0 / stats[0] if stats[0] > 0 else 0.0
        total = self._stats[:1]
        return torch.where(total > 0, 1.0 / total, torch.zeros_like(total))

    # --------------------------------------------------------------- control and flag

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
    def reads_back_cheaply(self) -> bool:
        """Whether the statistics can be read every iteration without a device sync."""
        return self._cpu_carrier

    def _fill(
        self,
        loss_sum: torch.Tensor | None,
        count: float | torch.Tensor,
        stop: bool,
        withdraw: bool,
        checksum: Checksum | None,
    ) -> None:
        if loss_sum is None:
            self._loss_slot.zero_()
        else:
            self._loss_slot.copy_(loss_sum.detach().reshape(1))
        self._stats.zero_()
        if isinstance(count, torch.Tensor):
            self._stats[:1].copy_(count.detach().reshape(1))
        elif count:
            self._stats[0] = float(count)
        if stop:
            self._stats[1] = 1.0
        if withdraw:
            self._stats[2] = 1.0
        if self.has_flag:
            self._stats[3] = 1.0 if self._flag_out else 0.0
            self._flag_out = False
        if self.control_capacity:
            outgoing, self._outgoing = self._outgoing, None
            if callable(outgoing):
                outgoing = outgoing()
                if outgoing is not None:
                    self._check_control(outgoing)
            if outgoing:
                at = 3 + self.has_flag
                values = torch.tensor(outgoing, dtype=self._stats.dtype)
                self._stats[at : at + len(outgoing)] = values
        if checksum is not None:
            at = self._head + 2 * self.rank
            self._stats[at] = checksum[0]
            self._stats[at + 1] = checksum[1]

    def _take(self, stats: list[float] | None) -> Reduced:
        checks = None
        if stats is not None:
            if self.has_flag:
                self._flag_seen = stats[3] > 0.5
            if self.control_capacity:
                at = 3 + self.has_flag
                self._received = [round(v) for v in stats[at : at + self.control_capacity]]
            slots = stats[self._head :]
            checks = {
                r: (slots[2 * r], slots[2 * r + 1])
                for r in range(len(slots) // 2)
                if slots[2 * r + 1] != 0.0
            }
        return Reduced(
            loss=self._loss_slot,
            count=self._stats[:1],
            stop=None if stats is None else stats[1] > 0.5,
            withdrawn=None if stats is None else stats[2] > 0.5,
            checksums=checks or None,
        )


class GradientSync(SlotChannel):
    """Owns the gradient buffers of a set of parameters and all-reduces them exactly.

    Use it in place of ``optimizer.zero_grad()`` and DDP::

        sync = GradientSync(model.parameters())
        loss_sum.backward()            # skipped on a rank with 0 samples
        reduced = sync.reduce(loss_sum, count=local_samples)
        optimizer.step()
        sync.zero_grad()

    If something replaces ``param.grad`` (``optimizer.zero_grad(set_to_none=True)``, a user
    assignment), the next reduction copies it back into the buffer and rebinds the view, so
    results stay right; only the zero-copy property is lost for that iteration.

    ``rank`` and ``world_size`` place this rank's checksum slots; ``group`` may be any subgroup
    of that world.
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
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.group = group  # (the setter)
        self.exchange: Exchange = exchange
        """``auto``: the direct exchange for small CPU buffers on gloo, else ``all_reduce``."""
        self.direct_max_elements = direct_max_elements
        self.last_method: str = ""
        """How the last reduction summed its (last) buffer: "all_reduce", "direct" or "local"
        (no process group)."""
        by_key: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
        for p in params:
            if p.requires_grad:
                by_key.setdefault((p.device, p.dtype), []).append(p)
        if not by_key:
            raise ValueError("no parameters require gradients")
        keys = list(by_key)
        carrier = _carrier(keys)
        on_cpu = carrier is not None and keys[carrier][0].type == "cpu"
        tail = self._init_slots(
            cheap=on_cpu,
            control_slots=control_slots,
            flag=flag,
            rank=rank,
            world_size=world_size,
        )
        self._buckets: list[_Bucket] = []
        for i, key in enumerate(keys):
            self._buckets.append(_bucket(key, by_key[key], tail if i == carrier else 0))
        if carrier is None:  # 16-bit gradients only: the statistics get a float32 buffer
            device = keys[0][0]
            flat = torch.zeros(tail, device=device, dtype=torch.float32)
            self._buckets.append(_Bucket(flat, [], [], flat[:1]))
            carrier = len(self._buckets) - 1
        flat = self._buckets[carrier].flat
        self._bind_slots(flat[flat.numel() - tail :])
        self._cpu_carrier = flat.device.type == "cpu"  # (16-bit models: read, no control)

    @property
    def numel(self) -> int:
        """Elements all-reduced per iteration (gradients, statistics and control slots)."""
        return sum(b.flat.numel() for b in self._buckets)

    def zero_grad(self) -> None:
        """Zero the buffers (and so every ``param.grad``) in place."""
        for b in self._buckets:
            b.flat.zero_()
            self._rebind(b, copy=False)

    def attach(self) -> None:
        """Make each ``param.grad`` that was set to None (``zero_grad()``'s default) its zeroed
        buffer view again, before a backward: autograd then accumulates into the buffer, with
        no allocation and no copy at the reduction."""
        for b in self._buckets:
            for p, view in zip(b.params, b.views, strict=True):
                if p.grad is None:
                    view.zero_()
                    p.grad = view

    def detached(self) -> list[str]:
        """Shapes of the parameters whose gradient is None now (zeroed with set_to_none)."""
        return [str(tuple(p.shape)) for b in self._buckets for p in b.params if p.grad is None]

    # --------------------------------------------------------------------- reduction

    def all_reduce(self, global_count: int, loss_sum: torch.Tensor | None = None) -> torch.Tensor:
        """Sum gradients over ranks, scale by ``1/global_count`` (known to every rank); return
        the global mean loss. ``loss_sum`` is this rank's summed loss (``None`` with 0 samples).
        """
        if global_count < 1:
            raise ValueError("global_count must be at least 1")
        return self.reduce(loss_sum, global_count=global_count).loss

    def reduce(
        self,
        loss_sum: torch.Tensor | None,
        count: float | torch.Tensor = 0.0,
        *,
        global_count: int | None = None,
        stop: bool = False,
        withdraw: bool = False,
        checksum: Checksum | None = None,
        read: bool = True,
    ) -> Reduced:
        """Sum gradients, losses and counts over the group; divide gradients and loss by the
        summed count (or by ``global_count`` when every rank knows it).

        ``stop`` asks every rank to stop; ``withdraw`` says this rank left the loop (it sends
        no gradients); ``checksum`` sends this rank's parameter checksum.
        ``read`` reads the statistics back (stop, checksums); it always happens on a CPU
        carrier, and on a GPU it waits for the device, so the caller asks only now and then.
        """
        for b in self._buckets:
            self._rebind(b, copy=True)
        self._fill(loss_sum, count, stop, withdraw, checksum)
        for b in self._buckets:
            self._sum(b.flat)
        stats = self._read(read, checksum is not None)  # the checksum slots only when sent
        scale = 1.0 / global_count if global_count is not None else self._scale(stats)
        for b in self._buckets:
            if isinstance(scale, torch.Tensor):
                b.scaled.mul_(scale.to(b.flat.device, b.flat.dtype))
            else:
                b.scaled.mul_(scale)
        return self._take(stats)

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group gradients are summed over (``None``: the default group)."""
        return self._group

    @group.setter
    def group(self, group: dist.ProcessGroup | None) -> None:
        self._group = group
        self._peers: tuple[int, bool] | None = None
        """(group size, gloo backend), read from torch.distributed once per group."""

    # ------------------------------------------------- the runtime's steps (as OverlapSync)

    @property
    def overlaps(self) -> bool:
        """Whether gradients are summed during backward (no: once, after it)."""
        return False

    @property
    def withdraws(self) -> bool:
        """A rank that leaves its loop can join the others' all-reduce with a withdrawal."""
        return True

    def expect(self, sync: bool) -> None:
        """(Passes accumulate into the buffers; nothing to set before a forward.)"""

    def backward_empty(self) -> None:
        """(A pass without samples adds nothing to the buffers.)"""

    def collect(self) -> Reduced:
        """Sum what :meth:`arm` set up (see :meth:`reduce`)."""
        armed = self._disarm()
        loss_sum = armed.pop("loss_sum")
        return self.reduce(loss_sum, **armed)

    def discard(self) -> None:
        """Drop a failed attempt's partial gradients (out of memory): the share is redone."""
        self._armed = None
        self.zero_grad()

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


def _carrier(keys: list[tuple[torch.device, torch.dtype]]) -> int | None:
    """The bucket whose tail carries the statistics: the first float32/float64 one, on the CPU
    if there is one there (its slots are read back without a device sync); None when all
    gradients are 16-bit."""
    wide = [i for i, (_, dtype) in enumerate(keys) if dtype in (torch.float32, torch.float64)]
    cpu = [i for i in wide if keys[i][0].type == "cpu"]
    return (cpu or wide)[0] if wide else None


def _bucket(
    key: tuple[torch.device, torch.dtype], params: list[nn.Parameter], tail: int
) -> _Bucket:
    """One flat gradient buffer for ``params``, ``tail`` slots after them; every ``.grad``
    becomes a view into it (keeping what it held)."""
    device, dtype = key
    n = sum(p.numel() for p in params)
    flat = torch.zeros(n + tail, device=device, dtype=dtype)
    views = []
    offset = 0
    for p in params:
        view = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
        if p.grad is not None:
            view.copy_(p.grad)
        p.grad = view
        views.append(view)
    # Gradients and the loss slot (the first of the tail) are divided by the count.
    return _Bucket(flat, params, views, flat[: n + (1 if tail else 0)])


def parameter_checksum(params: Iterable[torch.Tensor]) -> Checksum:
    """(sum, sum of magnitudes) of every parameter, in float64: equal on ranks that hold equal
    parameters; the magnitudes scale the tolerance two ranks' sums are compared with."""
    total = magnitude = None
    with torch.no_grad():
        for p in params:
            s = p.sum(dtype=torch.float64)
            a = p.abs().sum(dtype=torch.float64)
            total = s if total is None else total + s
            magnitude = a if magnitude is None else magnitude + a
    if total is None or magnitude is None:
        return 0.0, 0.0
    return float(total), float(magnitude)


def broadcast_module(
    module: nn.Module, src: int = 0, group: dist.ProcessGroup | None = None
) -> None:
    """Make every rank's parameters and buffers equal to rank ``src``'s (once, at start)."""
    if not dist.is_initialized():
        return
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=src, group=group)
