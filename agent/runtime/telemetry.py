"""Best-effort delivery of per-iteration timings to the control plane.

:class:`TelemetrySender` owns a daemon thread. The training loop calls :meth:`~TelemetrySender.
submit`, which only appends to a bounded queue under a lock: it never blocks on the network and
never raises. The thread posts a :class:`~contract.agent.TelemetryBatch` through the injected
``post`` callable whenever ``flush_records`` records are queued or ``flush_interval_s`` has passed,
and on failure retries with exponential back-off.

Accounting is exact: ``submitted == delivered + dropped + pending``.

- The queue holds at most ``max_buffer`` records; when it is full the *oldest* is dropped and
  counted. A batch in flight (at most ``max_batch`` records) is outside the queue; if its post
  fails, it goes back to the front, and the queue is trimmed to its bound again.
- A post that raised may still have been stored by the server, so a retried batch can carry
  records the server already has. That is safe: the server deduplicates on (job, rank,
  iteration).
- A post that raises :class:`TelemetryClosed` (the control plane answered that the job has
  ended) ends delivery: what is queued is dropped (and counted), and the next
  :meth:`~TelemetrySender.submit` raises :class:`TelemetryClosed` into the training loop, the
  one error it ever raises, so the rank stops rather than training on for a job that is over.
- :meth:`~TelemetrySender.close` flushes what is left, retrying until its deadline, then returns
  the final :class:`TelemetryStats`; whatever is still pending then is lost (and counted).

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

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from agent.backoff import Backoff
from contract.agent import TelemetryBatch, TelemetryRecord
from contract.base import MAX_MS, MAX_TELEMETRY_RECORDS

log = logging.getLogger("evenflow.runtime.telemetry")

PostTelemetry = Callable[[TelemetryBatch], object]
"""Sends one batch; raises on any failure (its return value is ignored)."""


class TelemetryClosed(Exception):
    """The control plane takes no more telemetry for this job: it has ended (409), or the
    rank's credential died with it (401). Training stops; the worker exits as stopped."""


CLOSE_RETRY_S = 0.2
"""Longest wait between retries once closing (the close deadline bounds the total)."""


@dataclass(frozen=True)
class TelemetryStats:
    submitted: int
    delivered: int
    """Records in batches whose post returned without raising (re-sends counted again)."""
    dropped: int
    """Records removed unsent because the queue was full."""
    pending: int
    """Records still queued or in flight (at close: lost)."""
    failures: int
    """Posts that raised."""
    posts: int
    """Posts that succeeded."""


def clamp_ms(ms: float) -> float:
    """A phase duration the wire accepts: finite, within [0, MAX_MS]."""
    if ms != ms:  # NaN
        return 0.0
    return min(max(ms, 0.0), MAX_MS)


class TelemetrySender:
    """Batches records and posts them from a background thread; see the module docstring."""

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
        if max_buffer < 1 or flush_records < 1:
            raise ValueError("max_buffer and flush_records must be at least 1")
        self._post = post
        self.flush_records = flush_records
        self.flush_interval_s = flush_interval_s
        self.max_buffer = max_buffer
        self.max_batch = max_batch
        self._backoff = Backoff(backoff_initial_s, backoff_max_s)
        self._queue: deque[TelemetryRecord] = deque()
        self._in_flight = 0
        self._cond = threading.Condition()
        self._closing = False
        self._closed: TelemetryClosed | None = None
        self._urgent = False
        self._deadline = float("inf")
        self._submitted = self._delivered = self._dropped = self._failures = self._posts = 0
        self._thread = threading.Thread(target=self._run, name="evenflow-telemetry", daemon=True)
        self._thread.start()

    def submit(self, record: TelemetryRecord) -> None:
        """Queue a record (never blocks on the network, never raises for a full queue); raises
        :class:`TelemetryClosed` once the control plane has said the job ended."""
        with self._cond:
            if self._closed is not None:
                raise self._closed
            self._submitted += 1
            self._queue.append(record)
            self._trim()
            if len(self._queue) >= self.flush_records:
                self._cond.notify()

    def flush_soon(self) -> None:
        """Post what is queued now rather than at the next cadence (not while backing off)."""
        with self._cond:
            self._urgent = True
            self._cond.notify()

    @property
    def stats(self) -> TelemetryStats:
        with self._cond:
            return TelemetryStats(
                submitted=self._submitted,
                delivered=self._delivered,
                dropped=self._dropped,
                pending=len(self._queue) + self._in_flight,
                failures=self._failures,
                posts=self._posts,
            )

    def close(self, deadline_s: float = 5.0) -> TelemetryStats:
        """Flush what is queued, trying until ``deadline_s`` from now; then stop."""
        with self._cond:
            self._closing = True
            self._deadline = time.monotonic() + deadline_s
            self._cond.notify()
        self._thread.join(deadline_s + 0.5)  # a post hung past the deadline is abandoned
        stats = self.stats
        if stats.pending or stats.dropped:
            log.warning("telemetry closed with %d lost, %d dropped", stats.pending, stats.dropped)
        return stats

    def _trim(self) -> None:
        while len(self._queue) > self.max_buffer:
            self._queue.popleft()
            self._dropped += 1

    def _run(self) -> None:
        backoff = self._backoff
        last_attempt = time.monotonic()
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    if self._closing and (not self._queue or now >= self._deadline):
                        return
                    if self._closing:  # flush now; retry failures briskly until the deadline
                        delay = min(backoff.current_s, CLOSE_RETRY_S)
                    else:
                        delay = backoff.current_s or self.flush_interval_s
                    due = last_attempt + delay
                    full = not backoff.failing and (
                        self._urgent or len(self._queue) >= self.flush_records
                    )
                    if self._queue and (full or now >= due):
                        break
                    wait = due - now if self._queue else self.flush_interval_s
                    if self._closing:
                        wait = min(wait, self._deadline - now)
                    self._cond.wait(max(wait, 0.001))
                n = min(len(self._queue), self.max_batch)
                batch = [self._queue.popleft() for _ in range(n)]
                urgent, self._urgent = self._urgent, False
                self._in_flight = n
            last_attempt = time.monotonic()
            ok = self._send(batch, urgent)
            with self._cond:
                self._in_flight = 0
                if self._closed is not None:  # the job ended: nothing more will be taken
                    self._dropped += n + len(self._queue)
                    self._queue.clear()
                    return
                if ok:
                    self._delivered += n
                    self._posts += 1
                    backoff.succeeded()
                else:
                    self._failures += 1
                    self._queue.extendleft(reversed(batch))
                    self._trim()
                    backoff.failed()

    def _send(self, batch: list[TelemetryRecord], urgent: bool) -> bool:
        try:
            self._post(TelemetryBatch(records=batch, urgent=urgent))
            return True
        except TelemetryClosed as exc:
            log.info("telemetry closed by the control plane: %s", exc)
            with self._cond:
                self._closed = exc
            return False
        except Exception as exc:  # best effort: never into the training loop
            if self._failures == 0 or self._failures % 20 == 19:
                log.warning("telemetry post of %d records failed: %r", len(batch), exc)
            return False


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
