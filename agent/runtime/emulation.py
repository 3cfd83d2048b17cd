"""Emulated heterogeneity: make a CPU worker take as long as a slower (or faster) GPU would.

On machines without mixed GPUs every rank runs on the same kind of hardware, so Evenflow pads each
worker's *real* compute phase up to a target from its :class:`~contract.spec.EmulatedWorker`::

    target_ms(iteration, b) = factor(iteration) * (intercept_ms + per_sample_ms * b)   for b > 0
    target_ms(iteration, 0) = 0         (a worker given 0 samples computes nothing, sleeps not)

``factor`` is the product of the factors of every :class:`~contract.spec.Slowdown` whose
``[from_iteration, to_iteration)`` covers the iteration (1 when none does). When the real compute
already took longer than the target nothing is padded; the measured time is what is reported.

Memory. With ``memory_mb`` set, a pass of ``b`` samples needs ``memory_base_mb +
memory_per_sample_mb * b``; :meth:`Emulator.allocate` raises a real ``torch.OutOfMemoryError``
(the exception CUDA's caching allocator raises) when that exceeds ``memory_mb``, so the whole
out-of-memory path runs on CPU, and returns the figure as the pass's peak memory otherwise.

Emulation is a labelled mode, never silent: :attr:`Emulator.emulated` is ``True`` and
:data:`EMULATED_LABEL` is what callers put in logs and results. The wire telemetry records carry no
flag of their own; the job spec's ``emulation`` field labels the job on the server.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from contract.spec import EmulatedWorker

EMULATED_LABEL = "emulated"


class Emulator:
    """Pads one rank's compute phase to its emulated speed."""

    emulated = True

    def __init__(
        self,
        worker: EmulatedWorker,
        *,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.worker = worker
        self._sleep = sleep
        self.padded_ms = 0.0
        """Total time slept so far."""

    def factor(self, iteration: int) -> float:
        f = 1.0
        for s in self.worker.slowdowns:
            if s.from_iteration <= iteration < s.to_iteration:
                f *= s.factor
        return f

    def target_ms(self, iteration: int, batch_size: int) -> float:
        if batch_size <= 0:
            return 0.0
        w = self.worker
        return self.factor(iteration) * (w.intercept_ms + w.per_sample_ms * batch_size)

    def allocate(self, batch_size: int) -> float | None:
        """The emulated peak memory (MB) of one pass of ``batch_size`` samples, or None when
        memory is not emulated; raises ``torch.OutOfMemoryError`` when it does not fit."""
        w = self.worker
        if w.memory_mb is None:
            return None
        need = w.peak_memory_mb(batch_size)
        if need > w.memory_mb:
            raise torch.OutOfMemoryError(
                f"{EMULATED_LABEL} out of memory: a pass of {batch_size} samples needs "
                f"{need:.0f} MiB, the device has {w.memory_mb} MiB"
            )
        return need

    def pad(
        self, iteration: int, batch_size: int, elapsed_ms: float, passes: tuple[int, ...] = ()
    ) -> float:
        """Sleep until the compute phase has lasted ``target_ms`` (summed over ``passes``, the
        sizes of the accumulated passes, when there are several); return the ms slept."""
        sizes = passes or (batch_size,)
        target = sum(self.target_ms(iteration, b) for b in sizes)
        remaining = target - elapsed_ms
        if remaining <= 0:
            return 0.0
        self._sleep(remaining / 1000.0)
        self.padded_ms += remaining
        return remaining
