"""Group commit for requests that queue for a database slot: those waiting together share one
transaction.

A heartbeat that changes something (a rank launched, running or ended; a job's start or end)
is worked out in the database, in one of the API process's database slots
(``AppContext.db_slots``). At fleet scale they come in bursts: a 256-rank job starts or ends on
32 hosts within one heartbeat period, and jobs start and end throughout. ``bench/fleet.py``
timed where such a heartbeat's time went at 1,250 hosts: waiting for a slot (p50 232 ms, p99
2.0 s), then holding it for about twice its transaction's time (a worker-thread hop, the
session, a commit, the event loop's turn to take the result). So when heartbeats queue, the
next slot freed takes every one waiting (up to ``max_group``) and works them out one after
another in one transaction, with one hop and one commit (``run``'s ``work``). Nothing waits on
purpose: a heartbeat that finds a slot free runs at once, alone, as before; grouping happens
only where heartbeats already waited.

Each request is still answered as if alone: ``work`` gives each item its own outcome (an
answer or an error), and a group whose transaction fails as a whole is worked again one item at
a time, so one item's refusal never fails another's. An item that must not share a
transaction (``alone``) is taken by itself.

Every request starts one *server* task, which waits for a slot and, once it has one, takes what
is queued: there are never fewer server tasks than items queued, so every item is taken, in
the order items arrived (the slots are FIFO); a server that finds the queue empty (its item was
taken by an earlier group) gives its slot back at once. A request cancelled while it waits (its
client went away) leaves its item queued: it is worked out anyway, like a request cancelled
mid-transaction, and its answer dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import anyio
from starlette.concurrency import run_in_threadpool

I = TypeVar("I")  # noqa: E741 - an item, as in the module's docstring
R = TypeVar("R")


@dataclass
class _Queued(Generic[I, R]):
    item: I
    alone: bool
    answer: asyncio.Future[R]


class SlotGroups(Generic[I, R]):
    """Items queued for ``slots``, taken in groups by the first slot free (see the module)."""

    def __init__(
        self,
        slots: anyio.Semaphore,
        work: Callable[[list[I]], list[R | BaseException]],
        max_group: int = 16,
        on_group: Callable[[int], None] | None = None,
    ) -> None:
        self.slots = slots
        self.work = work
        """Runs in a worker thread: the items' outcomes, in their order, one transaction (or
        one per item, should the group's fail)."""
        self.max_group = max_group
        self.on_group = on_group
        """Called with the size of every group taken (a metric)."""
        self._queue: deque[_Queued[I, R]] = deque()
        self._servers: set[asyncio.Task[None]] = set()

    async def run(self, item: I, alone: bool = False) -> R:
        """``item``'s outcome, once the transaction it was worked out in has committed."""
        queued = _Queued[I, R](item, alone, asyncio.get_running_loop().create_future())
        self._queue.append(queued)
        server = asyncio.ensure_future(self._serve())
        self._servers.add(server)  # held until done: the loop keeps only weak references
        server.add_done_callback(self._servers.discard)
        return await queued.answer

    def _take(self) -> list[_Queued[I, R]]:
        """The next group: the first item queued, and, unless it goes alone, every later one
        that may share (up to ``max_group``); the others stay queued, in order."""
        if not self._queue:
            return []
        first = self._queue.popleft()
        group = [first]
        if first.alone:
            return group
        kept: list[_Queued[I, R]] = []
        while self._queue and len(group) < self.max_group:
            more = self._queue.popleft()
            (kept if more.alone else group).append(more)
        self._queue.extendleft(reversed(kept))
        return group

    async def _serve(self) -> None:
        async with self.slots:
            group = self._take()
            if not group:
                return
            try:
                outcomes = await run_in_threadpool(self.work, [q.item for q in group])
            except BaseException as exc:  # the work itself broke: every item gets the error
                outcomes = [exc] * len(group)
                if not isinstance(exc, Exception):
                    _deliver(group, outcomes)
                    raise
        if self.on_group is not None:
            self.on_group(len(group))
        _deliver(group, outcomes)


def _deliver(group: list[_Queued[I, R]], outcomes: list[R | BaseException]) -> None:
    for queued, outcome in zip(group, outcomes, strict=True):
        if queued.answer.done():  # its request was cancelled
            continue
        with contextlib.suppress(asyncio.InvalidStateError):
            if isinstance(outcome, BaseException):
                queued.answer.set_exception(outcome)
            else:
                queued.answer.set_result(outcome)
