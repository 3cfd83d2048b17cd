"""Best-effort delivery of per-iteration timings to the control plane.

:class:`TelemetrySender` is a :class:`~agent.runtime.sender.BatchSender` of
:class:`~contract.agent.TelemetryRecord` posted as :class:`~contract.agent.TelemetryBatch`: the
training loop's :meth:`~agent.runtime.sender.BatchSender.submit` never blocks on the network
and never raises but :class:`TelemetryClosed` once the job has ended; batches go out every
``flush_interval_s`` or ``flush_records`` records, retried with back-off, accounted exactly
(``submitted == delivered + dropped + pending``). The server deduplicates on (job, rank,
iteration), so a retried batch is safe.

Batching trades latency for load: at the default cadence the control plane hears of a worker's
slowdown up to ``flush_interval_s`` late, which for a straggler is iterations trained on a bad
plan. So :meth:`~TelemetrySender.flush_soon` makes the thread post at once (unless it is backing
off after a failure), in a batch marked ``urgent`` (the control plane then runs its next round for
the job at once). :class:`JumpWatch` decides when: the runtime watches each rank's compute time
and its whole iteration time (a slowdown starting shows in the straggler's compute and in every
other rank's wait; its end in the straggler's compute), a few records per change, never for
ordinary noise. The control plane judges an iteration once every rank has reported it, which is
why every rank flushes, not only the straggler.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from agent.runtime.sender import BatchSender, TelemetryClosed, TelemetryStats
from contract.agent import TelemetryBatch, TelemetryRecord
from contract.base import MAX_MS, MAX_TELEMETRY_RECORDS

__all__ = [
    "JumpWatch",
    "PostTelemetry",
    "TelemetryClosed",
    "TelemetrySender",
    "TelemetryStats",
    "clamp_ms",
]

PostTelemetry = Callable[[TelemetryBatch], object]
"""Sends one batch; raises on any failure (its return value is ignored)."""


def clamp_ms(ms: float) -> float:
    """A phase duration the wire accepts: finite, within [0, MAX_MS]."""
    if ms != ms:  # NaN
        return 0.0
    return min(max(ms, 0.0), MAX_MS)


class TelemetrySender(BatchSender[TelemetryRecord]):
    """Batches timing records and posts them as :class:`~contract.agent.TelemetryBatch` from a
    background thread (:class:`~agent.runtime.sender.BatchSender`); see the module docstring."""

    def __init__(
        self,
        post: PostTelemetry,
        *,
        flush_records: int = 64,
        flush_interval_s: float = 2.0,
        max_buffer: int = 20_000,
        max_batch: int = MAX_TELEMETRY_RECORDS,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
    ) -> None:
        if not 1 <= max_batch <= MAX_TELEMETRY_RECORDS:
            raise ValueError(f"max_batch must be in [1, {MAX_TELEMETRY_RECORDS}]")

        def send(records: list[TelemetryRecord], urgent: bool) -> object:
            return post(TelemetryBatch(records=records, urgent=urgent))

        super().__init__(
            send,
            what="telemetry",
            max_batch=max_batch,
            flush_records=flush_records,
            flush_interval_s=flush_interval_s,
            max_buffer=max_buffer,
            backoff_initial_s=backoff_initial_s,
            backoff_max_s=backoff_max_s,
        )


class JumpWatch:
    """Flags a duration that jumped away from its recent level.

    The level is the median of the last ``window`` durations observed under the same ``key``:
    what the level depends on, the batch size for compute time, the plan version for a whole
    iteration (a new key starts a new level). A duration is flagged when it is ``ratio`` times
    above or below that median: the first iterations of a slowdown (and of a recovery) are
    flagged until the median has moved to the new level, ``window // 2 + 1`` of them; noise
    within ``ratio`` never is. A key <= 0 (a compute phase with 0 samples) is ignored.
    """

    def __init__(self, *, ratio: float = 1.3, window: int = 5) -> None:
        if ratio <= 1.0 or window < 1:
            raise ValueError("ratio must exceed 1 and window be at least 1")
        self.ratio = ratio
        self.window = window
        self._key = -1
        self._recent: deque[float] = deque(maxlen=window)

    def observe(self, key: int, ms: float) -> bool:
        if key <= 0:
            return False
        if key != self._key:
            self._key = key
            self._recent.clear()
        jumped = False
        if len(self._recent) == self.window:
            ordered = sorted(self._recent)
            level = ordered[len(ordered) // 2]
            jumped = level > 0 and not level / self.ratio <= ms <= level * self.ratio
        self._recent.append(ms)
        return jumped
