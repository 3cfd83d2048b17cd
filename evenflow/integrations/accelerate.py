"""An Accelerate loop under Evenflow: ``EvenflowAccelerator(ctx)`` in place of ``Accelerator()``.

A plain ``Accelerator().prepare`` inside an Evenflow job would wrap the model in a second
DistributedDataParallel (gradients reduced twice) and shard the data its own way (equal batches:
a rank with a 0-sample share would hang); the runtime refuses it at ``prepare``
(:mod:`agent.runtime.guards`). ``EvenflowAccelerator`` keeps Accelerate's loop and routes it
through the runtime's context::

    accelerator = EvenflowAccelerator(ctx)                     # was: Accelerator()
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    for batch in loader:                                       # this rank's share (the plan's)
        loss = loss_fn(model(batch))                           # a MEAN, as Accelerate wants
        accelerator.backward(loss)                             # count=tokens for a per-token mean
        if accelerator.sync_gradients:                         # after the one all-reduce
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step(); sched.step(); opt.zero_grad()

- ``prepare``: the model and optimizer go through ``ctx.prepare`` (device, rank 0's weights, the
  job's engine: DDP-style all-reduce or FSDP sharding); the first DataLoader is the training
  data, iterated by ``ctx.batches`` (the plan's share of each global batch, its collate and
  workers kept); any further DataLoader is an evaluation set split over the ranks
  (``ctx.shard``: every item once, combine with ``reduce``); a scheduler is returned as it is
  and registered in the job's checkpoints (step it once per optimizer step).
- ``backward(loss, count=None)``: ``loss`` is a mean, as in any Accelerate loop, over ``count``
  items (default: the samples of the batch); it becomes ``ctx.backward(loss * count,
  count=count)``, so the gradient is the mean over every rank's items (exact for unequal
  shares; a per-token loss passes its number of real target tokens).
- ``sync_gradients`` is ``ctx.sync_gradients`` (true after an iteration's last pass);
  ``clip_grad_norm_`` clips the synchronised gradients; ``gather``/``reduce`` and
  ``wait_for_everyone`` go through ``ctx.all_reduce``; ``num_processes``, ``process_index``,
  ``is_main_process`` and ``device`` come from the context.

Refused at construction, with what Evenflow does instead: an Accelerate version outside
``accelerate>=1.0,<2``, ``gradient_accumulation_steps`` other than 1 (a share larger than the
memory cap already comes as several passes), a DeepSpeed, FSDP or Megatron plugin (the job's
``engine`` shards), ``fp16``/``fp8`` mixed precision (``bf16`` works: no loss scaling) and a job
whose spec lets the plan exclude ranks (``policy: {exclude: false}``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader

from evenflow.integrations._common import IntegrationError, check_spec, check_version

__all__ = ["EvenflowAccelerator", "ShareLoader"]


class ShareLoader:
    """The training DataLoader as ``ctx.batches`` iterates it: each iteration this rank's share
    of the global batch (several batches when the share comes in passes). ``len`` is the job's
    iterations."""

    def __init__(self, ctx: Any, loader: DataLoader[Any]) -> None:
        self.ctx, self.loader = ctx, loader
        self.dataset = loader.dataset
        self.batch_size = loader.batch_size

    def __iter__(self) -> Iterator[Any]:
        return iter(self.ctx.batches(self.loader))

    def __len__(self) -> int:
        return int(self.ctx.total_iterations(self.loader))


class _EvalShards:
    """An evaluation DataLoader over this rank's part of the dataset (``ctx.shard``), made when
    iterated (the ranks in the loop are known then)."""

    def __init__(self, ctx: Any, loader: DataLoader[Any]) -> None:
        self.ctx, self.loader = ctx, loader
        self.dataset = loader.dataset
        self.batch_size = loader.batch_size

    def __iter__(self) -> Iterator[Any]:
        l = self.loader  # noqa: E741
        part = self.ctx.shard(l.dataset)
        return iter(
            DataLoader(
                part,
                batch_size=l.batch_size,
                collate_fn=l.collate_fn,
                num_workers=l.num_workers,
                drop_last=l.drop_last,
            )
        )


def _refuse(kwargs: dict[str, Any]) -> None:
    steps = kwargs.get("gradient_accumulation_steps", 1)
    plugin = kwargs.get("gradient_accumulation_plugin")
    if plugin is not None:
        steps = max(steps, getattr(plugin, "num_steps", 1) or 1)
    if steps != 1:
        raise IntegrationError(
            f"gradient_accumulation_steps={steps}: Evenflow sizes each rank's batch from its plan "
            "and splits a share larger than the rank's memory cap into passes itself (the "
            "gradients of one iteration always cover the job's whole global_batch): leave it at "
            "1 and set the spec's global_batch to the batch you want per optimizer step"
        )
    for name in ("deepspeed_plugin", "deepspeed_plugins", "fsdp_plugin", "megatron_lm_plugin"):
        if kwargs.get(name) is not None:
            raise IntegrationError(
                f"{name}: Evenflow owns the model's distribution, by the job spec's `engine` "
                "(ddp: whole replicas, one exact all-reduce; fsdp: FSDP2 sharding): drop the "
                "plugin and set `engine: fsdp` in the spec to shard"
            )
    precision = str(kwargs.get("mixed_precision") or "no")
    if precision not in ("no", "bf16"):
        raise IntegrationError(
            f"mixed_precision={precision!r} is not supported under Evenflow (fp16's loss scaling "
            "is not wired into its exact all-reduce): use mixed_precision='bf16' or 'no'"
        )


class EvenflowAccelerator(Accelerator):  # type: ignore[misc]
    """``accelerate.Accelerator`` whose ``prepare``, ``backward`` and collectives are the
    Evenflow context's (see the module docstring). It starts no process group and wraps no
    model in DDP: the runtime has done the one and does the other."""

    evenflow_aware = True
    """What :mod:`agent.runtime.guards` looks for: this accelerator's ``prepare`` is allowed."""

    def __init__(self, ctx: Any, **kwargs: Any) -> None:
        check_version("accelerate")
        check_spec(ctx, "Accelerate")
        _refuse(kwargs)
        kwargs.pop("gradient_accumulation_steps", None)
        self.ctx = ctx  # first: Accelerator's own __init__ reads the properties below
        super().__init__(**kwargs)
        self._train_loader: Any = None
        self._prepared_model: nn.Module | None = None
        self._schedulers = 0

    # ------------------------------------------------------------- who and where (from ctx)

    @property
    def num_processes(self) -> int:
        return int(self.ctx.world_size)

    @property
    def process_index(self) -> int:
        return int(self.ctx.rank)

    @property
    def local_process_index(self) -> int:
        return int(self.ctx.rank)

    @property
    def is_main_process(self) -> bool:
        return bool(self.ctx.rank == 0)

    @property
    def is_local_main_process(self) -> bool:
        return bool(self.ctx.rank == 0)

    @property
    def is_last_process(self) -> bool:
        return bool(self.ctx.rank == self.ctx.world_size - 1)

    @property
    def use_distributed(self) -> bool:
        return bool(self.ctx.world_size > 1)

    @property
    def device(self) -> torch.device:
        return self.ctx.device  # type: ignore[no-any-return]

    @property
    def sync_gradients(self) -> bool:
        return bool(self.ctx.sync_gradients)

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        """Ignored: the context knows when an iteration's gradients are all-reduced."""

    # ------------------------------------------------------------------------- prepare

    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        """Route each object to the context (see the module docstring); same order back."""
        model = next((a for a in args if isinstance(a, nn.Module)), None)
        optimizer = next((a for a in args if isinstance(a, torch.optim.Optimizer)), None)
        if sum(isinstance(a, nn.Module) for a in args) > 1:
            raise IntegrationError("EvenflowAccelerator prepares one model per job")
        out: list[Any] = []
        for a in args:
            if isinstance(a, nn.Module):
                out.append(self._prepare_model(a, optimizer))
            elif isinstance(a, torch.optim.Optimizer):
                out.append(self._prepare_optimizer(a, model))
            elif isinstance(a, DataLoader):
                out.append(self._prepare_loader(a))
            elif isinstance(a, torch.optim.lr_scheduler.LRScheduler):
                self.ctx.register_state(f"accelerate.scheduler.{self._schedulers}", a)
                self._schedulers += 1
                out.append(a)
            else:
                out.append(a)
        return out[0] if len(out) == 1 else tuple(out)

    def _prepare_model(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> nn.Module:
        if self._prepared_model is not None:
            raise IntegrationError("EvenflowAccelerator prepares one model per job")
        if optimizer is None:
            raise IntegrationError(
                "EvenflowAccelerator.prepare needs the model and its optimizer in the same call "
                "(Evenflow moves and shards them together): prepare(model, optimizer, ...)"
            )
        wrapped, _ = self.ctx.prepare(model, optimizer)
        if self.native_amp:  # bf16: the forward under autocast, as Accelerate's prepare does
            inner = wrapped.forward

            def forward(*a: Any, **k: Any) -> Any:
                with self.autocast():
                    return inner(*a, **k)

            wrapped.forward = forward
        self._prepared_model = wrapped
        self._models.append(wrapped)
        return wrapped  # type: ignore[no-any-return]

    def _prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, model: nn.Module | None
    ) -> torch.optim.Optimizer:
        if model is None and self.ctx.optimizer is not optimizer:
            raise IntegrationError(
                "EvenflowAccelerator.prepare needs the model and its optimizer in the same call "
                "(Evenflow moves and shards them together): prepare(model, optimizer, ...)"
            )
        self._optimizers.append(optimizer)
        return optimizer

    def _prepare_loader(self, loader: DataLoader[Any]) -> Any:
        if self._train_loader is None:
            self._train_loader = ShareLoader(self.ctx, loader)
            self._dataloaders.append(self._train_loader)
            return self._train_loader
        return _EvalShards(self.ctx, loader)

    # -------------------------------------------------------------------------- training

    def backward(self, loss: torch.Tensor, count: Any = None, **kwargs: Any) -> Any:
        """Back-propagate a MEAN loss over ``count`` items (default: this batch's samples) with
        exact global weighting: ``ctx.backward(loss * count, count=count)``. Returns the
        iteration's global mean loss after its last pass when the context read it, else
        None."""
        ctx = self.ctx
        if kwargs:
            raise IntegrationError(
                f"EvenflowAccelerator.backward takes no {sorted(kwargs)}: the context "
                "back-propagates and all-reduces each pass itself"
            )
        if not getattr(ctx, "_awaiting_backward", False):
            return ctx.backward(loss)  # raises the context's own message (outside the loop)
        n: Any = ctx._passes[ctx._pass] if count is None else count
        if isinstance(n, torch.Tensor):
            total = torch.where(n > 0, loss * n, torch.zeros_like(loss))
        else:
            total = loss * n if n > 0 else loss.nan_to_num(0.0) * 0.0
        return ctx.backward(total, count=n)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return False  # no loss scaling (bf16 or fp32): every step is taken

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        """Clip the all-reduced gradients (call it under ``if accelerator.sync_gradients:``);
        returns their total norm, the same on every rank."""
        if not self.ctx.sync_gradients:
            raise RuntimeError(
                "clip_grad_norm_ ran before this iteration's gradients were all-reduced: clip "
                "under `if accelerator.sync_gradients:` (after the last backward), or each rank "
                "would clip its own partial gradients"
            )
        return torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type)

    def gather(self, tensor: Any) -> Any:
        """Every rank's ``tensor`` (equal shapes), concatenated on dim 0 in rank order."""
        if isinstance(tensor, dict):
            return {k: self.gather(v) for k, v in tensor.items()}
        if isinstance(tensor, list | tuple):
            return type(tensor)(self.gather(v) for v in tensor)
        t = torch.as_tensor(tensor)
        world = self.num_processes
        slots = t.new_zeros((world, *t.shape))
        slots[self.process_index] = t
        summed = self.ctx.all_reduce(slots, "sum")
        return summed if t.dim() == 0 else summed.reshape(world * t.shape[0], *t.shape[1:])

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        return self.gather(input_data)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """``ctx.all_reduce`` (``sum`` or ``mean``) over the ranks, times ``scale``."""
        if isinstance(tensor, dict):
            return {k: self.reduce(v, reduction, scale) for k, v in tensor.items()}
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction must be 'sum' or 'mean', not {reduction!r}")
        return self.ctx.all_reduce(tensor, reduction) * scale

    def wait_for_everyone(self) -> None:
        """Every rank reaches this point (an all-reduce of nothing through the context)."""
        if self.ctx.world_size > 1:
            self.ctx.all_reduce(0.0)

    def no_sync(self, model: Any = None) -> Any:
        """A no-op: the context all-reduces only after an iteration's last pass anyway."""
        return contextlib.nullcontext()
