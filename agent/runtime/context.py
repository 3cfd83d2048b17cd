"""The per-rank training engine a workload (built-in or user) drives: ``prepare``, ``batches``,
``step``.

One iteration, on every active rank, in this order::

    plan agreement at the boundary (inside the gradient all-reduce, or one tiny broadcast)
      [-> when the plan changes who is active: regroup, and re-synchronise readmitted ranks]
    -> data: this rank's slice of the global batch under the agreed plan
    -> compute: forward + backward of the SUMMED loss (skipped with 0 samples), emulation padding;
       a slice larger than this rank's memory cap in the plan is yielded as several micro-batches
       (passes of at most the cap), each stepped, their gradients accumulated in place
    -> sync: one coalesced all-reduce of gradients and loss, scaled by 1 / global count
    -> optimizer step, zero the gradient buffer (the leader: the global loss -> metrics queue)
    -> timing record -> telemetry queue (background threads send both)

A rank the agreed plan excludes leaves this loop at that boundary: it probes its speed on each
tick from the leader and waits for a join notice (:mod:`agent.runtime.membership`); ``batches()``
yields nothing meanwhile, and resumes at the join iteration with parameters, buffers and optimizer
state re-synchronised. After the last iteration, ranks still excluded are re-synchronised too, so
every rank ends with the trained model; a rank that *departed* (excluded, then its process died:
the control plane lets the job go on without it) is left out of that, as of everything else. See :mod:`agent.runtime.workloads` for how a user loop
uses this.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, SupportsFloat

import torch
import torch.distributed as dist
from torch import nn

from agent.runtime.checkpoint import Checkpointer, LoadState, Saved, SaveState, save_model
from agent.runtime.datasets import DatasetLike, dataset_size, take
from agent.runtime.emulation import EMULATED_LABEL, Emulator
from agent.runtime.gradients import GradientSync, broadcast_module
from agent.runtime.membership import ExclusionOptions, GroupRole, Membership, Notice, Transition
from agent.runtime.metrics import MetricReporter
from agent.runtime.oom import MemoryGuard
from agent.runtime.plan_sync import PlanAgreement, RuntimePlan, decode_plan
from agent.runtime.probes import ProbeLoss, forward_sum, probe, probe_size
from agent.runtime.resync import resync
from agent.runtime.sampler import GlobalBatchSampler
from agent.runtime.telemetry import JumpWatch, TelemetryClosed, clamp_ms
from agent.runtime.timing import IterationTimer, IterationTiming
from contract.agent import MetricPoint, TelemetryRecord
from contract.spec import JobSpec

__all__ = ["ContextStats", "DatasetLike", "EvenflowContext", "dataset_size"]

log = logging.getLogger("evenflow.runtime.context")

MAX_LOSSES = 4096

EARLY_FLUSH_ITERATIONS = 3
"""Records of the first iterations are posted at once: the control plane takes its first look
at a job after three iterations (``server.services.rebalancer.FIRST_LOOK``), and until its first
plan the job trains on a blind split."""


@dataclass
class ContextStats:
    """What one rank did; the raw material of :class:`~agent.runtime.trainer.RunResult`."""

    iterations: int = 0
    samples_seen: int = 0
    """Samples this rank trained on."""
    global_samples: int = 0
    """Samples in all global batches so far (sum of global counts)."""
    losses: list[tuple[int, float]] = field(default_factory=list)
    """(iteration, global mean loss), thinned to at most ``MAX_LOSSES`` entries spread over the
    run; always holds the last iteration's."""
    agreement_ms: float = 0.0
    """Total host time spent at boundaries (agreement, and any regroup and re-synchronisation)."""
    exclusions: list[tuple[int, int]] = field(default_factory=list)
    """(first iteration sat out, iteration rejoined at) for each time this rank was excluded."""
    probes: int = 0
    """Speed probes this rank ran while excluded."""
    resync_ms: list[float] = field(default_factory=list)
    """Host time of each re-synchronisation this rank took part in."""
    ooms: list[tuple[int, int]] = field(default_factory=list)
    """(iteration, pass size) of each pass that ran out of memory and was redone smaller."""
    resumed_from: int | None = None
    """The iteration this run resumed at from a checkpoint (None: it started from 0)."""
    checkpoints: list[tuple[int, int, float]] = field(default_factory=list)
    """(iteration, bytes, write ms) of each checkpoint this rank wrote."""
    _loss_stride: int = field(default=1, repr=False)
    _loss_calls: int = field(default=0, repr=False)

    def record_loss(self, iteration: int, value: float, *, last: bool) -> None:
        """Keep every stride-th loss; when the list is full, keep every other and double the
        stride, so memory stays bounded however long the run."""
        keep = self._loss_calls % self._loss_stride == 0
        self._loss_calls += 1
        if keep or last:
            self.losses.append((iteration, value))
        if len(self.losses) > MAX_LOSSES:
            self.losses = self.losses[::2]
            self._loss_stride *= 2
            if last and self.losses[-1][0] != iteration:
                self.losses.append((iteration, value))


class EvenflowContext:
    """Drives one rank's iterations; every rank must make the same calls in the same order.

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
        """Carry the plan agreement inside the gradient all-reduce when the buffers allow."""
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
        self._sync: GradientSync | None = None
        self._sampler: GlobalBatchSampler | None = None
        self._awaiting_step = False
        self._data_pending = False
        """The iteration's data phase has not ended yet (its first pass's samples are not taken)."""
        self._plan: RuntimePlan = agreement.current
        self._local = 0
        self._passes: tuple[int, ...] = ()
        """Sizes of this iteration's passes (one unless the memory cap splits the slice)."""
        self._pass = 0
        self._loss_acc: torch.Tensor | None = None
        self._guard = MemoryGuard(rank)
        self._total = 0
        self.membership = Membership(
            rank, world_size, group=group, control_group=agreement.group, options=exclusion
        )
        self.probe_loss: ProbeLoss | None = None
        """``probe_loss(batch)``: the summed loss of a batch as ``batches()`` yields it, for speed
        probes while excluded (default: the model's output summed; see :mod:`~agent.runtime.
        probes`)."""
        self._dataset: DatasetLike | None = None
        self._probe_failed = False
        self.checkpointer = checkpointer
        """The job's checkpoints (None when its spec asks for none)."""
        self._on_saved = on_checkpoint_saved
        self._first_iteration = 0
        if emulator is not None:
            log.info("rank %d: %s speed %s", rank, EMULATED_LABEL, emulator.worker)

    # ----------------------------------------------------------------------------- user API

    @property
    def args(self) -> dict[str, str | int | float | bool]:
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

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Move the model to the device, copy rank 0's weights everywhere, own its gradients.

        Without an optimizer, plain SGD at the job's learning rate is used. Build a custom
        optimizer *after* moving the model, or pass the model already on ``ctx.device``.
        """
        model.to(self.device)
        broadcast_module(model, group=self.group)
        if optimizer is None:
            optimizer = torch.optim.SGD(model.parameters(), lr=self.spec.workload.learning_rate)
        self.model, self.optimizer = model, optimizer
        slots = self.agreement.message_length if self.piggyback else 0
        self._sync = GradientSync(
            model.parameters(), group=self.group, control_slots=slots, flag=self._flush is not None
        )
        if slots:
            self.agreement.use_channel(self._sync)
        log.info("rank %d: plan agreement via %s", self.rank, self.agreement.transport)
        initial = self.agreement.current
        if dist.is_initialized():
            self.membership.setup(initial)
            self.agreement.on_regroup(self._regroup)
            if initial.excluded:
                self._sync.group, control = self.membership.groups_for(initial.active)
                self.agreement.set_group(control, initial.leader)
        elif initial.excluded:
            raise ValueError("a plan with excluded ranks needs an initialised process group")
        return model, optimizer

    def on_checkpoint(self, name: str, save: SaveState, load: LoadState) -> None:
        """Keep state of the user's own in every checkpoint: ``save()`` returns it (any picklable
        object; called on the rank that writes), ``load(obj)`` puts it back on every rank when
        the job resumes, before the first batch. Register before ``ctx.batches()``. Without
        checkpoints in the spec this does nothing."""
        if self.checkpointer is not None:
            self.checkpointer.add(name, save, load)

    def register_state(self, name: str, obj: Any) -> None:
        """``on_checkpoint`` for an object with ``state_dict()`` and ``load_state_dict()`` (an LR
        scheduler, an EMA, a GradScaler)."""
        self.on_checkpoint(name, obj.state_dict, obj.load_state_dict)

    def save_final(self, path: str | None = None) -> str | None:
        """Save the trained model's ``state_dict`` (call it after the loop; every rank holds the
        trained model then): to ``path`` (a file or fsspec URL), or ``final.pt`` in the job's
        checkpoint directory. Rank 0 writes, atomically; it returns the URL there, None
        elsewhere."""
        if self.model is None:
            raise RuntimeError("call ctx.prepare(model, optimizer) before ctx.save_final()")
        if path is None and self.checkpointer is None:
            raise ValueError("save_final needs a path when the job has no checkpoint directory")
        if self.rank != 0:
            return None
        return save_model(self.model, path, self.checkpointer)

    def total_iterations(self, dataset_size: int) -> int:
        """Iterations this job runs: ``iterations``, or ``epochs`` whole passes over the data."""
        if self.spec.iterations is not None:
            return self.spec.iterations
        per_epoch = GlobalBatchSampler(dataset_size, self.spec.global_batch).batches_per_epoch
        return (self.spec.epochs or 1) * per_epoch

    def batches(self, dataset: DatasetLike) -> Iterator[Any]:
        """Yield this rank's local batch each iteration until the job's length is reached."""
        if self._sync is None:
            raise RuntimeError("call ctx.prepare(model, optimizer) before ctx.batches(...)")
        n = dataset_size(dataset)
        self._sampler = sampler = GlobalBatchSampler(n, self.spec.global_batch, seed=self.seed)
        self._total = total = self.total_iterations(n)
        self._dataset = dataset
        self._resume()
        try:
            while self.iteration < total:
                it = self.iteration
                if self.membership.excluded:
                    self._sit_out(it)  # returns readmitted at a later iteration, or at the end
                    if self.iteration >= total:
                        return  # the end notice: already re-synchronised
                    it = self.iteration
                else:
                    t0 = time.perf_counter()
                    self.agreement.at_boundary(it)
                    self.stats.agreement_ms += (time.perf_counter() - t0) * 1000.0
                    if self.membership.excluded:  # the agreed plan just excluded this rank
                        continue
                self._plan = self.agreement.current
                self.membership.tick(it, self._plan)
                yield from self._iteration(it, dataset, sampler)
            final = self.agreement.current
            if self.membership.role is GroupRole.ACTIVE and set(final.excluded) - set(
                final.departed
            ):
                self.agreement.close()
                tr = self.membership.end(self.iteration, final)
                self._resync(tr, False)
                self._sync.group = tr.group
        except BaseException:  # failed, or the loop was left early: excluded ranks stop too
            self.membership.abort(self.iteration, self.agreement.current)
            raise
        finally:
            self.agreement.close()
            self._emit(self.timer.drain())

    @contextlib.contextmanager
    def recoverable(self) -> Iterator[None]:
        """Wrap the loop body (forward and ``step``) so that running out of device memory
        redoes this rank's share in smaller passes instead of failing the job
        (:mod:`agent.runtime.oom`)::

            for x, y in ctx.batches(data):
                with ctx.recoverable():
                    ctx.step(loss_fn(model(x), y))
        """
        try:
            yield
        except torch.OutOfMemoryError as exc:
            if not self._awaiting_step:
                raise  # not inside a pass of this context's
            # Kept without its traceback: the traceback's frames hold the failed pass's
            # activations and graph (nearly all of the device's memory), which must be freed
            # before the share is redone; held, the retry's first input copy ran out of memory
            # on a real H100 and failed the job.
            self._guard.pending = exc.with_traceback(None)

    def step(self, loss_sum: torch.Tensor) -> float | None:
        """Backward the summed loss; after the iteration's last pass, all-reduce and step the
        optimizer. The global mean loss when it was recorded this iteration (every
        ``loss_every`` iterations), else ``None`` (always ``None`` before the last pass)."""
        if not self._awaiting_step:
            raise RuntimeError("ctx.step() outside a batch of ctx.batches()")
        size = self._passes[self._pass]
        if self.emulator is not None:  # an emulated device runs out of memory here, as CUDA's would
            peak = self.emulator.allocate(size)
            if peak is not None:
                self.timer.note_peak_memory(peak)
        loss_sum.backward()  # accumulates into the gradient buffers over the passes
        self._awaiting_step = False
        self._pass += 1
        loss = loss_sum.detach()
        total = loss if self._loss_acc is None else self._loss_acc + loss
        if self._pass < len(self._passes):
            self._loss_acc = total
            return None
        self._loss_acc = None
        return self._finish(total)

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

    # ----------------------------------------------------------------------------- internals

    def _iteration(
        self, it: int, dataset: DatasetLike, sampler: GlobalBatchSampler
    ) -> Iterator[Any]:
        """One iteration's passes: this rank's slice, or its micro-batches of at most the
        plan's memory cap for this rank (gradients accumulate; the update is unchanged)."""
        self.timer.begin()
        idx = sampler.local_indices(it, self._plan.batch_sizes, self.rank)
        self._local = len(idx)
        self._batch_iteration = it
        self._passes, self._pass, self._loss_acc = (), 0, None
        if self._local == 0:
            self.timer.data_done()
            self._finish(None)
            return
        cap = self._guard.cap(self._plan)
        self._data_pending = True
        while True:
            chunks = [idx] if cap is None or self._local <= cap else list(idx.split(cap))
            self._passes, self._pass, self._loss_acc = tuple(len(c) for c in chunks), 0, None
            if len(chunks) > 1:
                self.timer.note_pass_size(max(self._passes))
            failed = yield from self._run_passes(dataset, chunks)
            if failed is None:
                return
            cap = self._recover(*failed)

    def _run_passes(
        self, dataset: DatasetLike, chunks: list[torch.Tensor]
    ) -> Generator[Any, None, tuple[int, BaseException] | None]:
        """Yield each pass; the failing pass's size and error when one ran out of memory.

        A pass's samples are taken just before it runs, not all of an iteration's at once: only
        one pass's inputs are on the device at a time (a pass's peak is its own), and on CUDA
        the host can gather the next pass while the device still computes this one, as a plain
        loop does (no throughput change was measurable on an H100: README, "Measured on a real
        H100"). The data phase ends with the first pass's samples; later passes' count as
        compute."""
        for chunk in chunks:
            part = take(dataset, chunk, self.device)
            if self._data_pending:
                self.timer.data_done()
                self._data_pending = False
            self._awaiting_step = True
            yield part
            del part
            exc = self._guard.take_pending()
            if exc is not None:
                return self._passes[self._pass], exc
            if self._awaiting_step:
                raise RuntimeError("call ctx.step(loss_sum) exactly once per batch")
        return None

    def _recover(self, size: int, exc: BaseException) -> int:
        """Free what the failed attempt holds; the smaller cap to redo the share with."""
        assert self._sync is not None
        self._awaiting_step = False
        self._sync.zero_grad()  # the partial gradients of the passes so far
        self._loss_acc = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.timer.restart_peak()
        cap = self._guard.failed(self._plan.version, size, exc)  # raises when nothing fits
        self.timer.note_oom(size)
        self.stats.ooms.append((self.iteration, size))
        log.warning(
            "rank %d: out of memory in a pass of %d at iteration %d; redoing the share in "
            "passes of at most %d",
            self.rank,
            size,
            self.iteration,
            cap,
        )
        return cap

    def _finish(self, loss_sum: torch.Tensor | None) -> float | None:
        assert self._sync is not None and self.optimizer is not None and self._sampler
        it, b = self.iteration, self._local
        if self.emulator is not None and b > 0:
            elapsed = self.timer.compute_elapsed_ms()
            self.timer.add_padding(self.emulator.pad(it, b, elapsed, self._passes))
        self.timer.compute_done()
        count = self._sampler.global_count(it)
        mean_loss = self._sync.all_reduce(count, loss_sum)
        self.timer.sync_done()
        value = None
        if it % self.loss_every == 0 or it + 1 >= self._total:
            value = float(mean_loss.item())
            self.stats.record_loss(it, value, last=it + 1 >= self._total)
            if self.rank == self._plan.leader:  # every active rank holds the same value
                self._metrics.loss(it, value)
        self.optimizer.step()
        self._sync.zero_grad()
        self._emit(self.timer.finish(it, self._plan.version, b))
        if self._sync.flag_seen() and self._flush is not None:
            self._flush()  # another rank's time jumped: the server needs this rank's records too
        self.stats.iterations += 1
        self.stats.samples_seen += b
        self.stats.global_samples += count
        self.iteration += 1
        self._maybe_checkpoint()
        return value

    # ------------------------------------------------------------------------ checkpoints

    def _resume(self) -> None:
        """Pick up from the newest checkpoint, if the job has one (every rank, together)."""
        if self.checkpointer is None or self.iteration > 0:
            return
        assert self.model is not None and self.optimizer is not None and self._sampler
        assert self._sync is not None
        resumed = self.checkpointer.resume(
            self.model,
            self.optimizer,
            self._sampler,
            rank=self.rank,
            group=self._sync.group,
            control=self.agreement.group,
        )
        if resumed is None:
            log.info("rank %d: no checkpoint yet; starting at iteration 0", self.rank)
            return
        self.iteration = self._first_iteration = resumed.iteration
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
        if cp is None or not cp.due(self.iteration) or self.rank != self._plan.leader:
            return
        assert self.model is not None and self.optimizer is not None and self._sampler
        saved = cp.save(
            iteration=self.iteration,
            model=self.model,
            optimizer=self.optimizer,
            sampler=self._sampler,
            plan=self._plan,
            global_samples=self.stats.global_samples,
        )
        self.stats.checkpoints.append((saved.iteration, saved.size_bytes, saved.write_ms))
        if self._on_saved is not None:
            try:
                self._on_saved(saved)
            except Exception as exc:  # reporting a checkpoint is best effort
                log.warning("checkpoint %d not reported: %r", saved.iteration, exc)

    # ------------------------------------------------------------------------ membership

    def _regroup(self, iteration: int, old: RuntimePlan, new: RuntimePlan) -> tuple[Any, int]:
        """The agreement's hook, on every rank of ``old.active``, when ``new`` changes them."""
        assert self._sync is not None
        tr = self.membership.switch(iteration, old, new)
        if self.membership.role is GroupRole.ACTIVE:
            self._sync.group = tr.group
            if tr.readmitted:
                self._resync(tr, False)
        return tr.control, new.leader

    def _sit_out(self, since: int) -> None:
        """Excluded from ``since``: probe until readmitted (then ``self.iteration`` is the join
        iteration and the agreement is in step) or until the end (``self.iteration`` = total)."""
        assert self._sync is not None
        notice: Notice = self.membership.wait(since, self._probe)
        if notice.kind == "join":
            plan, problem = decode_plan(notice.plan, self.world_size)
            assert problem is None, problem  # the active ranks accepted it
            tr = self.membership.rejoin(notice, plan.active)
            self._resync(tr, True)
            self._sync.group = tr.group
            self.agreement.resume(notice.iteration, plan, tr.control)
        else:  # the end: re-synchronised among the ranks still in the job
            members = tuple(range(self.world_size))
            if notice.plan:
                members = decode_plan(notice.plan, self.world_size)[0].members
            tr = self.membership.rejoin(notice, members)
            self._resync(tr, True)
            self._sync.group = tr.group
        self.stats.exclusions.append((since, notice.iteration))
        self.iteration = notice.iteration
        log.info("rank %d: readmitted at iteration %d", self.rank, notice.iteration)

    def _resync(self, tr: Transition, apply: bool) -> None:
        assert self.model is not None and self.optimizer is not None
        t0 = time.perf_counter()
        s, a = self.stats, self.agreement
        records = None
        if self.rank == tr.root:
            records = (
                a.history,
                a.refused,
                s.global_samples,
                s.losses,
                s._loss_stride,
                s._loss_calls,
            )
        records = resync(
            self.model,
            self.optimizer,
            rank=self.rank,
            root=tr.root,
            apply=apply,
            group=tr.group,
            control=tr.control,
            extra=records,
        )
        if apply:  # the job's records, so every rank ends with the same
            a.history, a.refused, s.global_samples, s.losses, s._loss_stride, s._loss_calls = (
                records
            )
        self.stats.resync_ms.append((time.perf_counter() - t0) * 1000.0)

    def _probe(self, iteration: int, version: int) -> None:
        """One speed probe while excluded; best effort (a failing probe stops probing)."""
        assert self.model is not None and self._sync is not None and self._sampler is not None
        if self._probe_failed or self._dataset is None:
            return
        dataset, sampler, plan = self._dataset, self._sampler, self.agreement.current
        b = probe_size(
            len(plan.active),
            self.spec.global_batch,
            self.membership.options.probe_max_batch,
            self.spec.max_batch_per_worker,
            sampler.dataset_size,
        )
        idx = sampler.permutation(sampler.position(iteration)[0])[:b]
        try:
            timing = probe(
                lambda: take(dataset, idx, self.device),
                self.probe_loss or forward_sum(self.model),
                iteration=iteration,
                batch_size=b,
                device=self.device,
                emulator=self.emulator,
            )
        except Exception as exc:
            log.warning("rank %d: speed probe failed, probing stops: %r", self.rank, exc)
            self._probe_failed = True
            return
        finally:
            self._sync.zero_grad()  # a probe's gradients are never used
        self.stats.probes += 1
        self._emit(
            [
                IterationTiming(
                    iteration, version, b, timing.data_ms, timing.compute_ms, 0, time.time()
                )
            ],
            probe=True,
        )

    def _emit(self, timings: list[IterationTiming], *, probe: bool = False) -> None:
        if self._submit is None:
            return
        for t in timings:
            try:
                self._submit(
                    TelemetryRecord(
                        rank=self.rank,
                        iteration=t.iteration,
                        plan_version=t.plan_version,
                        batch_size=t.batch_size,
                        data_ms=clamp_ms(t.data_ms),
                        compute_ms=clamp_ms(t.compute_ms),
                        sync_ms=clamp_ms(t.sync_ms),
                        ts=t.ts,
                        probe=probe,
                        peak_memory_mb=t.peak_memory_mb,
                        oom_batch=t.oom_batch,
                        pass_size=t.pass_size,
                    )
                )
            except TelemetryClosed:  # the job has ended on the control plane: stop training
                raise
            except Exception as exc:  # telemetry is best effort
                log.warning("telemetry record for iteration %d dropped: %r", t.iteration, exc)
                continue
            if self._flush is not None and not probe:
                compute, whole = self._jumps
                jumped = compute.observe(t.batch_size, t.compute_ms)
                if whole.observe(t.plan_version, t.data_ms + t.compute_ms + t.sync_ms) or jumped:
                    self._flush()
                    if self._sync is not None:
                        self._sync.raise_flag()  # and every other rank posts after the next
                elif t.iteration < self._first_iteration + EARLY_FLUSH_ITERATIONS:
                    self._flush()
