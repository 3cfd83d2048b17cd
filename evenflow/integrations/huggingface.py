"""The Hugging Face ``Trainer`` under Evenflow: ``EvenflowTrainer(ctx, ...)`` in place of ``Trainer``.

::

    trainer = EvenflowTrainer(                                 # was: Trainer(
        ctx,                                                   # the job's context
        model=model,
        args=TrainingArguments(output_dir=..., max_grad_norm=1.0, lr_scheduler_type="cosine",
                               warmup_steps=2, logging_steps=5, save_steps=100),
        train_dataset=train_set,
        data_collator=collate,
    )
    trainer.train()

The Trainer's loop, callbacks, optimizer and scheduler creation, clipping, bf16 autocast,
logging and ``save_steps`` checkpoints are kept. What changes underneath:

- The accelerator is :class:`~evenflow.integrations.accelerate.EvenflowAccelerator`: the model
  and optimizer go through ``ctx.prepare`` (the job's engine; no second DDP wrapper).
- The training data is iterated by ``ctx.batches``: each optimizer step is one Evenflow
  iteration, this rank's share of the job's ``global_batch`` (several passes when the share is
  above the rank's memory cap: ``training_step`` back-propagates each).
- The loss is normalised exactly over the global batch: each pass's loss is computed with
  ``num_items_in_batch`` set to the pass's own target count ``n`` (real target tokens: labels
  other than -100, shifted for a causal LM; rows when there are no labels), multiplied back by
  ``n`` to a sum, and given to ``ctx.backward(sum, count=n)``, which divides by every rank's
  ``n`` together (the count only the all-reduce knows). The gradient is that of the mean over
  every real target token of the global batch, as one process on that batch computes it.
- ``max_steps`` is the job's length (``ctx.total_iterations``); logs reach the job's metrics
  through ``ctx.log`` on rank 0 (``loss`` is the runtime's own name there: the Trainer's
  ``loss`` is logged as ``train_loss``, the end-of-training summary's ``train_loss`` as
  ``train_loss_mean``); rank 0 writes the Trainer's ``save_steps`` checkpoints; the job's own
  checkpoints (spec ``checkpoint:``) carry the Trainer's step and its scheduler, so an Evenflow
  restart resumes where the job's checkpoint was.

Refused at start, with what Evenflow does instead (:class:`IntegrationError`): versions outside
``transformers>=4.50,<6`` / ``accelerate>=1.0,<2``; ``gradient_accumulation_steps != 1``;
``per_device_train_batch_size`` other than its default (8) or ``global_batch / workers``;
a ``max_steps`` other than the job's length; DeepSpeed, FSDP or ``fp16``; evaluation during
training (``eval_strategy``); ``auto_find_batch_size``; a spec whose plan may exclude ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import Trainer, TrainingArguments

from evenflow.integrations._common import IntegrationError, check_spec, check_version
from evenflow.integrations.accelerate import EvenflowAccelerator

__all__ = ["EvenflowTrainer", "check_arguments", "metric_name"]

DEFAULT_PER_DEVICE = TrainingArguments.__dataclass_fields__["per_device_train_batch_size"].default


def metric_name(key: str, summary: bool) -> str:
    """The job metric a Trainer log key goes to (``loss`` is the runtime's reserved name)."""
    if key == "loss":
        return "train_loss"
    if summary and key == "train_loss":
        return "train_loss_mean"
    return key


def check_arguments(ctx: Any, args: TrainingArguments) -> None:
    """Refuse ``TrainingArguments`` that conflict with Evenflow's plan (said with what to do)."""
    spec = ctx.spec
    if args.gradient_accumulation_steps != 1:
        raise IntegrationError(
            f"gradient_accumulation_steps={args.gradient_accumulation_steps}: Evenflow gives "
            "each rank its share of the spec's global_batch every step and splits a share "
            "above the rank's memory cap into passes itself: leave it at 1 and set the spec's "
            "global_batch to the batch of one optimizer step"
        )
    even = spec.global_batch // spec.workers if spec.global_batch % spec.workers == 0 else None
    per_device = args.per_device_train_batch_size
    if per_device not in (DEFAULT_PER_DEVICE, even):
        raise IntegrationError(
            f"per_device_train_batch_size={per_device} with {spec.workers} workers makes a "
            f"global batch of {per_device * spec.workers}, but the job's global_batch is "
            f"{spec.global_batch}: Evenflow sizes each rank's batch from its plan (unequal "
            "shares of global_batch on unequal devices), so leave per_device_train_batch_size "
            f"out{f' (or set it to {even})' if even else ''}, and set the batch in the spec's "
            "global_batch"
        )
    if args.deepspeed or args.fsdp or args.fsdp_config not in (None, {}, {"xla": False}):
        raise IntegrationError(
            "DeepSpeed and FSDP arguments (deepspeed=, fsdp=, fsdp_config=): Evenflow owns the "
            "model's distribution by the spec's `engine` (ddp: an exact all-reduce; fsdp: "
            "FSDP2 sharding): drop them and set `engine: fsdp` in the job spec to shard"
        )
    if args.fp16:
        raise IntegrationError(
            "fp16=True is not supported under Evenflow (its loss scaling is not wired into the "
            "exact all-reduce): use bf16=True"
        )
    if str(getattr(args.eval_strategy, "value", args.eval_strategy)) != "no":
        raise IntegrationError(
            "evaluation during training (eval_strategy) is not supported by EvenflowTrainer: "
            "set eval_strategy='no' and evaluate after trainer.train() (the model is the same "
            "on every rank), e.g. on rank 0 or split with ctx.shard"
        )
    if args.auto_find_batch_size:
        raise IntegrationError(
            "auto_find_batch_size: Evenflow sizes each rank's batch from its plan and measured "
            "memory (a share above the cap comes as passes): drop it"
        )


class _Step(dict[str, Any]):
    """One Evenflow iteration as the Trainer sees one batch: this rank's first pass, and the
    iterator that yields the iteration's further passes (``training_step`` takes them)."""

    def __init__(self, first: Any, passes: Iterator[Any]) -> None:
        super().__init__(first)
        self.passes = passes
        self.flops = 0.0


class _Iterations:
    """The Trainer's training "DataLoader": one :class:`_Step` per iteration of the job."""

    def __init__(self, ctx: Any, loader: DataLoader[Any]) -> None:
        self.ctx, self.loader = ctx, loader
        self.dataset = loader.dataset
        self.batch_size = loader.batch_size

    def __iter__(self) -> Iterator[_Step]:
        passes = iter(self.ctx.batches(self.loader))
        for first in passes:
            yield _Step(first, passes)

    def __len__(self) -> int:
        return int(self.ctx.total_iterations(self.loader))


class EvenflowTrainer(Trainer):
    """``transformers.Trainer`` driven by the Evenflow context (see the module docstring)."""

    def __init__(self, ctx: Any, *, args: TrainingArguments, **kwargs: Any) -> None:
        check_version("transformers")
        check_version("accelerate")
        check_spec(ctx, "The Hugging Face Trainer")
        check_arguments(ctx, args)
        total = int(ctx.total_iterations(kwargs.get("train_dataset")))
        if args.max_steps > 0 and args.max_steps != total:
            raise IntegrationError(
                f"max_steps={args.max_steps}, but the job runs {total} iterations (its spec's "
                "iterations or epochs): each optimizer step is one Evenflow iteration, so leave "
                "max_steps out (it is set to the job's length) and give the length in the spec"
            )
        self.ctx = ctx
        args.max_steps = total
        args.average_tokens_across_devices = False  # the context normalises over every rank
        if ctx.spec.engine == "fsdp":  # the optimizer's state stays sharded: the job's checkpoints
            args.save_only_model = True
        args.__class__ = _rank_view(type(args), ctx)
        self._hooked = False
        self._logged: tuple[int, set[str]] = (-1, set())
        super().__init__(args=args, **kwargs)

    # ------------------------------------------------------------------ set-up overrides

    def create_accelerator_and_postprocess(self) -> None:
        self.accelerator = EvenflowAccelerator(
            self.ctx, mixed_precision="bf16" if self.args.bf16 else "no"
        )
        self.gather_function = self.accelerator.gather_for_metrics
        self.is_deepspeed_enabled = False
        self.is_fsdp_enabled = False

    def get_train_dataloader(self) -> Any:
        if self.train_dataset is None:
            raise ValueError("EvenflowTrainer: training requires a train_dataset.")
        loader: DataLoader[Any] = DataLoader(
            self.train_dataset,
            batch_size=self._train_batch_size,  # replaced by the plan's share
            shuffle=True,  # replaced by the job's seeded permutation
            collate_fn=self._get_collator_with_removed_columns(self.data_collator, "training"),
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
            drop_last=self.args.dataloader_drop_last,
        )
        self.accelerator._train_loader = loader  # any further DataLoader: evaluation shards
        return _Iterations(self.ctx, loader)

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if not self._hooked:  # before ctx.batches(): restored from the job's checkpoint
            self.ctx.on_checkpoint("hf_trainer", self._checkpoint_state, self._restore)
            self._hooked = True
        return scheduler

    def _checkpoint_state(self) -> dict[str, Any]:
        return {
            "global_step": self.state.global_step,
            "lr_scheduler": self._scheduler().state_dict(),
            "total_flos": self.state.total_flos,
        }

    def _restore(self, saved: dict[str, Any]) -> None:
        self.state.global_step = self._initial_global_step = saved["global_step"]
        self._globalstep_last_logged = saved["global_step"]
        self.state.total_flos = saved["total_flos"]
        self._scheduler().load_state_dict(saved["lr_scheduler"])

    def _scheduler(self) -> Any:
        if self.lr_scheduler is None:
            raise RuntimeError("the Trainer has no scheduler yet")
        return self.lr_scheduler

    # -------------------------------------------------------------------- the step itself

    def _get_num_items_in_batch(self, batch_samples: list[Any], device: torch.device) -> Any:
        return None  # counted per pass in training_step, summed over the ranks by the context

    def _target_count(self, inputs: dict[str, Any]) -> torch.Tensor:
        """What this pass's loss is a mean over: its real target tokens (labels != -100,
        shifted for a causal LM), else its rows."""
        if "shift_labels" in inputs:
            labels = inputs["shift_labels"]
        elif "labels" in inputs:
            labels = inputs["labels"]
            if getattr(self, "_loss_shifts_labels", False):
                labels = labels[..., 1:]
        else:
            rows = next(v.shape[0] for v in inputs.values() if isinstance(v, torch.Tensor))
            return torch.tensor(rows, device=self.args.device)
        count: torch.Tensor = labels.ne(-100).sum()
        return count

    def training_step(
        self, model: Any, inputs: Any, num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """Forward and ``ctx.backward`` of every pass of this iteration; returns the global
        mean loss (exact, from the all-reduce) for the Trainer's logs."""
        model.train()
        optimizer: Any = self.optimizer
        if hasattr(optimizer, "train") and callable(optimizer.train):
            optimizer.train()
        batch: dict[str, Any] = dict(inputs)
        local_sum, local_count, value = 0.0, 0.0, None
        while True:
            # a pass that runs out of device memory is redone by ctx.batches in smaller passes
            with self.ctx.recoverable():
                prepared = self._prepare_inputs(batch)
                n = self._target_count(prepared)
                with self.compute_loss_context_manager():
                    loss: Any = self.compute_loss(
                        model, prepared, num_items_in_batch=n.clamp(min=1)
                    )
                summed = torch.where(n > 0, loss * n, torch.zeros_like(loss))
                value = self.ctx.backward(summed, count=n)
                local_sum += float(summed.detach())
                local_count += float(n)
            if isinstance(inputs, _Step):
                inputs.flops += float(super().floating_point_ops(batch))
            if self.ctx.sync_gradients or not isinstance(inputs, _Step):
                break
            batch = dict(next(inputs.passes))  # the iteration's next pass
        if value is None:  # not read this iteration: this rank's own mean
            value = local_sum / local_count if local_count else 0.0
        return torch.tensor(float(value), device=self.args.device)

    def floating_point_ops(self, inputs: Any) -> int:
        return int(getattr(inputs, "flops", 0))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Under ``engine: fsdp`` every rank gathers the whole model (a collective), rank 0
        writes it; otherwise the Trainer's own (rank 0 writes)."""
        if self.ctx.spec.engine != "fsdp":
            return super().save_model(output_dir, _internal_call)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        model: Any = self.model
        full = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self.args.should_save:
            self._save(output_dir or self.args.output_dir, state_dict=full)

    # ------------------------------------------------------------------------------ logs

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        super().log(logs, start_time)
        if self.ctx.rank != 0:
            return
        iteration = self.ctx._batch_iteration
        if self._logged[0] != iteration:
            self._logged = (iteration, set())
        summary = "train_runtime" in logs
        for key, value in logs.items():
            name = metric_name(key, summary)
            if not isinstance(value, int | float) or not math.isfinite(value):
                continue
            if name in self._logged[1]:
                continue  # a second value in one iteration (the summary's epoch): first kept
            self._logged[1].add(name)
            self.ctx.log(name, float(value))


def _rank_view(cls: type[TrainingArguments], ctx: Any) -> type[TrainingArguments]:
    """``TrainingArguments`` that see the job's ranks: rank 0 logs and saves (the Trainer's
    own view is one process, since Evenflow, not Accelerate, spans the ranks)."""

    def index(self: Any) -> int:
        return int(ctx.rank)

    def size(self: Any) -> int:
        return int(ctx.world_size)

    def reduce(self: Any, protocol: Any) -> Any:  # pickled (training_args.bin) as the user's class
        return _rebuild, (cls, dict(self.__dict__))

    return type(
        f"Evenflow{cls.__name__}",
        (cls,),
        {
            "process_index": property(index),
            "local_process_index": property(index),
            "world_size": property(size),
            "__reduce_ex__": reduce,
        },
    )


def _rebuild(cls: type[TrainingArguments], state: dict[str, Any]) -> TrainingArguments:
    args = cls.__new__(cls)
    args.__dict__.update(state)
    return args
