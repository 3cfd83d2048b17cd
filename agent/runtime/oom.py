"""Out-of-memory recovery inside an iteration: redo this rank's passes smaller, lose nothing.

A rank's share of an iteration runs as passes (one, or several under a memory cap) whose
gradients accumulate locally; the gradient all-reduce comes only after the last pass. So when a
pass runs out of device memory (``torch.OutOfMemoryError``, raised by CUDA's caching allocator or
by an emulated device), nothing has left the rank yet: it frees what it holds (the partial
gradients, the batch, CUDA's cached blocks), lowers its cap below the failing size and redoes its
whole share of the iteration in smaller passes, while the other ranks wait in the all-reduce.
The update is still exactly single-process SGD on the global batch, no rank discards anything,
and no iteration is lost; the iteration's telemetry carries ``oom_batch`` so the control plane
records an ``oom`` event, caps the rank below that size and plans again.

The lowered cap holds while the plan in force stays; the next plan carries the control plane's
cap, which stays below the smallest size that ever failed (so does this guard). A rank that runs
out of memory with a single sample per pass ``MAX_SINGLE_SAMPLE_OOMS`` times fails the job with
:class:`OutOfMemoryFailure`, naming why.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.runtime.plan_sync import RuntimePlan

MAX_SINGLE_SAMPLE_OOMS = 3
"""Out-of-memory errors at one sample per pass a rank tolerates (fragmentation can pass)."""


class OutOfMemoryFailure(RuntimeError):
    """A rank ran out of memory repeatedly with one sample per pass: the model does not fit."""


@dataclass
class MemoryGuard:
    """One rank's memory cap as its own out-of-memory errors have taught it."""

    rank: int
    smallest_failure: int | None = None
    """The smallest pass size that ran out of memory on this rank."""
    lowered: tuple[int, int] | None = None
    """(plan version, cap) after a failure under that plan."""
    single_failures: int = 0
    pending: BaseException | None = None
    """An out-of-memory error the loop body reported (``EvenflowContext.recoverable``)."""

    def cap(self, plan: RuntimePlan) -> int | None:
        """The most samples per pass under ``plan``: its cap, tightened by what failed here."""
        caps = [plan.cap_of(self.rank)]
        if self.smallest_failure is not None:
            caps.append(max(1, self.smallest_failure - 1))
        if self.lowered is not None and self.lowered[0] == plan.version:
            caps.append(self.lowered[1])
        known = [c for c in caps if c is not None]
        return min(known) if known else None

    def failed(self, plan_version: int, size: int, exc: BaseException) -> int:
        """Record a pass of ``size`` that ran out of memory; the cap to redo the share with."""
        if size <= 1:
            self.single_failures += 1
            if self.single_failures >= MAX_SINGLE_SAMPLE_OOMS:
                raise OutOfMemoryFailure(
                    f"rank {self.rank} ran out of device memory {self.single_failures} times "
                    "with a single sample per pass: the model does not fit this device"
                ) from exc
        cap = max(1, size // 2)
        self.smallest_failure = (
            size if self.smallest_failure is None else min(self.smallest_failure, size)
        )
        self.lowered = (plan_version, cap)
        return cap

    def take_pending(self) -> BaseException | None:
        exc, self.pending = self.pending, None
        return exc
