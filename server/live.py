"""Waking live dashboard streams when a job's telemetry is stored.

The telemetry ingest route calls :func:`telemetry_stored` after its commit; every open stream
of that job (``GET /api/v1/jobs/{id}/stream``) wakes and reads the new rows at once. The
notifier only shortens the wait: streams also poll the database by id cursor, so rows written
by another server process still arrive within one poll interval.

Ingest runs in worker threads and streams on the event loop, so a wake-up crosses threads
with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator


class Waiter:
    """One stream's wake-up flag, set from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._event = asyncio.Event()

    def wake(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting
            self._loop.call_soon_threadsafe(self._event.set)

    async def wait(self, timeout_s: float) -> bool:
        """True if woken before ``timeout_s``; the flag is cleared either way."""
        try:
            await asyncio.wait_for(self._event.wait(), timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            self._event.clear()


class TelemetryNotifier:
    """Per-job sets of waiting streams."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[int, set[Waiter]] = {}

    @contextlib.contextmanager
    def watch(self, job_id: int) -> Iterator[Waiter]:
        """A waiter woken on each store of ``job_id``'s telemetry, for the ``with`` block."""
        waiter = Waiter(asyncio.get_running_loop())
        with self._lock:
            self._waiters.setdefault(job_id, set()).add(waiter)
        try:
            yield waiter
        finally:
            with self._lock:
                waiters = self._waiters.get(job_id)
                if waiters is not None:
                    waiters.discard(waiter)
                    if not waiters:
                        del self._waiters[job_id]

    def notify(self, job_id: int) -> None:
        with self._lock:
            waiters = list(self._waiters.get(job_id, ()))
        for waiter in waiters:
            waiter.wake()

    def watching(self, job_id: int) -> int:
        with self._lock:
            return len(self._waiters.get(job_id, ()))


def telemetry_stored(notifier: TelemetryNotifier, job_id: int, accepted: int) -> None:
    """The ingest route's hook: wake this job's streams if any new row was stored."""
    if accepted:
        notifier.notify(job_id)


class StreamSlots:
    """How many live streams each token holds open in this process, capped per token
    (``Settings.max_streams_per_token``): a client that opens streams without closing them
    (or a leaked token) cannot hold the server's connections and database polls."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._open: dict[int, int] = {}
        self._lock = threading.Lock()

    def take(self, token_id: int) -> bool:
        """Take one of the token's slots; False when all ``cap`` are in use."""
        with self._lock:
            held = self._open.get(token_id, 0)
            if held >= self.cap:
                return False
            self._open[token_id] = held + 1
            return True

    def give_back(self, token_id: int) -> None:
        with self._lock:
            held = self._open.get(token_id, 0) - 1
            if held > 0:
                self._open[token_id] = held
            else:
                self._open.pop(token_id, None)

    def held(self, token_id: int | None = None) -> int:
        """Slots in use: the token's, or all of them."""
        with self._lock:
            return sum(self._open.values()) if token_id is None else self._open.get(token_id, 0)
