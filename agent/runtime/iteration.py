"""One iteration of the context's loop: passes, the all-reduce, and what follows it.

:class:`IterationSteps` is a part of :class:`~agent.runtime.context.EvenflowContext` (its base
class): how an iteration's share is cut into passes and taken from the data source, how the last
pass's ``backward`` all-reduces (gradients, losses, counts, flags, and now and then the
parameter checksums every rank compares), how the iteration is closed once the user's code after
the all-reduce has run (its timing record, its counts, a checkpoint), and what happens when the
user's loop leaves early (a withdrawal the other ranks see in their next all-reduce).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Iterator
from typing import Any

import torch
from torch import nn

from agent.runtime.datasets import Passes, Source, to_device
from agent.runtime.ddp import OverlapSync
from agent.runtime.emulation import Emulator
from agent.runtime.errors import FatalJobError
from agent.runtime.fsdp import ShardedSync, equal_passes
from agent.runtime.gradients import GradientSync, parameter_checksum
from agent.runtime.membership import Membership
from agent.runtime.metrics import MetricReporter
from agent.runtime.oom import MemoryGuard
from agent.runtime.plan_sync import PlanAgreement, RuntimePlan
from agent.runtime.sampler import Sampler
from agent.runtime.stats import ContextStats
from agent.runtime.telemetry import JumpWatch, TelemetryClosed, clamp_ms
from agent.runtime.timing import IterationTimer, IterationTiming
from contract.agent import TelemetryRecord

log = logging.getLogger("evenflow.runtime.context")

EARLY_FLUSH_ITERATIONS = 3
"""Records of the first iterations are posted at once: the control plane takes its first look
at a job after three iterations (``server.services.rebalancer.FIRST_LOOK``), and until its first
plan the job trains on a blind split."""

REPLICA_TOLERANCE = 1e-6
"""Two ranks' parameter sums may differ by this much of the parameters' summed magnitude (float32
slots, and reductions ordered differently on different devices); a rank that skipped or added a
step differs by far more."""


class ReplicaDivergence(FatalJobError):
    """The ranks' parameters are no longer the same: a step ran on some ranks only."""


class IterationSteps:
    """The iteration half of :class:`~agent.runtime.context.EvenflowContext`."""

    rank: int
    iteration: int
    device: torch.device
    model: nn.Module | None
    agreement: PlanAgreement
    membership: Membership
    emulator: Emulator | None
    timer: IterationTimer
    stats: ContextStats
    loss_every: int
    replica_check_every: int
    _sync: GradientSync | OverlapSync | ShardedSync | None
    _sampler: Sampler | None
    _source: Source | None
    _plan: RuntimePlan
    _guard: MemoryGuard
    _metrics: MetricReporter
    _submit: Callable[[TelemetryRecord], None] | None
    _flush: Callable[[], None] | None
    _jumps: tuple[JumpWatch, JumpWatch]
    _first_iteration: int
    _total: int
    _local: int
    _batch_iteration: int
    _passes: tuple[int, ...]
    _pass: int
    _loss_acc: torch.Tensor | None
    _count_acc: float | torch.Tensor
    _awaiting_backward: bool
    _data_pending: bool
    _synced: bool
    _withdrawn: bool
    _stopping: bool
    _stop_asked: bool
    _check: bool
    _maybe_checkpoint: Any
    _end: Any

    def _iteration(self, it: int) -> Iterator[Any]:
        """One iteration's passes: this rank's slice, or its micro-batches of at most the
        plan's memory cap for this rank (gradients accumulate; the update is unchanged)."""
        assert self._sampler is not None and self._source is not None
        self.timer.begin()
        sizes = self._plan.batch_sizes
        idx = self._sampler.local_indices(it, sizes, self.rank)
        self._local = len(idx)
        self._batch_iteration = it
        self._synced = self._withdrawn = False
        cap = self._guard.cap(self._plan)
        self._source.expect(self._passes_under(sizes, cap))
        self._data_pending = True
        while True:
            chunks = self._chunks(idx, sizes, cap)
            self._passes, self._pass = tuple(len(c) for c in chunks), 0
            self._loss_acc, self._count_acc = None, 0.0
            if len(chunks) > 1:
                self.timer.note_pass_size(max(self._passes))
            failed = yield from self._run_passes(it, chunks)
            if failed is None:
                break
            cap = self._recover(*failed)
            self._source.expect(self._passes_under(sizes, cap))
        if not self._withdrawn:
            self._complete(it)

    def _passes_under(self, sizes: tuple[int, ...], cap: int | None) -> Passes:
        """This rank's passes at any coming iteration, were the plan to stay."""
        sampler, rank, total = self._sampler, self.rank, self._total
        assert sampler is not None

        def passes(iteration: int) -> list[torch.Tensor]:
            if iteration >= total:
                return []
            return self._chunks(sampler.local_indices(iteration, sizes, rank), sizes, cap)

        return passes

    def _chunks(
        self, idx: torch.Tensor, sizes: tuple[int, ...], cap: int | None
    ) -> list[torch.Tensor]:
        """This rank's passes: its share, cut at its memory cap; under sharding, as many passes
        as the rank that needs most (every rank joins every layer's collectives)."""
        if isinstance(self._sync, ShardedSync):
            caps = [self._plan.cap_of(r) for r in range(len(sizes))]
            return equal_passes(sizes, caps, self.rank, idx)
        return [idx] if cap is None or len(idx) <= cap else list(idx.split(cap))

    def _run_passes(
        self, it: int, chunks: list[torch.Tensor]
    ) -> Generator[Any, None, tuple[int, BaseException] | None]:
        """Yield each pass; the failing pass's size and error when one ran out of memory.

        A pass's samples are taken just before it runs, not all of an iteration's at once: only
        one pass's inputs are on the device at a time (a pass's peak is its own), and on CUDA
        the host can gather the next pass while the device still computes this one, as a plain
        loop does. The data phase ends with the first pass's samples; later passes' count as
        compute."""
        assert self._source is not None and self._sync is not None
        for i, chunk in enumerate(chunks):
            # DDP: only the last pass with samples all-reduces; the others accumulate (no_sync)
            self._sync.expect(i + 1 == len(chunks) and len(chunk) > 0)
            batch = self._source.take(it, chunk) if len(chunk) else self._source.empty()
            part = to_device(batch, self.device)
            del batch
            if self._data_pending:
                self.timer.data_done()
                self._data_pending = False
            self._awaiting_backward = True
            yield part
            del part
            exc = self._guard.take_pending()
            if exc is not None:
                return self._passes[self._pass], exc
            if self._awaiting_backward:
                raise RuntimeError(
                    "a batch of ctx.batches() went without ctx.backward(loss) (or "
                    "ctx.step(loss)): call it once for every batch, on every rank"
                )
            if self._withdrawn:
                return None
        return None

    def _recover(self, size: int, exc: BaseException) -> int:
        """Free what the failed attempt holds; the smaller cap to redo the share with."""
        assert self._sync is not None
        self._awaiting_backward = False
        self._sync.discard()  # the partial gradients of the passes so far
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

    def _arm(self) -> None:
        """Before the iteration's last backward: what its all-reduce carries."""
        assert self._sync is not None and self.model is not None
        it = self.iteration
        last = it + 1 >= self._total
        sharded = isinstance(self._sync, ShardedSync)  # (shards differ by rank: nothing to compare)
        self._check = ((it + 1) % self.replica_check_every == 0 or last) and not sharded
        self._sync.arm(
            self._loss_acc,
            self._count_acc,
            stop=self._stop_asked,
            checksum=parameter_checksum(self.model.parameters()) if self._check else None,
            read=it % self.loss_every == 0 or last,
            on_launch=self._pad,
        )

    def _pad(self) -> None:
        """An emulated device's compute lasts as long as its emulated speed says: padded just
        before the gradients leave this rank (after backward, or at DDP's first bucket)."""
        if self.emulator is not None and self._local > 0:
            elapsed = self.timer.compute_elapsed_ms()
            self.timer.add_padding(
                self.emulator.pad(self.iteration, self._local, elapsed, self._passes)
            )

    def _reduce(self) -> float | None:
        """The iteration's all-reduce, after its last pass (with DDP: its end, since backward
        summed the buckets as it went)."""
        assert self._sync is not None and self.model is not None
        it = self.iteration
        last = it + 1 >= self._total
        check = self._check
        self._sync.launch()
        self.timer.compute_done()
        reduced = self._sync.collect()
        self.timer.sync_done()
        self._loss_acc = None
        if reduced.withdrawn:
            self._abandon(it, "a rank left its loop")
            return None
        if reduced.stop:
            self._stopping = True
            self.stats.stopped_at = it + 1
        if check:
            self._verify(it, reduced.checksums or {})
        self._synced = True
        if not (it % self.loss_every == 0 or last or self._stopping):
            return None
        value = float(reduced.loss.item())
        self.stats.record_loss(it, value, last=last or self._stopping)
        if self.rank == self._plan.leader:  # every active rank holds the same value
            self._metrics.loss(it, value)
        return value

    def _abandon(self, it: int, why: str) -> None:
        """This iteration's update is not made (its gradients are incomplete); the loop ends."""
        assert self._sync is not None
        self._sync.zero_grad()
        self._withdrawn = self._stopping = True
        self.stats.stopped_at = it
        log.warning("rank %d: %s; the job ends before iteration %d's update", self.rank, why, it)

    def _verify(self, it: int, checksums: dict[int, tuple[float, float]]) -> None:
        """Every rank that sent a checksum holds the same parameters as the plan's leader."""
        self.stats.replica_checks += 1
        ref = self._plan.leader
        if ref not in checksums:
            return
        s0, a0 = checksums[ref]
        bad = [
            r
            for r, (s, a) in sorted(checksums.items())
            if abs(s - s0) > REPLICA_TOLERANCE * max(a, a0)
        ]
        if bad:
            sums = ", ".join(f"rank {r}: {checksums[r][0]:.8g}" for r in [ref, *bad])
            raise ReplicaDivergence(
                f"the replicas' parameters differ before iteration {it}'s update: rank(s) "
                f"{bad} differ from rank {ref} (parameter sums {sums}). A step ran on some "
                "ranks only: an optimizer or scheduler step outside `if ctx.sync_gradients:`, "
                "code that depends on ctx.rank, or a random draw that changes parameters"
            )

    def _complete(self, it: int) -> None:
        """After the user's code of the iteration: its record, its counts, a checkpoint."""
        assert self._sampler is not None and self._sync is not None
        self._emit(self.timer.finish(it, self._plan.version, self._local))
        if self._sync.flag_seen() and self._flush is not None:
            self._flush()  # another rank's time jumped: the server needs this rank's records too
        self.stats.iterations += 1
        self.stats.samples_seen += self._local
        self.stats.global_samples += self._sampler.global_count(it)
        self.iteration += 1
        self._maybe_checkpoint()

    def _left_loop(self) -> None:
        """The user's loop stopped asking for batches before the job's end. If the iteration's
        update was made, it is complete; at the job's end that is the end. Otherwise the other
        ranks are on their way to an all-reduce this rank will not feed: it joins with a
        withdrawal instead, so they end there without that update rather than wait for it
        until the collective timeout."""
        if self._synced and not self._withdrawn:
            self._complete(self.iteration)
            if self.iteration >= self._total or self._stopping:
                self._end()
                return
        if self._withdrawn or not self._sync_reads_every_iteration():
            return
        try:
            self._withdraw()
        except Exception as exc:  # best effort: this rank is leaving anyway
            log.warning("rank %d: could not withdraw from the job: %r", self.rank, exc)

    def _sync_reads_every_iteration(self) -> bool:
        return self._sync is not None and self._sync.reads_back_cheaply and self._sync.withdraws

    def _withdraw(self) -> None:
        assert self._sync is not None
        it = self.iteration
        if self._synced:  # between iterations: meet the others at the next boundary first
            self.agreement.at_boundary(it)
            if self.membership.excluded:
                return
            self._plan = self.agreement.current
        log.warning("rank %d: left its loop at iteration %d; ending the job there", self.rank, it)
        self._sync.zero_grad()
        self._sync.reduce(None, 0.0, withdraw=True)
        self._withdrawn = self._stopping = True
        self.stats.stopped_at = it
        self._end()

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
