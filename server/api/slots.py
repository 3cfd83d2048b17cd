"""The API process's database slots: a bound on the requests doing database work at once, that
hands a freed slot to a person's request before the fleet's heartbeats.

In a large fleet the heartbeats a change sends to the database (a job's start or end on its
hosts) queue for slots by the hundred, for seconds at a time. In one queue in arrival order, a
job submitted from the CLI or the dashboard, and the status polls after it, would wait behind
all of them (``docs/decisions/0005-heartbeat-groups.md`` has the figures). Heartbeats are the
fleet's background: a host counts as alive from its heartbeat's arrival, however long the
answer takes (``server.scale.host_answers.Liveness``). So requests that ask ``first`` (every
route but the heartbeat's database work) are handed a freed slot before any heartbeat waiting;
among each kind, the first come is the first served.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class DbSlots:
    """At most ``n`` holders at once; waiters that asked ``first`` are served before the rest,
    each kind in arrival order. For one event loop."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"database slots must be at least 1, not {n}")
        self.value = n
        """Slots free now."""
        self._first: deque[asyncio.Future[None]] = deque()
        self._rest: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> tuple[int, int]:
        """Requests waiting for a slot: (first, the rest)."""
        return len(self._first), len(self._rest)

    @asynccontextmanager
    async def take(self, *, first: bool = True) -> AsyncIterator[None]:
        """Hold a slot for the block; ``first=False`` for the fleet's heartbeats."""
        await self._acquire(first)
        try:
            yield
        finally:
            self._release()

    async def __aenter__(self) -> None:
        await self._acquire(True)

    async def __aexit__(self, *_: object) -> None:
        self._release()

    async def _acquire(self, first: bool) -> None:
        if self.value > 0 and not (self._first or self._rest):
            self.value -= 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._first if first else self._rest
        queue.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release()  # handed a slot as it was cancelled: hand it on
            else:
                with contextlib.suppress(ValueError):  # a release passed it over already
                    queue.remove(waiter)
            raise

    def _release(self) -> None:
        for queue in (self._first, self._rest):
            while queue:
                waiter = queue.popleft()
                if not waiter.done():
                    waiter.set_result(None)  # the slot passes to it, never counted free
                    return
        self.value += 1
