"""The per-rank training engine a user's loop drives: ``prepare``, ``batches``, ``backward``.

A loop under Evenflow reads like a DDP or Accelerate loop::

    model, opt = ctx.prepare(model, opt)
    for x, y in ctx.batches(loader):               # this rank's share of each global batch
        loss = F.cross_entropy(model(x), y, reduction="sum")
        ctx.backward(loss)                         # count: the samples of the batch
        if ctx.sync_gradients:                     # after the iteration's all-reduce
            clip_grad_norm_(model.parameters(), 1.0)
            opt.step(); sched.step(); opt.zero_grad()

One iteration, on every active rank, in this order::

    plan agreement at the boundary (inside the gradient all-reduce, or one tiny broadcast)
      [-> when the plan changes who is active: regroup, and re-synchronise readmitted ranks]
    -> data: this rank's slice of the global batch under the agreed plan (loaded ahead by the
       DataLoader's workers; an empty batch when the slice is 0 samples, so every rank runs
       the same steps); a slice larger than the memory cap comes as several passes
    -> compute: the user's forward, and ``ctx.backward`` of each pass's SUMMED loss
       (gradients accumulate; a pass with no samples back-propagates nothing)
    -> sync, in the last pass's ``backward``: one all-reduce of gradients, loss sums, counts
       and flags; gradients divided by the global count; ``ctx.sync_gradients`` turns true
    -> the user's code: clip, optimizer step, scheduler, EMA, zero the gradients
    -> when the loop asks for the next batch: timing record -> telemetry queue, checkpoint

Every rank that holds the model runs the same user-visible steps in every iteration, so a
scheduler or an EMA stepped in the loop body stays the same everywhere. Now and then
(``replica_check_every``) the all-reduce also carries each rank's checksum of its parameters:
replicas that differ fail the job naming the iteration and the ranks (:class:`ReplicaDivergence`).
``ctx.stop()`` on any rank ends the job on all after the iteration its flag travels in; a rank
that leaves its loop (``break``) joins the next all-reduce with a withdrawal instead of
gradients, and every rank ends there without that update (on a CPU gloo job, where the flags are
read every iteration; on CUDA they are read every ``loss_every`` iterations, so use
``ctx.stop()`` there).

A rank the agreed plan excludes leaves this loop at that boundary: it probes its speed on each
tick from the leader and waits for a join notice (:mod:`agent.runtime.membership`); ``batches()``
yields nothing meanwhile, and resumes at the join iteration with parameters, buffers, optimizer
state and registered state (``ctx.register_state``) re-synchronised. After the last iteration,
ranks still excluded are re-synchronised too, so every rank ends with the trained model; a rank
that *departed* (excluded, then its process died: the control plane lets the job go on without
it) is left out of that, as of everything else. See :mod:`agent.runtime.workloads` for the whole
user API.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, SupportsFloat

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import IterableDataset

from agent.runtime.checkpoint import Checkpointer, LoadState, Saved, SaveState, save_model
from agent.runtime.datasets import DatasetLike, Source, as_source
from agent.runtime.ddp import OverlapSync
from agent.runtime.emulation import EMULATED_LABEL, Emulator
from agent.runtime.fsdp import ShardedSync
from agent.runtime.gradients import GradientSync, broadcast_module
from agent.runtime.iteration import IterationSteps, ReplicaDivergence
from agent.runtime.membership import ExclusionOptions, Membership
from agent.runtime.metrics import MetricReporter
from agent.runtime.oom import MemoryGuard
from agent.runtime.plan_sync import PlanAgreement, RuntimePlan
from agent.runtime.probes import ProbeLoss
from agent.runtime.readmission import Readmission
from agent.runtime.sampler import GlobalBatchSampler, Sampler, StreamSampler
from agent.runtime.stats import MAX_LOSSES, ContextStats
from agent.runtime.telemetry import JumpWatch, TelemetryClosed
from agent.runtime.timing import IterationTimer
from contract.agent import MetricPoint, TelemetryRecord
from contract.spec import JobSpec

__all__ = [
    "MAX_LOSSES",
    "ContextStats",
    "DatasetLike",
    "EvenflowContext",
    "ReplicaDivergence",
    "dataset_size",
]

log = logging.getLogger("evenflow.runtime.context")

OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def resolve_gradient_sync(choice: str, device: torch.device, distributed: bool) -> str:
    """The synchroniser a ``ddp`` job uses: ``auto`` takes DDP's overlap on GPUs and the
    coalesced all-reduce on CPUs, where it is as fast or faster
    (``docs/decisions/0010-ddp-behind-the-synchroniser.md``); without a process group there is
    nothing to overlap."""
    if not distributed:
        return "coalesced"
    if choice == "auto":
        return "overlap" if device.type == "cuda" else "coalesced"
    return choice


def dataset_size(dataset: DatasetLike) -> int:
    """Samples in a dataset: dim 0 of its tensors (which must agree), or ``len``."""
    if isinstance(dataset, tuple):
        sizes = {t.shape[0] for t in dataset}
        if len(sizes) != 1:
            raise ValueError(f"dataset tensors disagree on their length: {sorted(sizes)}")
        return sizes.pop()
    return len(dataset)  # type: ignore[arg-type]


class EvenflowContext(IterationSteps, Readmission):
    """Drives one rank's iterations; every rank must make the same calls in the same order.

    Its iteration steps are :class:`~agent.runtime.iteration.IterationSteps`, its side of
    partial all-reduce :class:`~agent.runtime.readmission.Readmission`.

    Plans that exclude ranks need an initialised process group, and ``group`` (the gradient
    group) must span the world (the default): subgroups are made of world ranks.
    """

    def __init__(
        self,
        spec: JobSpec,
        agreement: PlanAgreement,
        *,
        rank: int,
        world_size: int,
        device: torch.device | None = None,
        emulator: Emulator | None = None,
        submit: Callable[[TelemetryRecord], None] | None = None,
        flush: Callable[[], None] | None = None,
        submit_metric: Callable[[MetricPoint], None] | None = None,
        group: dist.ProcessGroup | None = None,
        loss_every: int = 1,
        piggyback: bool = True,
        exclusion: ExclusionOptions = ExclusionOptions(),
        checkpointer: Checkpointer | None = None,
        on_checkpoint_saved: Callable[[Saved], None] | None = None,
        replica_check_every: int = 100,
        output_dir: str | None = None,
        gradient_sync: str | None = None,
    ) -> None:
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.device = device or torch.device("cpu")
        self.agreement = agreement
        self.emulator = emulator
        self.group = group
        self.loss_every = max(1, loss_every)
        self.piggyback = piggyback
        self.gradient_sync = resolve_gradient_sync(
            gradient_sync or spec.gradient_sync, self.device, dist.is_initialized()
        )
        """``overlap`` (DDP, :mod:`agent.runtime.ddp`) or ``coalesced`` (one all-reduce after
        backward, :mod:`agent.runtime.gradients`)."""
        """Carry the plan agreement inside the gradient all-reduce when the buffers allow."""
        self._output_dir = output_dir
        self.final_model: str | None = None
        """Where ``save_final`` wrote the trained model (on the rank that wrote it)."""
        self.replica_check_every = max(1, replica_check_every)
        """Every this many iterations (and at the last) the ranks compare parameter checksums."""
        self._submit = submit
        self._metrics = MetricReporter(rank, submit_metric)
        """The global loss from the plan's leader, and what user code logs (``log``)."""
        self._flush = flush
        """Asks the telemetry sender to post now: for the first ``EARLY_FLUSH_ITERATIONS``, and
        when a :class:`JumpWatch` flags a record (the control plane should hear of a slowdown's
        start or end at once). The control plane judges an iteration once every rank reported
        it, so a flagged rank also raises the gradient all-reduce's flag, and every rank that
        sees it raised posts too."""
        self._jumps = (JumpWatch(), JumpWatch())
        """On compute time, and on the whole iteration (data + compute + sync)."""
        self.timer = IterationTimer(self.device)
        self.stats = ContextStats()
        self.iteration = 0
        """The iteration in progress (or next), counted from 0 across epochs."""
        self._batch_iteration = 0
        """The iteration of the batch ``batches()`` yielded last (what ``log`` reports at)."""
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._sync: GradientSync | OverlapSync | ShardedSync | None = None
        self._sampler: Sampler | None = None
        self._source: Source | None = None
        self._awaiting_backward = False
        self._synced = False
        """This iteration's gradients are all-reduced (``sync_gradients``)."""
        self._in_loop = False
        self._stop_asked = False
        """This rank called ``stop()``: its flag rides every all-reduce from now on."""
        self._stopping = False
        """A rank asked to stop, or one withdrew: the loop ends after this iteration."""
        self._withdrawn = False
        """This iteration is abandoned: a rank left its loop, its update is not made."""
        self._data_pending = False
        """The iteration's data phase has not ended yet (its first pass's samples are not taken)."""
        self._plan: RuntimePlan = agreement.current
        self._local = 0
        self._passes: tuple[int, ...] = ()
        """Sizes of this iteration's passes (one unless the memory cap splits the slice)."""
        self._pass = 0
        self._check = False
        """This iteration's all-reduce carries the replicas' checksums."""
        self._loss_acc: torch.Tensor | None = None
        self._count_acc: float | torch.Tensor = 0.0
        self._guard = MemoryGuard(rank)
        self._total = 0
        self.membership = Membership(
            rank,
            world_size,
            group=group,
            control_group=agreement.group,
            options=exclusion,
            timeout=timedelta(seconds=spec.collective_timeout_s),
        )
        self.probe_loss: ProbeLoss | None = None
        """``probe_loss(batch)``: the summed loss of a batch as ``batches()`` yields it, for speed
        probes while excluded (default: the model's output summed; see :mod:`~agent.runtime.
        probes`)."""
        self._probe_failed = False
        self.checkpointer = checkpointer
        """The job's checkpoints (None when its spec asks for none)."""
        self._on_saved = on_checkpoint_saved
        self._states: dict[str, tuple[SaveState, LoadState]] = {}
        """The user's registered state: kept in checkpoints, re-synchronised on readmission."""
        self._first_iteration = 0
        self.ended = False
        """The loop ran to the job's end, or the job was stopped early (every rank ends there)."""
        self._frozen: dict[int, int] = {}
        """Sharded streams: how far ranks had read their shards when they were excluded."""
        self._after: tuple[tuple[int, ...], Any, Any] | None = None
        """(ranks, group, control) once the loop ended with ranks re-synchronised into it."""
        if emulator is not None:
            log.info("rank %d: %s speed %s", rank, EMULATED_LABEL, emulator.worker)

    # ----------------------------------------------------------------------------- user API

    @property
    def args(self) -> dict[str, Any]:
        return self.spec.workload.args

    @property
    def seed(self) -> int:
        return self.spec.workload.seed

    @property
    def emulated(self) -> bool:
        """True when this rank pads its compute to an emulated speed (label it in logs)."""
        return self.emulator is not None

    @property
    def plan(self) -> RuntimePlan:
        """The plan in force for the current iteration."""
        return self._plan

    @property
    def started(self) -> bool:
        """Whether ``batches()`` was called."""
        return self._sampler is not None

    @property
    def sync_gradients(self) -> bool:
        """True once this iteration's last pass is back-propagated and the gradients are
        all-reduced: clip, step the optimizer and the scheduler, update an EMA and zero the
        gradients then (as with Accelerate's ``accelerator.sync_gradients``)."""
        return self._synced

    def prepare(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        shard: Sequence[type[nn.Module]] | None = None,
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Move the model to the device, copy rank 0's weights everywhere, own its gradients.

        Without an optimizer, plain SGD at the job's learning rate is used. An optimizer built
        before, on the model's parameters, keeps working: the model is moved in place. Its
        ``step()`` refuses to run inside the loop before the iteration's gradients are
        synchronised (a port that would step on one rank's partial gradients fails at once).

        Under ``engine: fsdp`` the model is sharded in place (``fully_shard`` on each instance
        of the ``shard`` classes, by default every ``nn.ModuleList``'s layers, then the root)
        and the optimizer switched to the sharded parameters, so a script moves from ``ddp`` to
        ``fsdp`` by its spec alone (:mod:`agent.runtime.fsdp`).
        """
        if isinstance(model, nn.parallel.DistributedDataParallel | FSDPModule):
            raise TypeError(
                f"ctx.prepare() got a model already wrapped in {type(model).__name__}: pass your "
                "module itself; Evenflow wraps it as the job's engine says (engine ddp returns a "
                "DistributedDataParallel, engine fsdp shards it), and a second wrapper would "
                "reduce the gradients twice"
            )
        model.to(self.device)
        broadcast_module(model, group=self.group)
        if optimizer is None:
            optimizer = torch.optim.SGD(model.parameters(), lr=self.spec.workload.learning_rate)
        self.model, self.optimizer = model, optimizer
        slots = self.agreement.message_length if self.piggyback else 0
        wrapped: nn.Module = model
        if self.spec.engine == "fsdp" and dist.is_initialized():
            if self.agreement.current.excluded:
                raise RuntimeError("a sharded (fsdp) job cannot start with a rank excluded")
            self._sync = ShardedSync(
                model,
                optimizer,
                device=self.device,
                shard=shard,
                control_slots=slots,
                flag=self._flush is not None,
                rank=self.rank,
                world_size=self.world_size,
            )
        elif self.gradient_sync == "overlap":
            overlap = OverlapSync(
                model,
                group=self.group,
                control_slots=slots,
                flag=self._flush is not None,
                rank=self.rank,
                world_size=self.world_size,
            )
            self._sync, wrapped = overlap, overlap.ddp
        else:
            self._sync = GradientSync(
                model.parameters(),
                group=self.group,
                control_slots=slots,
                flag=self._flush is not None,
                rank=self.rank,
                world_size=self.world_size,
            )
        if slots:
            self.agreement.use_channel(self._sync)
        register = getattr(optimizer, "register_step_pre_hook", None)
        if register is not None:
            register(self._before_step)
        log.info(
            "rank %d: gradients by %s; plan agreement via %s",
            self.rank,
            type(self._sync).__name__,
            self.agreement.transport,
        )
        initial = self.agreement.current
        if dist.is_initialized():
            self.membership.setup(initial)
            self.agreement.on_regroup(self._regroup)
            if initial.excluded:
                self._sync.group, control = self.membership.groups_for(initial.active)
                self.agreement.set_group(control, initial.leader)
        elif initial.excluded:
            raise ValueError("a plan with excluded ranks needs an initialised process group")
        return wrapped, optimizer

    def on_checkpoint(self, name: str, save: SaveState, load: LoadState) -> None:
        """Keep state of the user's own: ``save()`` returns it (any picklable object),
        ``load(obj)`` puts it back. It goes in every checkpoint (put back on every rank when
        the job resumes, before the first batch) and to a rank readmitted after an exclusion.
        Register before ``ctx.batches()``."""
        if name in self._states:
            raise ValueError(f"state {name!r} is registered already")
        self._states[name] = (save, load)
        if self.checkpointer is not None:
            self.checkpointer.add(name, save, load)

    def register_state(self, name: str, obj: Any) -> None:
        """``on_checkpoint`` for an object with ``state_dict()`` and ``load_state_dict()`` (an LR
        scheduler, an EMA, a GradScaler)."""
        self.on_checkpoint(name, obj.state_dict, obj.load_state_dict)

    @property
    def output_dir(self) -> str:
        """Where this rank writes files the job should leave behind (its artifacts): a
        directory, or an fsspec URL with the spec's ``outputs.path``. What is there when the
        rank ends is listed by ``evenflow jobs artifacts`` (and, on the hosts' own disks,
        uploaded to the control plane)."""
        if self._output_dir is None:
            raise RuntimeError("this job has no output directory: give the spec outputs.path")
        return self._output_dir

    def save_final(self, path: str | None = None) -> str | None:
        """Save the trained model's ``state_dict`` (call it after the loop; every rank holds the
        trained model then): to ``path`` (a file or fsspec URL), else ``final.pt`` in the job's
        checkpoint directory when it has one, else in ``output_dir``. Rank 0 writes,
        atomically; it returns the URL there, None elsewhere. It is one of the job's
        artifacts."""
        if self.model is None:
            raise RuntimeError("call ctx.prepare(model, optimizer) before ctx.save_final()")
        if path is None and self.checkpointer is None:
            path = f"{self.output_dir.rstrip('/')}/final.pt"
        model: nn.Module | dict[str, Any] = self.model
        if isinstance(self._sync, ShardedSync):  # gathered whole from every rank's shards
            model = get_model_state_dict(
                self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        if self.rank != 0:
            return None
        self.final_model = save_model(model, path, self.checkpointer)
        return self.final_model

    def total_iterations(self, data: int | DatasetLike | None) -> int:
        """Iterations this job runs (what a schedule's ``total_steps`` wants): ``iterations``,
        or ``epochs`` whole passes over ``data`` (a dataset size, or what ``batches`` takes: a
        DataLoader's ``drop_last`` counts). A stream (None, or an IterableDataset) needs
        ``iterations``."""
        if self.spec.iterations is not None:
            return self.spec.iterations
        size, drop_last = data, False
        if isinstance(data, torch.utils.data.DataLoader):
            size, drop_last = data.dataset, data.drop_last
        if size is not None and not isinstance(size, int):
            size = None if isinstance(size, IterableDataset) else dataset_size(size)
        if size is None:
            raise ValueError(
                "an IterableDataset has no length, so the job cannot count epochs over it: "
                "give the job `iterations` instead of `epochs`"
            )
        sampler = GlobalBatchSampler(size, self.spec.global_batch, drop_last=drop_last)
        return (self.spec.epochs or 1) * sampler.batches_per_epoch

    def batches(self, data: DatasetLike) -> Iterator[Any]:
        """Yield this rank's batch (or passes) each iteration until the job's length is reached
        (see :mod:`agent.runtime.datasets` for what ``data`` may be)."""
        if self._sync is None:
            raise RuntimeError("call ctx.prepare(model, optimizer) before ctx.batches(...)")
        source, settings = as_source(
            data,
            rank=self.rank,
            seed=self.seed,
            global_batch=self.spec.global_batch,
            world_size=self.world_size,
        )
        sampler: Sampler
        if source.size is None:
            sampler = StreamSampler(self.spec.global_batch)
        else:
            sampler = GlobalBatchSampler(
                source.size, self.spec.global_batch, seed=self.seed, drop_last=settings.drop_last
            )
        self._total = self.total_iterations(data)
        self._sampler, self._source = sampler, source
        try:
            self._resume()
            yield from self._loop()
        finally:
            source.close()

    @contextlib.contextmanager
    def recoverable(self) -> Iterator[None]:
        """Wrap the loop body (forward and ``backward``) so that running out of device memory
        redoes this rank's share in smaller passes instead of failing the job
        (:mod:`agent.runtime.oom`)::

            for x, y in ctx.batches(data):
                with ctx.recoverable():
                    ctx.step(loss_fn(model(x), y))
        """
        try:
            yield
        except torch.OutOfMemoryError as exc:
            if not self._awaiting_backward:
                raise  # not inside a pass of this context's
            # Kept without its traceback: the traceback's frames hold the failed pass's
            # activations and graph (nearly all of the device's memory), which must be freed
            # before the share is redone; held, the retry's first input copy ran out of memory
            # on a real H100 and failed the job.
            self._guard.pending = exc.with_traceback(None)

    def backward(
        self, loss: torch.Tensor, *, count: float | torch.Tensor | None = None
    ) -> float | None:
        """Back-propagate one pass's summed loss; after the iteration's last pass, all-reduce.

        ``count`` is what this pass's loss is a sum over (default: its samples; the number of
        tokens for a per-token loss): gradients and the loss are divided by the sum of every
        rank's counts in the iteration, so the update is that of the mean over the whole
        global batch. Returns the global mean loss after the last pass when it was read this
        iteration (every ``loss_every`` iterations), else None.
        """
        if not self._awaiting_backward:
            raise RuntimeError(
                "ctx.backward() (or ctx.step()) is called once for each batch ctx.batches() "
                "yields: this call came outside the loop, or a second time for one batch"
            )
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            what = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"ctx.backward() takes the batch's loss summed to one value, got {what}: "
                "use reduction='sum' (or .sum()) and pass the count it is a sum over"
            )
        assert self._sync is not None
        size = self._passes[self._pass]
        if self.emulator is not None:  # an emulated device runs out of memory here, as CUDA's would
            peak = self.emulator.allocate(size)
            if peak is not None:
                self.timer.note_peak_memory(peak)
        if self._pass > 0 and self._sync.detached():
            raise RuntimeError(
                "the gradients were zeroed between two passes of one iteration (this rank's "
                "share is larger than its memory cap, so it comes as several batches): zero "
                "them after the optimizer step, under `if ctx.sync_gradients:`"
            )
        self._sync.attach()
        last = self._pass + 1 == len(self._passes)
        value = loss.detach().reshape(1)
        self._loss_acc = value if self._loss_acc is None else self._loss_acc + value
        self._count_acc = self._count_acc + (size if count is None else count)
        if last:
            self._arm()
        if isinstance(self._sync, ShardedSync):  # every pass joins every layer's collectives
            if not loss.requires_grad:
                raise RuntimeError(
                    "in a sharded (fsdp) job every rank back-propagates every pass, an empty "
                    "batch's too (its loss is 0 but must come from the model's forward)"
                )
            loss.backward()
        elif size > 0:  # an empty batch has no samples, so no gradient
            loss.backward()
        elif last:
            self._sync.backward_empty()  # (DDP: every bucket's all-reduce still runs)
        self._awaiting_backward = False
        self._pass += 1
        if not last:
            return None
        return self._reduce()

    def step(
        self, loss: torch.Tensor, *, count: float | torch.Tensor | None = None
    ) -> float | None:
        """``backward(loss, count=count)``, then, once the gradients are synchronised, the
        optimizer's step and zeroed gradients: the shorthand for a loop with nothing between."""
        value = self.backward(loss, count=count)
        if self._synced:
            assert self.optimizer is not None and self._sync is not None
            self.optimizer.step()
            self._sync.zero_grad()
        return value

    def stop(self) -> None:
        """End the job early, on every rank, from this one: the request travels in the next
        gradient all-reduce, and every rank's loop ends after that iteration (the one in
        progress when called before its last ``backward``, else the next). The job then ends
        as if it had run its length: checkpoints, ``save_final`` and success."""
        self._stop_asked = True

    def all_reduce(self, value: torch.Tensor | SupportsFloat, op: str = "sum") -> Any:
        """Combine ``value`` over the ranks training this iteration (``sum``, ``mean``, ``max``
        or ``min``): a global metric. Every rank in the loop calls it at the same point; a rank
        that sits out (excluded) takes no part, so it cannot deadlock on an exclusion. A tensor
        comes back as a new tensor, a number as a float."""
        if op not in OPS:
            raise ValueError(f"op must be one of {sorted(OPS)}, not {op!r}")
        as_tensor = isinstance(value, torch.Tensor)
        t = value.detach().clone() if isinstance(value, torch.Tensor) else None
        if t is None:
            t = torch.tensor([float(value)], dtype=torch.float64)
        ranks, group, control = self._in_step()
        if dist.is_initialized():
            dist.all_reduce(t, op=OPS[op], group=control if t.device.type == "cpu" else group)
        if op == "mean":
            t = t / len(ranks)
        return t if as_tensor else float(t.item())

    def shard(self, data: Any) -> Any:
        """This rank's part of ``data`` (a Dataset, a sequence or a tensor) among the ranks in
        the loop now, every k-th item from its place: split an evaluation set with it and
        combine the results with :meth:`all_reduce`. Every item goes to exactly one of them."""
        ranks = self._in_step()[0]
        place, k = ranks.index(self.rank), len(ranks)
        if isinstance(data, torch.Tensor | list | tuple | range):
            return data[place::k]
        return torch.utils.data.Subset(data, range(place, len(data), k))

    def log(self, name: str, value: SupportsFloat, *, iteration: int | None = None) -> None:
        """Report a training metric of this rank (an accuracy, a learning rate, a user loss):
        charted on the job's page and served by ``GET /api/v1/jobs/{id}/metrics``.

        ``iteration`` defaults to the iteration of the batch ``batches()`` yielded last (0
        before the first). ``value`` is anything ``float()`` takes, a one-element tensor too
        (reading a CUDA tensor waits for the GPU: log those every few iterations). Raises
        ``ValueError`` at once for a bad name (``loss`` is the runtime's own: the exact global
        loss, reported every ``loss_every`` iterations), a non-finite value, or a second value
        of a name in one iteration. Never blocks; delivery is best effort, except that once the
        control plane has said the job ended this raises ``TelemetryClosed``."""
        self._metrics.log(name, value, self._batch_iteration if iteration is None else iteration)

    # ----------------------------------------------------------------------------- the loop

    def _loop(self) -> Iterator[Any]:
        """The iterations, from the resumed one to the job's end (or an early stop)."""
        assert self._sync is not None
        self._in_loop = True
        try:
            while self.iteration < self._total and not self._stopping:
                it = self.iteration
                if self.membership.excluded:
                    if self._sit_out(it):  # the job ended meanwhile: already re-synchronised
                        return
                    it = self.iteration
                else:
                    t0 = time.perf_counter()
                    self.agreement.at_boundary(it)
                    self.stats.agreement_ms += (time.perf_counter() - t0) * 1000.0
                    if self.membership.excluded:  # the agreed plan just excluded this rank
                        continue
                self._plan = self.agreement.current
                self.membership.tick(it, self._plan)
                yield from self._iteration(it)
            self._end()
        except GeneratorExit:  # the user's loop left (a break, or an error in its body)
            with contextlib.suppress(TelemetryClosed):  # the job ended: nothing to finish
                self._left_loop()
            raise
        except BaseException:  # failed: excluded ranks stop too
            self.membership.abort(self.iteration, self.agreement.current)
            raise
        finally:
            self._in_loop = False
            self.agreement.close()
            with contextlib.suppress(TelemetryClosed):  # the job ended: nowhere to send
                self._emit(self.timer.drain())

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The optimizer's step pre-hook: inside the loop, only on synchronised gradients."""
        if self._in_loop and not self._synced and not self.membership.excluded:
            raise RuntimeError(
                "optimizer.step() ran before this iteration's gradients were all-reduced: "
                "step only when ctx.sync_gradients is true (after the iteration's last "
                "ctx.backward), or every rank would step on its own partial gradients"
            )

    def _in_step(self) -> tuple[tuple[int, ...], Any, Any]:
        """The ranks that run the user's code now, with their gradient and control groups:
        the active ranks in the loop, every rank still in the job after it."""
        if self._after is not None:
            return self._after
        assert self._sync is not None
        return self._plan.active, self._sync.group, self.agreement.group

    # ------------------------------------------------------------------------ checkpoints

    def _resume(self) -> None:
        """Pick up from the newest checkpoint, if the job has one (every rank, together)."""
        if self.checkpointer is None or self.iteration > 0:
            return
        assert self.model is not None and self.optimizer is not None and self._sampler
        assert self._sync is not None and self._source is not None
        resumed = self.checkpointer.resume(
            self.model,
            self.optimizer,
            self._sampler,
            rank=self.rank,
            group=self._sync.group,
            control=self.agreement.group,
            data=self._source.state(),
            sharded=isinstance(self._sync, ShardedSync),
        )
        if resumed is None:
            log.info("rank %d: no checkpoint yet; starting at iteration 0", self.rank)
            return
        self.iteration = self._first_iteration = resumed.iteration
        self._source.restore(resumed.positions)
        self.stats.resumed_from = resumed.iteration
        self.stats.global_samples = resumed.global_samples
        if len(self.agreement.history) == 1:
            self.agreement.history = [(resumed.iteration, self.agreement.current.version)]
        log.info(
            "rank %d: resumed at iteration %d from %s", self.rank, resumed.iteration, resumed.url
        )

    def _maybe_checkpoint(self) -> None:
        """After an iteration: the plan's leader (rank 0 unless excluded; parameters are the same
        on every active rank) writes a checkpoint when one is due."""
        cp = self.checkpointer
        if cp is None or not cp.due(self.iteration):
            return
        assert self.model is not None and self.optimizer is not None and self._sampler
        assert self._source is not None
        positions = self._positions()  # every active rank takes part
        shards = None
        if isinstance(self._sync, ShardedSync):  # every rank writes its shards first
            shards = cp.save_shards(self.iteration, self.model, self.optimizer)
        if self.rank != self._plan.leader:
            return
        saved = cp.save(
            shards=shards,
            iteration=self.iteration,
            model=self.model,
            optimizer=self.optimizer,
            sampler=self._sampler,
            plan=self._plan,
            global_samples=self.stats.global_samples,
            data=self._source.state(),
            positions=positions,
        )
        self.stats.checkpoints.append((saved.iteration, saved.size_bytes, saved.write_ms))
        if self._on_saved is not None:
            try:
                self._on_saved(saved)
            except Exception as exc:  # reporting a checkpoint is best effort
                log.warning("checkpoint %d not reported: %r", saved.iteration, exc)
