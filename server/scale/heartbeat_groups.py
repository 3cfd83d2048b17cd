"""Group commit for the heartbeats the database works out: those that queue while a group runs
go together, in one transaction.

A steady heartbeat is answered from memory (``server.scale.host_answers``); the rest (a rank
reported launching, running or ended, a new launch credential) are worked out in the database,
in bursts when a job's hosts all report its start or end. Alone, each costs a slot, a hop to a
worker thread, a transaction, and a second transaction to advance its jobs once its reports
have committed (``rank_reports.ready_to_advance``), the same job's for each of its hosts
(decision record 0005).

Here at most ``at_once`` groups run at a time, each in one database slot and one worker-thread
hop (:class:`HeartbeatGroups`). A group is every heartbeat waiting when a slot came, up to
``max_size``: each heartbeat's work in turn, one commit, then one transaction that advances the
jobs all of them left (each job once, at the newest attempt reported). Nothing waits on
purpose: a lone heartbeat is worked out at once, as before; under load the number of
transactions stays bounded by how long one takes, not by the number of heartbeats.

What a host sees does not change: its answer, or its refusal, once the commit that stored its
reports is done. A group that fails as a whole (a refusal of one of its heartbeats, which may
have written before it was refused; the database aborting it to break a deadlock) is worked out
again one heartbeat at a time, so each gets its own answer and one cannot fail the rest. A
heartbeat reporting a failure is always worked out alone: it takes its jobs' report locks
during its own transaction (``rank_reports.apply_worker_reports``), and two groups taking them in
different orders would deadlock.

An answer is kept in memory (``HostAnswers.put``) only if no heartbeat after it in its group
changed anything its host's answer reads: it was built after the changes of those before it,
in the same transaction, but not after those of the ones that came later.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from fastapi.concurrency import run_in_threadpool
from sqlalchemy.orm import Session

from server.db import run_retrying
from server.handoff import answer
from server.scale.host_answers import EVERY_HOST, own_changes
from server.services import hosts, rank_reports

if TYPE_CHECKING:
    from server.context import AppContext

log = logging.getLogger(__name__)

TRANSACTION_ATTEMPTS = 3
"""Tries of a heartbeat's transaction (or its group's, or of the jobs they advance) when
another transaction is in its way: PostgreSQL aborted it to break a deadlock, or another
deleted its rows between its read and its write (a heartbeat's rank reports against the
controller's restart of their job: ``server.db.retryable``). The work changes nothing but the
database, so it runs again from the start instead of answering 500."""


@dataclass(frozen=True)
class Beat:
    """A heartbeat to work out in the database."""

    host_id: int
    work: Callable[[Session], hosts.Answered]
    """Its work in a transaction (``hosts.heartbeat``), which may run again from the start."""
    now: datetime
    alone: bool = False
    """Worked out in a transaction of its own (it reports a failure)."""


@dataclass(frozen=True)
class Worked:
    """A heartbeat worked out and committed."""

    answered: hosts.Answered
    own: frozenset[int] | None
    """The hosts its transaction invalidated at its commit (``HostAnswers.put``'s ``own``);
    None when its answer must not be kept (a later heartbeat of its group changed its host)."""


@dataclass
class _Waiting:
    beat: Beat
    asked: float
    loop: asyncio.AbstractEventLoop
    answer: asyncio.Future[Worked]


class HeartbeatGroups:
    """The heartbeats an API process works out in the database, in groups: ``work_out`` awaits
    one's outcome. Safe across event loops (a test client's requests may each have their
    own): a heartbeat is answered on its own loop."""

    def __init__(self, context: AppContext, *, at_once: int, max_size: int) -> None:
        if at_once < 1 or max_size < 1:
            raise ValueError(f"heartbeat groups: at_once {at_once} and max_size {max_size}")
        self.context = context
        self.at_once = at_once
        self.max_size = max_size
        self._waiting: deque[_Waiting] = deque()
        self._running = 0
        """Groups running or waiting for a slot (``_drain`` tasks)."""
        self._lock = threading.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        """Kept from the garbage collector while they run."""

    async def work_out(self, beat: Beat) -> Worked:
        """``beat`` worked out and committed, with those waiting with it; its refusal raised."""
        loop = asyncio.get_running_loop()
        waiting = _Waiting(beat, time.perf_counter(), loop, loop.create_future())
        with self._lock:
            self._waiting.append(waiting)
            start = self._running < self.at_once
            self._running += start
        if start:
            task = asyncio.ensure_future(self._drain())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await waiting.answer

    async def _drain(self) -> None:
        """Groups, one after another, while heartbeats wait. It stops under the lock that
        ``work_out`` queues under, so a heartbeat queued as the last group ends is never left
        without a group to take it."""
        stopped = False
        try:
            while True:
                with self._lock:
                    if not self._waiting:
                        self._running -= 1
                        stopped = True
                        return
                async with self.context.db_slots.take(first=False):  # after a person's request
                    slot = time.perf_counter()
                    with self._lock:
                        n = min(self.max_size, len(self._waiting))
                        group = [self._waiting.popleft() for _ in range(n)]
                    if not group:  # another group took them while this one waited for its slot
                        continue
                    try:
                        outcomes, ran = await run_in_threadpool(
                            self._timed, [w.beat for w in group]
                        )
                    except BaseException as exc:  # cancelled (the app is stopping), or a bug
                        for waiting in group:
                            answer(
                                waiting.loop,
                                waiting.answer,
                                exc if isinstance(exc, Exception) else _stopped(),
                            )
                        raise
                    self._observe(group, slot, ran)
                    for waiting, outcome in zip(group, outcomes, strict=True):
                        answer(waiting.loop, waiting.answer, outcome)
        finally:
            if not stopped:
                with self._lock:
                    self._running -= 1

    def _timed(self, beats: list[Beat]) -> tuple[list[Worked | Exception], tuple[float, float]]:
        """``work_out`` in a worker thread, with when it began and ended there."""
        began = time.perf_counter()
        outcomes = work_out(self.context, beats)
        return outcomes, (began, time.perf_counter())

    def _observe(self, group: list[_Waiting], slot: float, ran: tuple[float, float]) -> None:
        """The group's size, and each heartbeat's time by phase: ``slot`` (waiting for a slot:
        the groups before it included), ``thread`` (from the slot to a worker thread running
        the group: the process's other threads and event loop holding the CPU or the GIL) and
        ``transaction`` (the group's work and commits, tries again included)."""
        metrics = self.context.metrics
        metrics.heartbeat_group.observe(len(group))
        phases = metrics.heartbeat_phases
        waited, thread, transaction = (phases.labels(p) for p in ("slot", "thread", "transaction"))
        for waiting in group:
            waited.observe(slot - waiting.asked)
            thread.observe(ran[0] - slot)
            transaction.observe(ran[1] - ran[0])


def _stopped() -> Exception:
    return RuntimeError("the server stopped before this heartbeat was worked out")


def work_out(context: AppContext, beats: list[Beat]) -> list[Worked | Exception]:
    """Each of ``beats`` worked out and committed (in a worker thread): those that may go
    together in one transaction, the others (or all, should that transaction fail) alone."""
    together = [b for b in beats if not b.alone]
    outcomes: dict[int, Worked | Exception] = {}
    if len(together) > 1:
        try:
            outcomes = dict(zip(map(id, together), _together(context, together), strict=True))
        except Exception as exc:  # worked out again one at a time: each its own answer
            log.info("a group of %d heartbeats failed (%s); each alone", len(together), exc)
    return [outcomes[id(b)] if id(b) in outcomes else _alone(context, b) for b in beats]


def _together(context: AppContext, beats: list[Beat]) -> list[Worked | Exception]:
    """``beats`` in one transaction, then their jobs advanced in another (once committed)."""

    def once() -> list[tuple[hosts.Answered, frozenset[int]]]:
        with context.transaction(write=True) as session:
            return [own_changes(session, beat.work) for beat in beats]

    done = run_retrying(once, TRANSACTION_ATTEMPTS, "heartbeat group")
    committed = frozenset().union(*(own for _, own in done))
    worked: list[Worked] = []
    later: set[int] = set()
    """The hosts that the heartbeats after the one at hand changed."""
    for beat, (answered, own) in zip(reversed(beats), reversed(done), strict=True):
        kept = beat.host_id not in later and EVERY_HOST not in later
        worked.append(Worked(answered, committed if kept else None))
        later |= own
    worked.reverse()
    pending: dict[int, int] = {}
    for answered, _ in done:
        for job_id, attempt in answered.to_advance.items():
            pending[job_id] = max(attempt, pending.get(job_id, attempt))  # the newest is live
    if not pending:
        return list(worked)
    try:
        _advance(context, pending, max(b.now for b in beats))
    except Exception as exc:  # the reports stay committed; those that moved jobs fail
        return [exc if w.answered.to_advance else w for w in worked]
    return list(worked)


def _alone(context: AppContext, beat: Beat) -> Worked | Exception:
    """``beat`` in a transaction of its own, then its jobs advanced in another."""

    def once() -> tuple[hosts.Answered, frozenset[int]]:
        with context.transaction(write=True) as session:
            return own_changes(session, beat.work)

    try:
        answered, own = run_retrying(once, TRANSACTION_ATTEMPTS, "heartbeat")
        if answered.to_advance:
            _advance(context, answered.to_advance, beat.now)
    except Exception as exc:
        return exc
    return Worked(answered, own)


def _advance(context: AppContext, pending: Mapping[int, int], now: datetime) -> None:
    """The jobs (id: attempt) that reports committed before this may have moved on, advanced
    (``rank_reports.ready_to_advance``, ``rank_reports.advance_jobs``)."""
    waited: list[float] = []
    began = time.perf_counter()

    def once() -> None:
        with context.transaction(write=True) as session:
            rank_reports.advance_jobs(session, rank_reports.ready_to_advance(session, pending), now)
            waited[:] = [session.info.get(rank_reports.REPORT_LOCK_WAIT, -1.0)]

    run_retrying(once, TRANSACTION_ATTEMPTS, "jobs advanced by heartbeats")
    context.metrics.heartbeat_phases.labels("advance").observe(time.perf_counter() - began)
    if waited and waited[0] >= 0:  # (the last try's: a try run again has a new session)
        context.metrics.heartbeat_phases.labels("report_lock").observe(waited[0])
