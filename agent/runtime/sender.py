"""A best-effort batching sender: what the runtime uses to post timings and metrics.

:class:`BatchSender` owns a daemon thread. The training loop calls :meth:`~BatchSender.submit`,
which only appends to a bounded queue under a lock: it never blocks on the network and never
raises. The thread posts a list of items through the injected ``post`` callable whenever
``flush_records`` items are queued or ``flush_interval_s`` has passed, and on failure retries
with exponential back-off. What a batch looks like on the wire is ``post``'s business
(:class:`~agent.runtime.telemetry.TelemetrySender` and
:class:`~agent.runtime.metrics.MetricSender` wrap it), so both share one queue discipline.

Accounting is exact: ``submitted == delivered + dropped + pending``.

- The queue holds at most ``max_buffer`` items; when it is full the *oldest* is dropped and
  counted. A batch in flight (at most ``max_batch`` items) is outside the queue; if its post
  fails, it goes back to the front, and the queue is trimmed to its bound again.
- A post that raised may still have been stored by the server, so a retried batch can carry
  items the server already has. That is safe: the server deduplicates on each item's key.
- A post that raises :class:`TelemetryClosed` (the control plane answered that the job has
  ended) ends delivery: what is queued is dropped (and counted), and the next
  :meth:`~BatchSender.submit` raises :class:`TelemetryClosed` into the training loop, the one
  error it ever raises, so the rank stops rather than training on for a job that is over.
- :meth:`~BatchSender.close` flushes what is left, retrying until its deadline, then returns
  the final :class:`TelemetryStats`; whatever is still pending then is lost (and counted).
- :meth:`~BatchSender.flush_soon` makes the thread post at once (unless it is backing off after
  a failure), with ``urgent`` set for that post.
- :meth:`~BatchSender.settle` waits (bounded) until every item submitted so far is delivered:
  the training loop calls it before a checkpoint, so that a checkpoint, which a restarted job
  resumes from, never holds iterations whose records are still only in this process. It
  gives up at once while posts fail: training never waits on a control plane that is down.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from agent.backoff import Backoff

log = logging.getLogger("evenflow.runtime.sender")

T = TypeVar("T")

PostItems = Callable[[list[T], bool], object]
"""Sends one batch of items (``urgent`` second); raises on any failure (its return value is
ignored), :class:`TelemetryClosed` when the control plane takes no more."""


class TelemetryClosed(Exception):
    """The control plane takes no more telemetry for this job: it has ended (409), or the
    rank's credential died with it (401). Training stops; the worker exits as stopped."""


CLOSE_RETRY_S = 0.2
"""Longest wait between retries once closing (the close deadline bounds the total)."""
SETTLE_S = 5.0
"""Longest :meth:`BatchSender.settle` waits (a relay that neither answers nor fails)."""


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


class BatchSender(Generic[T]):
    """Batches items and posts them from a background thread; see the module docstring."""

    def __init__(
        self,
        post: PostItems[T],
        *,
        max_batch: int,
        what: str = "telemetry",
        flush_records: int = 64,
        flush_interval_s: float = 2.0,
        max_buffer: int = 20_000,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
    ) -> None:
        if max_batch < 1 or max_buffer < 1 or flush_records < 1:
            raise ValueError("max_batch, max_buffer and flush_records must be at least 1")
        self._post = post
        self.what = what
        self.flush_records = flush_records
        self.flush_interval_s = flush_interval_s
        self.max_buffer = max_buffer
        self.max_batch = max_batch
        self._backoff = Backoff(backoff_initial_s, backoff_max_s)
        self._queue: deque[T] = deque()
        self._in_flight = 0
        self._cond = threading.Condition()
        self._closing = False
        self._closed: TelemetryClosed | None = None
        self._urgent = False
        self._hurry = False  # post now, not urgent (settle)
        self._deadline = float("inf")
        self._submitted = self._delivered = self._dropped = self._failures = self._posts = 0
        self._thread = threading.Thread(target=self._run, name=f"evenflow-{what}", daemon=True)
        self._thread.start()

    def submit(self, record: T) -> None:
        """Queue an item (never blocks on the network, never raises for a full queue); raises
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

    def settle(self, timeout_s: float = SETTLE_S) -> bool:
        """Post what is queued now and wait until every item submitted before the call has
        left the queue (delivered, or dropped), at most ``timeout_s``; returns at once, False,
        while the sender is backing off after a failure (or once a post fails meanwhile)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            target = self._submitted
            failures = self._failures
            self._hurry = True
            self._cond.notify_all()
            while self._submitted - len(self._queue) - self._in_flight < target:
                left = deadline - time.monotonic()
                if (
                    left <= 0
                    or self._backoff.failing
                    or self._failures != failures
                    or self._closed is not None
                    or not self._thread.is_alive()
                ):
                    return False
                self._cond.wait(left)
            return True

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

    def start_closing(self, deadline_s: float = 5.0) -> None:
        """Begin :meth:`close` without waiting: flush, trying until ``deadline_s`` from now
        (so several senders close within one deadline). Later calls keep the first deadline."""
        with self._cond:
            if not self._closing:
                self._closing = True
                self._deadline = time.monotonic() + deadline_s
            self._cond.notify()

    def close(self, deadline_s: float = 5.0) -> TelemetryStats:
        """Flush what is queued, trying until ``deadline_s`` from now (or the deadline of an
        earlier :meth:`start_closing`); then stop."""
        self.start_closing(deadline_s)
        with self._cond:
            wait = max(0.0, self._deadline - time.monotonic())
        self._thread.join(wait + 0.5)  # a post hung past the deadline is abandoned
        stats = self.stats
        if stats.pending or stats.dropped:
            log.warning(
                "%s closed with %d lost, %d dropped", self.what, stats.pending, stats.dropped
            )
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
                        self._urgent or self._hurry or len(self._queue) >= self.flush_records
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
                self._hurry = self._hurry and len(self._queue) > 0
                self._in_flight = n
            last_attempt = time.monotonic()
            ok = self._send(batch, urgent)
            with self._cond:
                self._in_flight = 0
                if self._closed is not None:  # the job ended: nothing more will be taken
                    self._dropped += n + len(self._queue)
                    self._queue.clear()
                    self._cond.notify_all()
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
                self._cond.notify_all()  # settle() waits on what left the queue

    def _send(self, batch: list[T], urgent: bool) -> bool:
        try:
            self._post(batch, urgent)
            return True
        except TelemetryClosed as exc:
            log.info("%s closed by the control plane: %s", self.what, exc)
            with self._cond:
                self._closed = exc
            return False
        except Exception as exc:  # best effort: never into the training loop
            if self._failures == 0 or self._failures % 20 == 19:
                log.warning("%s post of %d items failed: %r", self.what, len(batch), exc)
            return False
