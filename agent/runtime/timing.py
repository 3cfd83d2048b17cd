"""Per-iteration phase timings of one rank: data, compute and sync.

- ``data_ms``: fetching this rank's local batch (indexing, collation, copy to the device).
- ``compute_ms``: forward and backward, plus any emulation padding (the emulated compute time).
- ``sync_ms``: the gradient all-reduce, including the wait for the slowest rank.

On the CPU every phase is timed with ``time.perf_counter``. On CUDA, compute and sync are timed
with CUDA events on the current stream, because the host returns long before the GPU finishes;
those events are read *later* (when they have completed, or at :meth:`IterationTimer.drain`), so
timing never forces a device synchronisation in the loop. Only emulation on CUDA, which needs the
real compute time on the host, synchronises (:meth:`IterationTimer.compute_elapsed_ms`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class IterationTiming:
    """One rank's timing of one iteration (what becomes a TelemetryRecord)."""

    iteration: int
    plan_version: int
    batch_size: int
    data_ms: float
    compute_ms: float
    sync_ms: float
    ts: float
    """Unix time (seconds) at the end of the iteration on this host."""
    peak_memory_mb: float | None = None
    """Peak device memory of the compute phase; None where it is not measured."""
    oom_batch: int | None = None
    """Size of a pass that ran out of memory in this iteration (then redone smaller)."""
    pass_size: int | None = None
    """The iteration's largest pass, when it ran more than one."""


@dataclass
class _Pending:
    iteration: int
    plan_version: int
    batch_size: int
    data_ms: float
    pad_ms: float
    ts: float
    events: tuple[torch.cuda.Event, ...]
    peak_memory_mb: float | None = None
    oom_batch: int | None = None
    pass_size: int | None = None


class IterationTimer:
    """Call the marks in order each iteration, then :meth:`finish`.

    ``begin`` -> ``data_done`` -> ``compute_done`` -> ``sync_done`` -> ``finish``. A rank with 0
    samples still calls them all (its compute phase is empty).
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.cuda = device is not None and device.type == "cuda"
        self.device = device
        self._t = [0.0, 0.0, 0.0, 0.0]
        self._pad_ms = 0.0
        self._peak_mb: float | None = None
        self._oom: int | None = None
        self._pass_size: int | None = None
        self._pending: deque[_Pending] = deque()
        if self.cuda:
            # A pool of (data_done, compute_done, sync_done) event sets; a set is reused once read.
            self._free = [tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))]
            self._events: tuple[torch.cuda.Event, ...] = self._free.pop()

    def begin(self) -> None:
        self._t[0] = time.perf_counter()
        self._pad_ms = 0.0
        self._peak_mb = None
        self._oom = None
        self._pass_size = None

    def data_done(self) -> None:
        self._t[1] = time.perf_counter()
        if self.cuda:
            self._events[0].record()
            # The caching allocator counts allocations when they are enqueued, on the host, so
            # the peak is read at compute_done without synchronising the device.
            torch.cuda.reset_peak_memory_stats(self.device)

    def note_peak_memory(self, mb: float) -> None:
        """Record the compute phase's peak memory where the device cannot (emulation); the
        largest value noted in an iteration is kept (one per micro-batch pass)."""
        self._peak_mb = mb if self._peak_mb is None else max(self._peak_mb, mb)

    def compute_elapsed_ms(self) -> float:
        """Real compute time so far in this iteration (synchronises the device on CUDA)."""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return float(self._events[0].elapsed_time(end))
        return (time.perf_counter() - self._t[1]) * 1000.0

    def add_padding(self, ms: float) -> None:
        """Count host-side padding (emulation) as compute time; on CPU the wall clock has it."""
        self._pad_ms += ms

    def note_pass_size(self, size: int) -> None:
        """The iteration's largest pass, when it differs from its batch (accumulation)."""
        self._pass_size = size

    def restart_peak(self) -> None:
        """Forget the peak so far (an attempt that ran out of memory is not the iteration's)."""
        self._peak_mb = None
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def note_oom(self, size: int) -> None:
        """A pass of ``size`` ran out of memory in this iteration (the smallest is kept)."""
        self._oom = size if self._oom is None else min(self._oom, size)

    def compute_done(self) -> None:
        self._t[2] = time.perf_counter()
        if self.cuda:
            self._events[1].record()
            if self._peak_mb is None:
                self._peak_mb = torch.cuda.max_memory_allocated(self.device) / 2**20

    def sync_done(self) -> None:
        self._t[3] = time.perf_counter()
        if self.cuda:
            self._events[2].record()

    def finish(self, iteration: int, plan_version: int, batch_size: int) -> list[IterationTiming]:
        """Close the iteration; return every timing now known (on CUDA, possibly earlier ones)."""
        t = self._t
        ts = time.time()
        data_ms = (t[1] - t[0]) * 1000.0
        if not self.cuda:
            return [
                IterationTiming(
                    iteration,
                    plan_version,
                    batch_size,
                    data_ms,
                    (t[2] - t[1]) * 1000.0,
                    (t[3] - t[2]) * 1000.0,
                    ts,
                    self._peak_mb,
                    self._oom,
                    self._pass_size,
                )
            ]
        self._pending.append(
            _Pending(
                iteration,
                plan_version,
                batch_size,
                data_ms,
                self._pad_ms,
                ts,
                self._events,
                self._peak_mb,
                self._oom,
                self._pass_size,
            )
        )
        self._events = (
            self._free.pop()
            if self._free
            else tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))
        )
        return self._collect(block=False)

    def drain(self) -> list[IterationTiming]:
        """Every timing not yet returned (waits for the device on CUDA)."""
        return self._collect(block=True) if self.cuda else []

    def _collect(self, *, block: bool) -> list[IterationTiming]:
        out = []
        while self._pending and (block or self._pending[0].events[2].query()):
            p = self._pending.popleft()
            p.events[2].synchronize()
            e = p.events
            out.append(
                IterationTiming(
                    p.iteration,
                    p.plan_version,
                    p.batch_size,
                    p.data_ms,
                    float(e[0].elapsed_time(e[1])) + p.pad_ms,
                    float(e[1].elapsed_time(e[2])),
                    p.ts,
                    p.peak_memory_mb,
                    p.oom_batch,
                    p.pass_size,
                )
            )
            self._free.append(e)
        return out
