"""PyTorch Lightning under Evenflow: the user's ``LightningModule`` and ``LightningDataModule``
unchanged, the launch a Trainer built by :func:`trainer` (or ``L.Trainer(strategy=
EvenflowStrategy(ctx), ...)``) inside the job's entrypoint::

    from evenflow.integrations.lightning import trainer

    def train(ctx):                                   # the job's entrypoint
        t = trainer(ctx, gradient_clip_val=1.0, precision="bf16-mixed", callbacks=[...])
        t.fit(LitModel(), datamodule=MyData())
        ctx.save_final()

What the strategy does, in Lightning's own call order (``training_step`` -> ``zero_grad`` ->
``backward`` inside the optimizer's closure, then clipping and ``optimizer.step``):

- **Data**: the train DataLoader Lightning gets from the module or datamodule goes through
  ``ctx.batches`` (this rank's share of every global batch, sized by the plan; its dataset,
  ``collate_fn`` and workers kept, its ``batch_size`` and sampler replaced: the spec's
  ``global_batch`` rules). Lightning sees one epoch of the job at a time, so ``current_epoch``,
  epoch-interval schedulers and validation every epoch keep their meaning.
- **Model**: after ``configure_optimizers``, ``ctx.prepare(module, optimizer)`` (rank 0's weights
  everywhere; the job's gradient sync; under ``gradient_sync: overlap`` Lightning's forward goes
  through the DDP wrapper it returns, as Lightning's own DDP strategy does).
- **Loss**: ``training_step`` returns the mean over its local batch, Lightning's convention; the
  strategy back-propagates ``mean * n`` with ``count=n`` (``n`` this rank's samples), so the
  update is the one of the mean over the whole global batch, whatever the shares. A loss over
  other units (tokens) is returned as ``{"loss": mean_over_units, "count": units}``: the strategy
  back-propagates ``loss * count`` with that count, so a per-token mean over the global batch is
  exact too (plain Lightning ignores the extra key: the module stays valid without Evenflow).
- **Step**: the optimizer steps once per Evenflow iteration, after the all-reduce; Lightning's
  clipping (``gradient_clip_val``) runs on the all-reduced gradients. ``global_step`` and
  ``max_steps`` count iterations. A share above the rank's memory cap comes as several passes:
  the strategy runs the training step and backward of each inside the one Lightning step. A
  rank given 0 samples runs the step on an empty batch (0 rows), like the others.
- **Metrics**: :class:`EvenflowLogger` forwards ``self.log`` values (from rank 0, as Lightning's
  loggers do) to ``ctx.log``; ``loss`` (the name Evenflow keeps for the exact global loss)
  arrives as ``lightning.loss``, ``/`` in names as ``.``.
- **Checkpoints**: every Evenflow checkpoint carries Lightning's own checkpoint (loops, callbacks,
  schedulers, precision, datamodule and module hooks; the model and optimizer are Evenflow's) as
  of the ``on_train_batch_end`` of its iteration; a restarted job puts it back before the fit
  loop starts, as ``Trainer.fit(ckpt_path=...)`` would.

Refused at start, with what Evenflow does instead: a Lightning outside :data:`SUPPORTED`, a job
whose ``policy.exclude`` is true, ``accumulate_grad_batches`` other than 1, another strategy
(DeepSpeed, FSDP), ``devices``/``num_nodes``/``accelerator`` that disagree with the job, a
``max_steps``/``max_epochs`` other than the spec's length, fp16 with a gradient scaler, manual
optimization, several optimizers, ``limit_train_batches``, ``overfit_batches`` and reloading the
train DataLoader. See ``docs/guide/lightning.md``.
"""

from __future__ import annotations

import copy
import logging
import math
import re
from collections.abc import Callable, Iterator, Mapping
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as installed_version
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from agent.runtime.context import EvenflowContext, dataset_size
from agent.runtime.sampler import GlobalBatchSampler
from evenflow.integrations._common import IntegrationError, check_spec

SUPPORTED = ">=2.5,<2.7"
"""The Lightning versions this integration works with (pyproject's ``integrations`` extra)."""
_LOWEST, _BEYOND = (2, 5), (2, 7)

log = logging.getLogger("evenflow.integrations.lightning")


def check_version(found: str | None = None) -> None:
    """Refuse a Lightning outside :data:`SUPPORTED` (``found``: the version to judge, by default
    the installed one), naming the range."""
    if found is None:
        try:
            found = installed_version("lightning")
        except PackageNotFoundError:
            raise RuntimeError(
                f"evenflow.integrations.lightning needs lightning{SUPPORTED} (the 'lightning' "
                "package, `import lightning.pytorch as L`; pyproject's 'integrations' extra)"
            ) from None
    parts = re.match(r"(\d+)\.(\d+)", found)
    if parts is None or not _LOWEST <= (int(parts[1]), int(parts[2])) < _BEYOND:
        raise RuntimeError(
            f"evenflow.integrations.lightning supports lightning {SUPPORTED} (pyproject's "
            f"'integrations' extra); this environment has lightning {found}: install "
            f"'lightning{SUPPORTED}' on the job's hosts"
        )


check_version()

import lightning.pytorch as L  # noqa: E402  (after the version check: it names the range)
import lightning.pytorch.utilities.rank_zero as pl_rank_zero  # noqa: E402
import lightning_utilities.core.rank_zero as utils_rank_zero  # noqa: E402
from lightning.fabric.plugins.environments.cluster_environment import (  # noqa: E402
    ClusterEnvironment,
)
from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available  # noqa: E402
from lightning.pytorch.loggers import Logger  # noqa: E402
from lightning.pytorch.plugins.precision import (  # noqa: E402
    DoublePrecision,
    HalfPrecision,
    MixedPrecision,
    Precision,
)
from lightning.pytorch.strategies import ParallelStrategy  # noqa: E402
from lightning.pytorch.trainer.states import TrainerFn  # noqa: E402

__all__ = [
    "SUPPORTED",
    "EvenflowLogger",
    "EvenflowStrategy",
    "IntegrationError",
    "check_version",
    "trainer",
]

DATA_PARALLEL = {"auto", "ddp", "ddp_spawn", "ddp_fork", "ddp_notebook"}
"""Strategy names the helper takes as "data parallel": Evenflow is that, with its own shares."""

LOSS_NAME = "lightning.loss"
"""What a ``self.log("loss", ...)`` is charted as (``loss`` is the job's exact global loss)."""


def check_context(ctx: EvenflowContext) -> None:
    """The job's spec must let Lightning count its own steps."""
    check_spec(ctx, "Lightning")


# ----------------------------------------------------------------------------- the environment


class _Environment(ClusterEnvironment):
    """The job's ranks as Lightning asks for them (the processes are Evenflow's)."""

    def __init__(self, ctx: EvenflowContext) -> None:
        self._ctx = ctx

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "evenflow"

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return False

    def world_size(self) -> int:
        return self._ctx.world_size

    def set_world_size(self, size: int) -> None:
        pass

    def global_rank(self) -> int:
        return self._ctx.rank

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return self._ctx.rank


# ------------------------------------------------------------------------------------ metrics


def metric_name(key: str) -> str:
    """A Lightning metric's name as a job metric: ``loss`` -> ``lightning.loss``, ``/`` -> ``.``,
    anything else outside letters, digits and ``. _ : -`` -> ``_``."""
    if key == "loss":
        return LOSS_NAME
    name = re.sub(r"[^A-Za-z0-9._:-]", "_", key.replace("/", "."))
    if not name[:1].isalnum():
        name = "m" + name
    return name[:128]


class EvenflowLogger(Logger):
    """Lightning's logged metrics as the job's metrics (``ctx.log``), from global rank 0 (where
    Lightning's own loggers write), at the iteration in progress. A metric logged twice in one
    iteration (Lightning adds ``epoch`` to every call) keeps its first value; a value that is not
    finite (a mean over an empty share) is left out."""

    def __init__(self, ctx: EvenflowContext) -> None:
        super().__init__()
        self._ctx = ctx
        self._sent: dict[str, int] = {}
        self._warned = False

    @property
    def name(self) -> str:
        return "evenflow"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        ctx = self._ctx
        if ctx.rank != 0:
            return
        it = ctx._batch_iteration
        for key, raw in metrics.items():
            name = metric_name(key)
            value = float(raw.item() if isinstance(raw, torch.Tensor) else raw)
            if self._sent.get(name) == it:
                continue
            if not math.isfinite(value):
                if not self._warned:
                    self._warned = True
                    log.warning("metric %s = %r at iteration %d is not reported", name, value, it)
                continue
            ctx.log(name, value)
            self._sent[name] = it


# ---------------------------------------------------------------------------------- the data


def _per_epoch(ctx: EvenflowContext, data: Any) -> int:
    """Iterations in one epoch of ``data`` (a stream: the whole job)."""
    dataset = data.dataset if isinstance(data, DataLoader) else data
    if isinstance(dataset, IterableDataset):
        return ctx.total_iterations(None)
    drop_last = bool(getattr(data, "drop_last", False))
    size = dataset_size(dataset)
    return GlobalBatchSampler(size, ctx.spec.global_batch, drop_last=drop_last).batches_per_epoch


class _TrainBatches:
    """The train DataLoader as Lightning iterates it: this rank's shares from ``ctx.batches``,
    one epoch of the job per ``iter()`` (its length is an epoch's iterations)."""

    _END = object()

    def __init__(self, ctx: EvenflowContext, data: Any, on_end: Callable[[], None]) -> None:
        self.ctx, self.data = ctx, data
        self.per_epoch = _per_epoch(ctx, data)
        self._gen: Iterator[Any] | None = None
        self._ahead: Any = None
        self._on_end = on_end

    def __len__(self) -> int:
        return self.per_epoch

    @property
    def started(self) -> bool:
        return self._gen is not None

    def start(self) -> None:
        """Enter the job's loop (resuming from its newest checkpoint, if any) and hold the
        first batch."""
        self._gen = self.ctx.batches(self.data)
        self._ahead = next(self._gen, self._END)

    def __iter__(self) -> Iterator[Any]:
        assert self._gen is not None, "the job's loop starts with the fit loop"
        while True:
            batch, self._ahead = self._ahead, None
            if batch is None:
                batch = next(self._gen, self._END)
            if batch is self._END:  # the job ended (its length, or ctx.stop())
                self._on_end()
                return
            yield batch
            if (self.ctx.iteration + 1) % self.per_epoch == 0:
                return  # the epoch's last iteration (Lightning asks no further)

    def next_pass(self) -> Any:
        """The iteration's next pass (its share is above the memory cap: several batches)."""
        assert self._gen is not None
        return next(self._gen)

    def finish(self) -> None:
        """After the fit loop: close the job's loop (its last iteration's record and checkpoint,
        the replicas' final check); a fit that ended early withdraws, as a ``break`` would."""
        gen, self._gen = self._gen, None
        if gen is None:
            return
        ctx = self.ctx
        if self._ahead is None and ctx.sync_gradients and ctx.iteration + 1 >= ctx._total:
            for _ in gen:
                raise RuntimeError("the job's loop went on after its last iteration")
        else:
            gen.close()  # type: ignore[attr-defined]


class _LightningState(L.Callback):
    """Lightning's checkpoint (less the model and optimizer, which Evenflow's holds) as of the
    ``on_train_batch_end`` of each iteration after which an Evenflow checkpoint is due."""

    def __init__(self, ctx: EvenflowContext) -> None:
        self.ctx = ctx
        self.snapshot: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        cp = self.ctx.checkpointer
        if cp is None or (self.ctx.iteration + 1) % cp.every != 0:
            return
        state = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        for key in ("state_dict", "optimizer_states"):
            state.pop(key, None)
        self.snapshot = copy.deepcopy(state)

    def save(self) -> dict[str, Any]:
        return self.snapshot


# ------------------------------------------------------------------------------ the strategy


class EvenflowStrategy(ParallelStrategy):
    """Lightning's training step, backward and optimizer step on Evenflow's per-rank shares and
    exactly weighted gradients (see the module's docstring)."""

    strategy_name = "evenflow"

    def __init__(self, ctx: EvenflowContext, **kwargs: Any) -> None:
        check_version()
        check_context(ctx)
        super().__init__(
            parallel_devices=[ctx.device], cluster_environment=_Environment(ctx), **kwargs
        )
        self.ctx = ctx
        self._train: _TrainBatches | None = None
        self._in_train_setup = False
        self._prepared = False
        self._count: Any = None
        self._step_args: tuple[tuple[Any, ...], dict[str, Any]] = ((), {})
        self._state = _LightningState(ctx)
        self._resume: dict[str, Any] | None = None
        self._trainer: L.Trainer | None = None

    # ------------------------------------------------------------------ what Lightning asks

    @property
    def root_device(self) -> torch.device:
        return self.ctx.device

    @property
    def is_distributed(self) -> bool:
        return False  # (to Lightning's connector: no DistributedSampler; the plan splits)

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # Evenflow's checkpoints hold the optimizer

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def setup_environment(self) -> None:
        for module in (pl_rank_zero, utils_rank_zero):  # Lightning's rank-0-only helpers
            setattr(module.rank_zero_only, "rank", self.ctx.rank)  # noqa: B010
        super().setup_environment()

    def _group(self, tensor: torch.Tensor | None = None) -> Any:
        """CPU values go over the job's control group (gloo), device values over the world."""
        if tensor is not None and tensor.device.type != "cpu":
            return self.ctx.group
        return self.ctx.agreement.group

    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized():
            dist.barrier(group=self._group())

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self._group())
        return box[0]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor) or not dist.is_initialized():
            return tensor
        op = str(getattr(reduce_op, "name", reduce_op) or "mean").lower()
        mean = op in ("mean", "avg")
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        if not mean and op not in ops:
            raise ValueError(f"reduce_op {reduce_op!r}: use sum, mean, max or min")
        out = tensor.detach().clone()
        if mean and not out.is_floating_point():
            out = out.float()
        dist.all_reduce(out, op=ops["sum" if mean else op], group=group or self._group(out))
        return out / self.world_size if mean else out

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> Any:
        return _all_gather_ddp_if_available(
            tensor, group=group or self._group(tensor), sync_grads=sync_grads
        )

    # ----------------------------------------------------------------------------- set up

    def setup(self, trainer: L.Trainer) -> None:
        self._trainer = trainer
        _check_trainer(trainer, self.ctx)
        self._hook_train_data(trainer)
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        _check_precision(self.precision_plugin)
        module = self.lightning_module
        assert module is not None
        if not module.automatic_optimization:
            raise IntegrationError(
                "manual optimization (automatic_optimization = False) is not supported: Evenflow "
                "steps the optimizer once per iteration, after the all-reduce; use automatic "
                "optimization"
            )
        if len(self.optimizers) != 1:
            raise IntegrationError(
                f"configure_optimizers returned {len(self.optimizers)} optimizers; the Lightning "
                "integration trains with exactly one (put several parameter groups in it)"
            )
        if self._prepared:
            raise IntegrationError("an EvenflowStrategy runs one fit: build a Trainer per job")
        model, _ = self.ctx.prepare(module, self.optimizers[0])
        self.model = model
        self._prepared = True
        self.ctx.on_checkpoint("lightning", self._state.save, self._keep_for_resume)
        cast(Any, trainer).callbacks.append(self._state)

    def _keep_for_resume(self, state: dict[str, Any]) -> None:
        self._resume = state

    def _hook_train_data(self, trainer: L.Trainer) -> None:
        """Know which DataLoader is the train one (``process_dataloader`` is asked for every
        loader), and enter the job's loop once the model is prepared."""
        fit_loop = trainer.fit_loop
        original = fit_loop.setup_data

        def setup_data() -> None:
            self._in_train_setup = True
            try:
                original()
            finally:
                self._in_train_setup = False
            if self._prepared and self._train is not None and not self._train.started:
                self._start(trainer)

        fit_loop.setup_data = setup_data  # type: ignore[method-assign]
        # Lightning broadcasts a "received SIGTERM" flag from rank 0 at every step, over the
        # whole world: a collective per step that Evenflow does not need (a rank's end is the
        # agent's and the control plane's to handle) and that slows every step (the guide's
        # Throughput section, docs/guide/lightning.md).
        epoch_loop = fit_loop.epoch_loop
        if hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
            epoch_loop._broadcast_sigterm_tensor = lambda: None  # type: ignore[method-assign]

    def process_dataloader(self, dataloader: object) -> object:
        if not self._in_train_setup:
            return dataloader  # validation and test loaders: as Lightning has them
        if self._train is not None:
            raise IntegrationError(
                "the train DataLoader was requested a second time (reload_dataloaders_every_n_"
                "epochs): Evenflow's loop runs the whole job on one DataLoader"
            )
        self._train = _TrainBatches(self.ctx, dataloader, self._ended)
        return self._train

    def _ended(self) -> None:
        if self._trainer is not None:
            self._trainer.should_stop = True

    def _start(self, trainer: L.Trainer) -> None:
        assert self._train is not None
        self._train.start()
        if self._resume:
            self._restore(trainer, self._resume)
            self._resume = None

    def _restore(self, trainer: L.Trainer, state: dict[str, Any]) -> None:
        """Lightning's state from the Evenflow checkpoint the job resumed from."""
        conn = trainer._checkpoint_connector
        conn._loaded_checkpoint = state
        try:
            trainer.lightning_module.on_load_checkpoint(state)
            conn.restore_datamodule()
            conn.restore_callbacks()
            conn.restore_training_state()
        finally:
            conn._loaded_checkpoint = {}
        log.info(
            "rank %d: Lightning resumed at epoch %d, step %d",
            self.ctx.rank,
            trainer.current_epoch,
            trainer.global_step,
        )

    # -------------------------------------------------------------------------- the step

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().training_step(*args, **kwargs)
        self._count = out.get("count") if isinstance(out, Mapping) else None
        self._step_args = args[1:], kwargs
        return out

    def backward(
        self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        """``ctx.backward`` of the step's loss weighted by what it is a mean over; when this
        rank's share comes as several passes (its memory cap), the training step and backward
        of each further pass, before Lightning goes on to clip and step."""
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._backward_pass(closure_loss)
        ctx = self.ctx
        while ctx._pass < len(ctx._passes):
            assert self._train is not None
            batch = self.batch_to_device(self._train.next_pass())
            rest, named = self._step_args
            out = self.training_step(batch, *rest, **named)
            loss = out["loss"] if isinstance(out, Mapping) else out
            self._backward_pass(self.precision_plugin.pre_backward(loss, module))
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _backward_pass(self, loss: torch.Tensor) -> None:
        ctx = self.ctx
        n = ctx._passes[ctx._pass]
        count, self._count = self._count, None
        if count is None:
            count = n
        if n == 0:  # an empty share: its mean is NaN, its sum 0
            ctx.backward(torch.nan_to_num(loss) * 0, count=0)
        else:
            ctx.backward(loss * count, count=count)

    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        """The closure (training step, zero_grad, backward and the all-reduce), then the
        ``on_before_optimizer_step`` hooks and clipping on the all-reduced gradients, then the
        step (Evenflow's optimizer hook refuses a step on unsynchronised gradients)."""
        model = model or self.lightning_module
        result = closure()
        if not self.ctx.sync_gradients:  # a rank left the job's loop: no update, the job ends
            assert self.ctx._stopping, "the gradients were not all-reduced before the step"
            return result
        self.precision_plugin._after_closure(model, optimizer)
        optimizer.step(**kwargs)
        return result

    # ------------------------------------------------------------------------- the end

    def on_train_end(self) -> None:
        if self._train is not None:
            self._train.finish()

    def on_exception(self, exception: BaseException) -> None:
        if self._train is not None:
            self._train.finish()

    def teardown(self) -> None:
        if self._train is not None:
            self._train.finish()
        super().teardown()


def _check_precision(plugin: Precision) -> None:
    ok = type(plugin) in (Precision, HalfPrecision, DoublePrecision)
    if type(plugin) is MixedPrecision:
        ok = plugin.scaler is None
        if not ok:
            raise IntegrationError(
                "precision='16-mixed' scales the loss with a GradScaler, which the Lightning "
                "integration does not drive: use precision='bf16-mixed' (no scaler) or 32"
            )
    if not ok:
        raise IntegrationError(
            f"the precision plugin {type(plugin).__name__} is not supported: use precision "
            "'32-true', 'bf16-mixed', 'bf16-true', '16-true' or '64-true'"
        )


def _check_trainer(trainer: L.Trainer, ctx: EvenflowContext) -> None:
    """What Evenflow's plan decides instead of the Trainer."""
    if trainer.accumulate_grad_batches != 1:
        raise IntegrationError(
            f"accumulate_grad_batches={trainer.accumulate_grad_batches}: Evenflow's global batch "
            f"is the job spec's global_batch ({ctx.spec.global_batch} samples per step, split "
            "among the workers by its plan; a share above a worker's memory is split into passes "
            "by Evenflow): set global_batch to what you accumulated over and remove "
            "accumulate_grad_batches"
        )
    loose = cast(Any, trainer)
    if trainer.limit_train_batches not in (1, 1.0) or loose.overfit_batches:
        raise IntegrationError(
            "limit_train_batches and overfit_batches are not supported: the job's length is its "
            "spec's iterations or epochs"
        )
    if loose.reload_dataloaders_every_n_epochs:
        raise IntegrationError(
            "reload_dataloaders_every_n_epochs is not supported: Evenflow's loop runs the whole "
            "job on one train DataLoader (each epoch is a new seeded permutation of it)"
        )
    spec = ctx.spec
    if spec.iterations is not None:
        if trainer.max_steps != spec.iterations or trainer.max_epochs not in (-1, None):
            raise IntegrationError(
                f"the Trainer's max_steps={trainer.max_steps}, max_epochs={trainer.max_epochs} "
                f"disagree with the job spec's iterations: {spec.iterations}: the job's length is "
                "its spec's (leave max_steps/max_epochs to evenflow.integrations.lightning."
                "trainer, or pass max_steps=ctx.spec.iterations)"
            )
    elif trainer.max_epochs != spec.epochs or trainer.max_steps != -1:
        raise IntegrationError(
            f"the Trainer's max_epochs={trainer.max_epochs}, max_steps={trainer.max_steps} "
            f"disagree with the job spec's epochs: {spec.epochs}: the job's length is its "
            "spec's (leave max_steps/max_epochs to evenflow.integrations.lightning.trainer, or "
            "pass max_epochs=ctx.spec.epochs)"
        )


# ------------------------------------------------------------------------------ the helper


def _check_launch(ctx: EvenflowContext, kwargs: dict[str, Any]) -> None:
    """The launch arguments of a plain multi-GPU Trainer that Evenflow decides instead."""
    strategy = kwargs.pop("strategy", "auto")
    if not (isinstance(strategy, str) and strategy in DATA_PARALLEL):
        name = strategy if isinstance(strategy, str) else type(strategy).__name__
        raise IntegrationError(
            f"strategy={name!r}: under Evenflow the strategy is EvenflowStrategy (data parallel "
            "with per-worker shares from the job's plan). DeepSpeed's or FSDP's sharding is the "
            "job spec's `engine: fsdp` instead (Evenflow shards the model itself); leave "
            "strategy out or keep 'ddp'"
        )
    world = ctx.world_size
    devices = kwargs.pop("devices", "auto")
    nodes = kwargs.pop("num_nodes", 1)
    per_node = len(devices) if isinstance(devices, list | tuple) else devices
    if per_node in ("auto", None, -1, "-1"):
        per_node = world // max(1, int(nodes)) or 1
    try:
        asked = int(per_node) * int(nodes)
    except (TypeError, ValueError):
        asked = -1
    if asked not in (1, world):
        raise IntegrationError(
            f"devices={devices!r}, num_nodes={nodes!r} ask for {asked} processes, but this job "
            f"runs on {world} workers (the spec's `workers`; Evenflow starts one process per "
            "device on the hosts it places the job on): remove devices and num_nodes, or make "
            "devices x num_nodes the spec's workers"
        )
    accelerator = kwargs.pop("accelerator", "auto")
    kind = ctx.device.type
    fits = {"auto", kind} | ({"gpu"} if kind == "cuda" else set())
    if not isinstance(accelerator, str) or accelerator not in fits:
        raise IntegrationError(
            f"accelerator={accelerator!r}, but this rank's device is {ctx.device} (Evenflow "
            "gives each rank its device): remove accelerator"
        )
    if kwargs.get("accumulate_grad_batches", 1) != 1:
        raise IntegrationError(
            f"accumulate_grad_batches={kwargs['accumulate_grad_batches']}: Evenflow's global "
            f"batch is the job spec's global_batch ({ctx.spec.global_batch}), split among the "
            "workers by its plan: set global_batch to what you accumulated over instead"
        )
    if kwargs.pop("sync_batchnorm", False):
        raise IntegrationError(
            "sync_batchnorm is not supported: convert the model with torch.nn.SyncBatchNorm."
            "convert_sync_batchnorm yourself on a CUDA job, or use GroupNorm/LayerNorm"
        )


def trainer(ctx: EvenflowContext, **kwargs: Any) -> L.Trainer:
    """An ``L.Trainer`` for this rank of the job: ``kwargs`` as for ``L.Trainer`` (clipping,
    precision, callbacks, loggers, validation, checkpointing), with Evenflow's strategy, device
    and length. ``strategy`` ('ddp'), ``devices``, ``num_nodes``, ``accelerator``, ``max_steps``
    and ``max_epochs`` of a plain multi-GPU launch may stay when they agree with the job (and are
    refused, saying why, when not). :class:`EvenflowLogger` is added to the loggers (``logger=
    True``, the default, means only it); the progress bar is off unless asked for."""
    _check_launch(ctx, kwargs)
    spec = ctx.spec
    steps, epochs = kwargs.pop("max_steps", None), kwargs.pop("max_epochs", None)
    if spec.iterations is not None:
        if steps not in (None, -1, spec.iterations) or epochs not in (None, -1):
            raise IntegrationError(
                f"max_steps={steps}, max_epochs={epochs}: the job's length is its spec's "
                f"iterations: {spec.iterations} (remove max_steps and max_epochs)"
            )
        kwargs.update(max_steps=spec.iterations, max_epochs=-1)
    else:
        if steps not in (None, -1) or epochs not in (None, spec.epochs):
            raise IntegrationError(
                f"max_steps={steps}, max_epochs={epochs}: the job's length is its spec's "
                f"epochs: {spec.epochs} (remove max_steps and max_epochs)"
            )
        kwargs.update(max_steps=-1, max_epochs=spec.epochs)
    logger = kwargs.pop("logger", True)
    if logger is not False:
        theirs = (
            [] if logger in (True, None) else list(logger) if isinstance(logger, list) else [logger]
        )
        kwargs["logger"] = [*theirs, EvenflowLogger(ctx)]
    kwargs.setdefault("enable_progress_bar", False)
    if ctx._output_dir is not None:
        kwargs.setdefault("default_root_dir", ctx._output_dir)
    cuda = ctx.device.type == "cuda"
    return L.Trainer(
        strategy=EvenflowStrategy(ctx),
        accelerator="cuda" if cuda else "cpu",
        devices=[ctx.device.index or 0] if cuda else 1,
        num_nodes=1,
        use_distributed_sampler=False,
        **kwargs,
    )
