"""Group commit for telemetry posts: the posts that arrive together share one transaction.

A fleet's agents post their jobs' timings every 2 s, hundreds of posts a second. Each post
alone costs a hop to a worker thread, three statements and a commit (a WAL flush on
PostgreSQL), most of what the API process and PostgreSQL spend on telemetry (decision record
0004). Here one writer thread per server process takes every post that is
waiting when it is free, judges and stores them together (``telemetry.ingest_many``: one read of
the jobs, one of the agents' ranks, one insert) and commits once. Nothing waits on purpose: a
lone post is written at once, as before; under load the posts that queued while the last
transaction ran go together, so the number of transactions stays bounded by how long one takes,
not by the number of posts.

What a poster sees does not change: its request is answered after the commit that stored its
rows, with its own counts or its own refusal (a post refused for its job's state or its rights
does not affect the others in its group). A transaction that fails as a whole (the database went
away) is tried again one post at a time, so each post gets its own answer and one bad post
cannot fail the rest.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from server.handoff import answer
from server.services import telemetry
from server.services.telemetry import Outcome, Post

log = logging.getLogger(__name__)

MAX_GROUP_ROWS = 20_000
"""Rows one transaction takes at most (a post has at most 5,000); the rest wait for the next."""

# Urgent posts (a worker's iteration time jumped: a straggler may have begun) go first: the
# writer's next transaction is theirs alone, ahead of the posts queued before them: at load,
# the wait behind the groups ahead would be most of a straggler's detection delay. One thread still writes every group, and every
# insert holds a lock to its commit on PostgreSQL (``telemetry._PG_ID_ORDER``), so rows are
# committed in the order of their ids across processes; a host's relay posts a job's rows one
# post at a time, so no rank's urgent rows overtake its own earlier ones.


@dataclass
class _Waiting:
    post: Post
    loop: asyncio.AbstractEventLoop
    answer: asyncio.Future[tuple[int, int]]


class TelemetryWriter:
    """One writer thread for a server process's telemetry posts; ``store`` awaits a post's
    answer. The thread starts with the first post and stops at ``close``, having written
    what was queued before it."""

    def __init__(
        self,
        engine: Engine,
        write_lock: AbstractContextManager[Any],
        on_group: Callable[[int], None] | None = None,
    ) -> None:
        self.engine = engine
        self.write_lock = write_lock
        self.on_group = on_group
        """Called with the number of posts of each group written (a metric)."""
        self._running: tuple[threading.Thread, queue.SimpleQueue[_Waiting | None]] | None = None
        """The writer thread and its queue, from the first post until ``close``."""
        self._lock = threading.Lock()

    async def store(self, post: Post) -> tuple[int, int]:
        """(accepted, duplicates) once the post's rows are committed; its refusal raised."""
        loop = asyncio.get_running_loop()
        waiting = _Waiting(post, loop, loop.create_future())
        with self._lock:  # queued before any stop, or to a thread started after it
            if self._running is None:
                posts: queue.SimpleQueue[_Waiting | None] = queue.SimpleQueue()
                thread = threading.Thread(
                    target=self._run, args=(posts,), name="evenflow-telemetry-writer", daemon=True
                )
                thread.start()
                self._running = (thread, posts)
            self._running[1].put(waiting)
        return await waiting.answer

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued, then stop the thread (a later post starts another: an app's
        lifespan may run again, as a test client's does)."""
        with self._lock:
            running, self._running = self._running, None
        if running is not None:
            thread, posts = running
            posts.put(None)
            thread.join(timeout_s)

    def _run(self, posts: queue.SimpleQueue[_Waiting | None]) -> None:
        urgent: deque[_Waiting] = deque()
        regular: deque[_Waiting] = deque()
        stop = False
        while True:
            if not (urgent or regular):
                if stop:
                    return
                first = posts.get()
                if first is None:
                    return
                (urgent if first.post.batch.urgent else regular).append(first)
            while not stop:  # everything queued meanwhile, to serve urgent posts first
                try:
                    more = posts.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True  # what is queued before the stop is still written
                else:
                    (urgent if more.post.batch.urgent else regular).append(more)
            self._write(_group(urgent or regular))

    def _write(self, group: list[_Waiting]) -> None:
        try:
            with self.write_lock, self.engine.begin() as conn:
                outcomes: list[Outcome | BaseException] = list(
                    telemetry.ingest_many(conn, [w.post for w in group])
                )
        except Exception as exc:
            if len(group) > 1:  # each post on its own: its own answer, whatever the others
                for waiting in group:
                    self._write([waiting])
                return
            log.warning("telemetry of job %d not stored", group[0].post.job_id, exc_info=True)
            outcomes = [exc]
        if self.on_group is not None:
            self.on_group(len(group))
        for waiting, outcome in zip(group, outcomes, strict=True):
            answer(waiting.loop, waiting.answer, outcome)


def _group(waiting: deque[_Waiting]) -> list[_Waiting]:
    """The posts at the head of ``waiting`` (taken from it) up to ``MAX_GROUP_ROWS`` rows, and
    always the first."""
    group = [waiting.popleft()]
    rows = group[0].post.rows
    while waiting and rows + waiting[0].post.rows <= MAX_GROUP_ROWS:
        rows += waiting[0].post.rows
        group.append(waiting.popleft())
    return group
