"""``run_training``: one rank's whole job, from process group to result.

It wires the parts together: the initial plan is agreed (rank 0's, broadcast), every rank holds a
plan fetcher whose thread polls only while that rank leads (the lowest active rank: rank 0 unless
a plan excludes it), every rank starts a telemetry sender thread, the workload is built (built-in
or user entrypoint) and driven through :class:`~agent.runtime.context.EvenflowContext`, and at the
end the threads are closed (telemetry flushed within a deadline) and a :class:`RunResult` returned.

The control plane is reached only through two injected callables, so nothing here does HTTP:
``fetch_plan() -> PlanOut | None``, ``post_telemetry(TelemetryBatch)`` and
``post_metrics(MetricBatch)`` (the posts raise on failure); a fourth, ``report_checkpoint(Saved)``,
tells it of each checkpoint written (from a background thread: a slow control plane never
holds training up).
:mod:`agent.runtime.remote` builds them from an ``httpx.Client``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from agent.runtime.checkpoint import Checkpointer, CheckpointPathError, CheckpointStore, Saved
from agent.runtime.context import EvenflowContext
from agent.runtime.emulation import Emulator
from agent.runtime.fetcher import FetchPlan, PlanFetcher
from agent.runtime.membership import ExclusionOptions
from agent.runtime.metrics import MetricSender, PostMetrics
from agent.runtime.plan_sync import PlanAgreement, RuntimePlan, agree_initial
from agent.runtime.rendezvous import DeviceAssignment, Rendezvous, init_process_group
from agent.runtime.sender import BatchSender
from agent.runtime.telemetry import PostTelemetry, TelemetrySender, TelemetryStats
from agent.runtime.workloads import Workload, builtin, load_entrypoint
from contract.agent import PlanOut
from contract.spec import JobSpec

log = logging.getLogger("evenflow.runtime.trainer")


@dataclass(frozen=True)
class RuntimeOptions:
    """Knobs of the runtime; the defaults suit real jobs, tests shorten the timers."""

    plan_poll_s: float = 1.0
    """How often the leader (rank 0 unless excluded) asks the control plane for a newer plan."""
    agree_every: int = 1
    """Plan agreement at every k-th iteration boundary."""
    pipelined_agreement: bool = True
    """Overlap the agreement broadcast with the iteration (plans apply one boundary later)."""
    piggyback_agreement: bool = True
    """Carry the agreement in the gradient all-reduce when gradients are CPU float32/64."""
    initial_plan_timeout_s: float = 60.0
    """Rank 0 retries fetching the initial plan this long when none was given."""
    telemetry_flush_records: int = 64
    telemetry_flush_s: float = 2.0
    telemetry_max_buffer: int = 20_000
    close_deadline_s: float = 5.0
    """How long closing may spend flushing telemetry."""
    loss_every: int | None = None
    """Read the global loss every k iterations (default 1 on CPU, 20 on CUDA: reading syncs)."""
    emulate: bool = True
    """Apply the spec's ``emulation`` entry for this rank (when the spec has one)."""
    timeout: timedelta | None = None
    """Collective timeout when this function initialises the process group (default: the
    spec's ``collective_timeout_s``)."""
    replica_check_every: int = 100
    """Every this many iterations the ranks compare checksums of their parameters."""
    assignment: DeviceAssignment | None = None
    """The device and backend the control plane placed this rank on (never what torch can
    see). None: gloo on the CPU, or the current CUDA device when the caller initialised an NCCL
    group itself."""
    exclusion: ExclusionOptions = field(default_factory=ExclusionOptions)
    """How an excluded rank probes its speed and waits to be readmitted."""
    output_dir: str | None = None
    """This rank's ``ctx.output_dir`` (a directory or fsspec URL); None: the job has none."""
    checkpoint_dir: str | None = None
    """Where this job's checkpoints go (a directory or fsspec URL) when its spec asks for
    checkpoints; default the spec's ``checkpoint.path`` as it is."""


@dataclass
class RunResult:
    """What one rank did. Failures are exceptions from :func:`run_training`, not fields."""

    rank: int
    world_size: int
    iterations: int
    samples_seen: int
    """Samples this rank trained on."""
    global_samples: int
    """Samples consumed by all ranks together."""
    final_loss: float | None
    """Global mean loss of the last iteration."""
    losses: list[tuple[int, float]] = field(default_factory=list)
    plan_history: list[tuple[int, int]] = field(default_factory=list)
    """(first iteration, plan version) for every plan this job trained on, in order."""
    refused_plans: dict[int, str] = field(default_factory=dict)
    emulated: bool = False
    padded_ms: float = 0.0
    agreement_ms: float = 0.0
    agreement_transport: str = ""
    wall_s: float = 0.0
    plan_fetch_errors: int = 0
    telemetry: TelemetryStats | None = None
    metrics: TelemetryStats | None = None
    """Delivery of the metric points (the leader's global loss, ``ctx.log`` values)."""
    exclusions: list[tuple[int, int]] = field(default_factory=list)
    """(first iteration sat out, iteration rejoined at) for each time this rank was excluded;
    the job's end counts as a rejoin (this rank then received the final parameters)."""
    probes: int = 0
    """Speed probes this rank ran while excluded (telemetry rows with ``probe=True``)."""
    regroup_ms: list[float] = field(default_factory=list)
    """Host time of each change of all-reduce group this rank took part in."""
    resync_ms: list[float] = field(default_factory=list)
    """Host time of each re-synchronisation (parameters, buffers, optimizer state)."""
    resumed_from: int | None = None
    """The iteration this run resumed at from a checkpoint (None: it started from 0)."""
    checkpoints: list[tuple[int, int, float]] = field(default_factory=list)
    """(iteration, bytes, write ms) of each checkpoint this rank wrote."""
    output_dir: str | None = None
    """Where this rank's ``ctx.output_dir`` was (its files are the job's artifacts)."""
    final_model: str | None = None
    """Where ``ctx.save_final()`` wrote the trained model, on the rank that wrote it."""

    @property
    def plan_versions(self) -> list[int]:
        return [v for _, v in self.plan_history]


def device_for(backend: str, assignment: DeviceAssignment | None) -> torch.device:
    """The device this rank trains on: its assignment's (which must match the group's
    backend), else the CPU under gloo and the current CUDA device under NCCL."""
    if assignment is not None:
        if assignment.backend != backend:
            raise ValueError(
                f"this rank is assigned {assignment.backend} on {assignment.device}, but the "
                f"process group runs {backend}"
            )
        return assignment.activate()
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def run_training(
    spec: JobSpec,
    *,
    fetch_plan: FetchPlan | None = None,
    post_telemetry: PostTelemetry | None = None,
    post_metrics: PostMetrics | None = None,
    initial_plan: PlanOut | RuntimePlan | None = None,
    options: RuntimeOptions = RuntimeOptions(),
    rendezvous: Rendezvous | None = None,
    report_checkpoint: Callable[[Saved], None] | None = None,
) -> RunResult:
    """Train this rank's share of ``spec``; every rank of the job calls this together.

    Uses the initialised default process group, or initialises one on the assigned backend
    through ``rendezvous`` (default: from MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE with the
    spec's ``rendezvous_timeout_s``) and destroys it at the end. Rank 0's ``initial_plan`` is
    used on all ranks; without one, rank 0 fetches it. Other ranks may pass ``None``. Raises if
    the plan or the workload is unusable; before anything else,
    :class:`~agent.runtime.checkpoint.CheckpointPathError` when the spec's checkpoint directory
    cannot be written and :class:`~agent.runtime.errors.EntrypointError` when its entrypoint
    cannot be imported. With checkpoints, the run resumes from the
    newest one in the directory.
    """
    checkpointer = make_checkpointer(spec, options.checkpoint_dir)
    if spec.workload.entrypoint is not None:  # before the rendezvous: an import error is final
        load_entrypoint(spec.workload.entrypoint)
    created = not dist.is_initialized()
    if created:
        rdzv = rendezvous or Rendezvous.from_env(os.environ, spec.rendezvous_timeout_s)
        timeout = options.timeout or timedelta(seconds=spec.collective_timeout_s)
        init_process_group(rdzv, options.assignment or DeviceAssignment(), timeout)
    start = time.monotonic()
    fetcher: PlanFetcher | None = None
    sender: TelemetrySender | None = None
    metric_sender: MetricSender | None = None
    reporter = ThreadPoolExecutor(1, "checkpoint-report") if report_checkpoint else None
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if not spec.world_size <= world <= spec.max_world_size:
            raise ValueError(f"job is for {_workers(spec)} workers, process group has {world}")
        backend = str(dist.get_backend())
        device = device_for(backend, options.assignment)
        # The plan agreement's int64 tensor stays on the CPU: under NCCL it gets a gloo group.
        timeout = options.timeout or timedelta(seconds=spec.collective_timeout_s)
        control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
        if rank == 0 and initial_plan is None and fetch_plan is not None:
            initial_plan = _fetch_initial(fetch_plan, options.initial_plan_timeout_s)
        initial = agree_initial(
            initial_plan,
            rank=rank,
            world_size=world,
            global_batch=spec.global_batch,
            group=control,
            max_batch=spec.max_batch_per_worker,
        )
        if fetch_plan is not None:  # polls only while its rank leads (see PlanFetcher)
            fetcher = PlanFetcher(
                fetch_plan, interval_s=options.plan_poll_s, known_version=initial.version
            )
            if rank == initial.leader:
                fetcher.start()
        sender, metric_sender = _senders(post_telemetry, post_metrics, options)
        agreement = PlanAgreement(
            initial,
            rank=rank,
            world_size=world,
            global_batch=spec.global_batch,
            propose=fetcher.latest if fetcher else None,
            group=control,
            every=options.agree_every,
            pipelined=options.pipelined_agreement,
            max_batch=spec.max_batch_per_worker,
        )
        _settle_before_checkpoints(checkpointer, [sender, metric_sender], lambda: agreement.group)
        emulator = None
        if spec.emulation is not None and options.emulate:
            emulator = Emulator(spec.emulation[rank])
        loss_every = options.loss_every or (20 if device.type == "cuda" else 1)
        ctx = EvenflowContext(
            spec,
            agreement,
            rank=rank,
            world_size=world,
            device=device,
            emulator=emulator,
            submit=sender.submit if sender else None,
            flush=sender.flush_soon if sender else None,
            submit_metric=metric_sender.submit if metric_sender else None,
            loss_every=loss_every,
            piggyback=options.piggyback_agreement,
            exclusion=options.exclusion,
            checkpointer=checkpointer,
            on_checkpoint_saved=_reporting(reporter, report_checkpoint),
            replica_check_every=options.replica_check_every,
            output_dir=options.output_dir,
        )
        run_workload(ctx)
        stats = ctx.stats
        result = RunResult(
            rank=rank,
            world_size=world,
            iterations=stats.iterations,
            samples_seen=stats.samples_seen,
            global_samples=stats.global_samples,
            final_loss=stats.losses[-1][1] if stats.losses else None,
            losses=stats.losses,
            plan_history=list(agreement.history),
            refused_plans=dict(agreement.refused),
            emulated=emulator is not None,
            padded_ms=emulator.padded_ms if emulator else 0.0,
            agreement_ms=stats.agreement_ms,
            agreement_transport=agreement.transport,
            exclusions=stats.exclusions,
            probes=stats.probes,
            regroup_ms=ctx.membership.regroup_ms,
            resync_ms=stats.resync_ms,
            resumed_from=stats.resumed_from,
            checkpoints=stats.checkpoints,
            output_dir=options.output_dir,
            final_model=ctx.final_model,
        )
    finally:
        if reporter is not None:
            reporter.shutdown(wait=True, cancel_futures=False)
        if fetcher is not None:
            fetcher.close()
        if metric_sender is not None:  # both flush within the one deadline
            metric_sender.start_closing(options.close_deadline_s)
        telemetry = sender.close(options.close_deadline_s) if sender is not None else None
        metrics = metric_sender.close(options.close_deadline_s) if metric_sender else None
        if created:
            dist.destroy_process_group()
    result.telemetry = telemetry
    result.metrics = metrics
    result.plan_fetch_errors = fetcher.errors if fetcher else 0
    result.wall_s = time.monotonic() - start
    return result


def _senders(
    post_telemetry: PostTelemetry | None, post_metrics: PostMetrics | None, options: RuntimeOptions
) -> tuple[TelemetrySender | None, MetricSender | None]:
    """The background senders of timings and of metrics, for the posts that are given."""
    sender = metric_sender = None
    if post_telemetry is not None:
        sender = TelemetrySender(
            post_telemetry,
            flush_records=options.telemetry_flush_records,
            flush_interval_s=options.telemetry_flush_s,
            max_buffer=options.telemetry_max_buffer,
        )
    if post_metrics is not None:
        metric_sender = MetricSender(
            post_metrics,
            flush_interval_s=options.telemetry_flush_s,
            max_buffer=options.telemetry_max_buffer,
        )
    return sender, metric_sender


def _settle_before_checkpoints(
    checkpointer: Checkpointer | None,
    senders: list[BatchSender[Any] | None],
    group: Callable[[], dist.ProcessGroup | None],
) -> None:
    """Before each checkpoint, every sender delivers what it holds (bounded, and not at all
    while its posts fail), and the ranks in the loop (``group``: the agreement's, of the active
    ranks) wait for one another, so the leader writes only once every rank's records of the
    iterations the checkpoint holds are delivered: ``Checkpointer.settle``."""
    if checkpointer is None:
        return

    def settle() -> None:
        for sender in senders:
            if sender is None:
                continue
            try:
                sender.settle()
            except Exception as exc:  # best effort: never into the training loop
                log.warning("%s not settled before a checkpoint: %r", sender.what, exc)
        if dist.is_initialized() and dist.get_world_size(group()) > 1:
            dist.all_reduce(torch.zeros(1), group=group())  # a CPU tensor: gloo in any group

    checkpointer.settle = settle


def make_checkpointer(spec: JobSpec, directory: str | None) -> Checkpointer | None:
    """The job's checkpoints, their directory checked writable; None when it asks for none."""
    if spec.checkpoint is None:
        return None
    url = directory or spec.checkpoint.path
    if url is None:
        raise CheckpointPathError("checkpoint.path is not set and no job directory was given")
    store = CheckpointStore(url, spec.checkpoint.keep)
    store.check_writable()
    return Checkpointer(store, spec.checkpoint.every_iterations)


def _workers(spec: JobSpec) -> str:
    low, high = spec.world_size, spec.max_world_size
    return str(low) if low == high else f"{low} to {high}"


def _reporting(
    reporter: ThreadPoolExecutor | None, report: Callable[[Saved], None] | None
) -> Callable[[Saved], None] | None:
    """Hand each saved checkpoint to ``report`` on the reporter thread; log its failures."""
    if reporter is None or report is None:
        return None

    def submit(saved: Saved) -> None:
        def run() -> None:
            try:
                report(saved)
            except Exception as exc:
                log.warning("checkpoint %d not reported: %r", saved.iteration, exc)

        reporter.submit(run)

    return submit


def run_workload(ctx: EvenflowContext) -> None:
    """Build the spec's workload and train it through ``ctx``."""
    spec = ctx.spec.workload
    if spec.builtin is not None:
        train_workload(ctx, builtin(spec))
        return
    assert spec.entrypoint is not None
    returned = load_entrypoint(spec.entrypoint)(ctx)
    if isinstance(returned, Workload):
        train_workload(ctx, returned)
    elif returned is not None:
        raise TypeError(f"entrypoint {spec.entrypoint} returned {type(returned).__name__}")
    elif not ctx.started:
        raise RuntimeError(
            f"entrypoint {spec.entrypoint} neither returned a Workload nor ran ctx.batches()"
        )
    elif not ctx.ended:  # the other ranks wait for this one in a collective: say who left
        raise RuntimeError(
            f"rank {ctx.rank}'s entrypoint returned at iteration {ctx.iteration}, before the "
            "job's end: every rank runs ctx.batches() to its end (to stop early, call "
            "ctx.stop() on any rank)"
        )


def train_workload(ctx: EvenflowContext, workload: Workload) -> None:
    """The standard loop for a :class:`Workload`."""
    model = workload.model.to(ctx.device)
    optimizer = workload.optimizer(model.parameters()) if workload.optimizer else None
    model, _ = ctx.prepare(model, optimizer)
    ctx.probe_loss = lambda batch: workload.loss_fn(model(batch[0]), batch[1])
    for inputs, targets in ctx.batches(workload.dataset):
        with ctx.recoverable():  # out of memory: the share is redone in smaller passes
            ctx.step(workload.loss_fn(model(inputs), targets))
    if ctx.checkpointer is not None:
        ctx.save_final()


def _fetch_initial(fetch_plan: FetchPlan, timeout_s: float) -> PlanOut | None:
    deadline = time.monotonic() + timeout_s
    delay = 0.1
    while True:
        try:
            plan = fetch_plan()
            if plan is not None:
                return plan
        except Exception as exc:
            log.warning("initial plan fetch failed: %r", exc)
        if time.monotonic() + delay > deadline:
            return None
        time.sleep(delay)
        delay = min(delay * 2, 5.0)
