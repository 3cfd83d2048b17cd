"""The controller: the control loop (``server.services.control_loop``), placement of pending
jobs (``server.services.scheduler``, on a thread of its own), the lost-host reaper and SQLite's
WAL checkpoints (``server.db.checkpoint``), exactly one per database.

``evenflow server`` runs it in a process of its own (``python -m server.controller``), so its
database reads and model fits never compete with request handling for the API process's GIL;
``create_app`` runs it in a thread instead when ``EVENFLOW_CONTROLLER=thread`` (the default of
an app built in-process: tests, ``LocalCluster``) and not at all with ``none``.

Only the holder of the database's controller lock (``server.locks.ControllerLock``) runs
rounds; another controller on the same database waits as a standby and takes over when the
holder dies. Plans it commits reach the API processes over the plan bus (``server.notify``).
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, update
from sqlalchemy import select as select_rows
from sqlalchemy.orm import Session, sessionmaker

from server.config import Settings
from server.db import checkpoint, make_engine, run_retrying, session_factory, transaction
from server.locks import ControllerLock, writer_lock_for
from server.models import ControllerFence
from server.notify import PLACEMENT, Bus, PgNotifyBus, open_bus
from server.scale.cache import Caches
from server.scale.host_answers import track
from server.serve import settle_heap
from server.services import control_loop, retention, scheduler
from server.services import hosts as host_service
from server.services.audit import record
from server.workqueue import CpuPace, RoundHooks, WorkQueue

log = logging.getLogger("evenflow.controller")

STANDBY_POLL_S = 1.0
"""How often a standby controller tries to take the controller lock."""

ROLL_UP_BUDGET_S = 2.0
"""At most this long of roll-up work per retention pass, so rounds are not held up."""

LOCK_CHECK_S = 5.0
"""How often a round under way uses the controller lock's connection (``ControllerLock.check``):
a round may take seconds at fleet scale, a minute on a starved machine, and a lock lost
meanwhile ended the turn only once the round had; an idle connection may also be ended by the
database (``idle_session_timeout``) or a pooler, which frees the lock."""

PLACE_GAP_S = 1.0
"""Placement passes start once per this many seconds when asked for all the time, after a
burst of ``PLACE_BURST`` at once (a token bucket: ``PassBudget``). A fleet asks for placement
several times a second (each submission, each job that ends), and a pass reads every pending
job and the free devices (``scheduler.place_pending``); a small cluster's few requests (a host
registered, a job submitted) are each answered at once."""

PLACE_BURST = 4

CONTROLLER_THREAD = "evenflow-controller"
"""The name of the thread an app runs its controller on (``Settings.controller = 'thread'``)."""
PLACEMENT_THREAD = "placement"
"""The name of the controller's placement thread (``Controller.placements``)."""

PLACE_EVERY_S = 5.0
"""...and at least this often, asked or not: the reasons of the jobs still waiting are brought
up to date."""

PLACE_JOIN_S = 30.0
"""How long a controller that lost its turn waits for a placement pass under way to end."""

PLACE_ATTEMPTS = 3
"""A placement transaction PostgreSQL aborts for another's sake runs again (``db.retryable``)
this many times at most: it runs beside the rounds' transactions (the reaper's, a sweep's)."""

WAKE_SLICE_S = 0.1
"""Between rounds the controller waits for a poke in slices this long, to notice ``stop``."""

REAP_ATTEMPTS = 3
"""The lost-host sweep's transaction is run again this many times at most when the database
aborts it for another's sake (``db.retryable``)."""


class FencedOut(RuntimeError):
    """This controller's turn is over: another controller took the lock (:class:`Fence`)."""


_FENCE_READ = (
    select_rows(ControllerFence.epoch).where(ControllerFence.id == 1).with_for_update(read=True)
)
_FENCE_TAKE = (
    update(ControllerFence)
    .where(ControllerFence.id == 1)
    .values(epoch=ControllerFence.epoch + 1)
    .returning(ControllerFence.epoch)
)


class Fence:
    """A controller's turn, as an epoch (``models.ControllerFence``): taken with the controller
    lock (on every backend: ``/metrics`` says whose turn it is and how many there were), and
    on PostgreSQL checked by each of the controller's write transactions (``enforced``).

    The lock is a session advisory lock on a connection of its own, so it can be lost while
    the controller's process goes on (that connection alone ended: an idle-session timeout, a
    pooler, a network blip); a standby then takes it, and the first controller learned of it
    only at its next round (``ControllerLock.check``), writing meanwhile through its other
    connections. A write transaction now reads the epoch ``FOR SHARE`` first: one begun before
    the takeover holds the row until it ends, so the new epoch (an ``UPDATE``) waits for it;
    one begun after finds the epoch not its own and stops (:class:`FencedOut`) before writing.
    SQLite needs none: its lock is a ``flock`` that only the process's end releases."""

    def __init__(self, epoch: int, *, enforced: bool) -> None:
        self.epoch, self.enforced = epoch, enforced

    @classmethod
    def take(
        cls, sessions: sessionmaker[Session], write_lock: AbstractContextManager[Any]
    ) -> Fence:
        """A new turn: the next epoch, with who took it and when."""
        holder = f"{socket.gethostname()}:{os.getpid()}"[:200]
        now = datetime.now(UTC)
        with write_lock, transaction(sessions) as s:
            epoch = s.execute(_FENCE_TAKE.values(holder=holder, since=now)).scalar_one_or_none()
            if epoch is None:  # its one row deleted by hand: the turns start again
                epoch = 1
                s.add(ControllerFence(id=1, epoch=epoch, holder=holder, since=now))
            enforced = s.get_bind().dialect.name == "postgresql"
        return cls(int(epoch), enforced=enforced)

    def check(self, session: Session) -> None:
        """Raise :class:`FencedOut` unless the epoch is still this turn's; holds the row (for
        share) to the end of ``session``'s transaction."""
        held = session.execute(_FENCE_READ).scalar_one()
        if held != self.epoch:
            raise FencedOut(
                f"another controller took over (epoch {held}; this one's was {self.epoch})"
            )


class Controller:
    """Rounds of the control loop and the reaper while :meth:`run`'s ``stop`` is unset."""

    def __init__(
        self,
        settings: Settings,
        *,
        engine: Engine,
        sessions: sessionmaker[Session],
        write_lock: AbstractContextManager[Any] | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.sessions = sessions
        self.write_lock: AbstractContextManager[Any] = write_lock or nullcontext()
        self.prefetch = write_lock is not None
        """Read a job's new telemetry before taking the writer lock; without one (PostgreSQL)
        the round's one transaction reads it, and a second read would double the cost."""
        self.state = control_loop.LoopState(min_decision_interval_s=1.0)
        self.rounds = 0
        self._wake = threading.Event()
        self._sweep_now = False
        """The next round sweeps live jobs (its interval passed, or a poke asked for one)."""
        self._place_wake = threading.Event()
        """A job was submitted or devices freed since placement last ran (``placements``)."""
        self.speed_history = scheduler.SpeedHistory()
        """Recent jobs' measured speeds, brought up to date by each placement pass."""
        self.round_stats = RoundStats(settings.controller_report_s)
        pace = CpuPace(settings.controller_cores) if settings.controller_cores > 0 else None
        self.queue = WorkQueue(pace, wait=self._wait_for_poke)
        """The order of a round's sweeps (urgent, hot, due), their back-off after a failure and
        their pace (``Settings.controller_cores``)."""
        self.active_since: datetime | None = None
        """When this controller last took the controller lock: no host's silence before it
        counts (no server may have been there to hear it)."""
        self.loss_paused = False
        """Whether the last lost-host sweep was paused by the loss guard."""
        self.retention = retention.Retention(
            retention.Window(settings.telemetry_keep_iterations, settings.telemetry_keep_running_s)
        )
        self.fence: Fence | None = None
        """This controller's turn, while it holds the lock: on PostgreSQL its write
        transactions check it (:meth:`_writing`). None: not running (a method called without
        :meth:`run`, as tests and benches do), unchecked."""
        self.turns = 0
        """How many times this controller has taken the lock."""
        self._lock: ControllerLock | None = None
        """The lock, while a turn's rounds run (:meth:`_rounds`)."""

    @contextmanager
    def _writing(self) -> Iterator[Session]:
        """A write transaction of this controller's, under the writer lock (SQLite), that
        stops before writing once another controller has taken over (:class:`Fence`)."""
        with self.write_lock, transaction(self.sessions) as s:
            if self.fence is not None and self.fence.enforced:
                self.fence.check(s)
            yield s

    def poke(self, job_ids: Iterable[int] = ()) -> None:
        """Run the next round now instead of at the end of the interval: a worker sent urgent
        telemetry (its iteration time jumped), so a straggler may have to be answered. Any
        thread may call it; the API processes reach a controller process over the wake bus.

        The poked jobs are swept first, and a job poked while a round is under way is swept
        next (``WorkQueue.add_urgent``): a round over every job with new data may take seconds,
        which a straggler would otherwise wait out.

        The id ``PLACEMENT`` asks for placement (a job was submitted, devices were added or
        freed): the placement thread places pending jobs now (``placements``); alone, it leaves
        the rounds to their cadence."""
        ids = set(job_ids)
        if PLACEMENT in ids:
            self._place_wake.set()
            ids.discard(PLACEMENT)
            if not ids:
                return
        self.queue.add_urgent(ids)
        self._sweep_now = True
        self._wake.set()

    def _pause(self, stop: threading.Event, seconds: float) -> bool:
        """Wait ``seconds`` or until poked; True when stopping. A wait that runs its course asks
        for a sweep (``_sweep_now``)."""
        deadline = time.monotonic() + seconds
        while not stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                self._sweep_now = True
                break
            if self._wake.wait(min(left, WAKE_SLICE_S)):
                self._wake.clear()
                break
        return stop.is_set()

    def run(self, stop: threading.Event) -> None:
        lock = ControllerLock(self.engine)
        while not stop.is_set():
            try:
                if not lock.try_acquire():
                    stop.wait(STANDBY_POLL_S)
                    continue
            except Exception:
                log.exception("could not take the controller lock")
                stop.wait(STANDBY_POLL_S)
                continue
            try:
                self._take_turn()
                self._rounds(stop, lock)
            except Exception:  # lost the lock (its connection broke): try to take it again
                log.exception("controller stopped; standing by")
            finally:
                self.fence = None
                lock.release()

    def _take_turn(self) -> None:
        """Begin a turn as the active controller, with the lock just taken: a new epoch, and no
        memory of an earlier turn's jobs. Another controller may have planned them since: this
        one takes them up from the database, as one that takes over does
        (``LoopState.recall``)."""
        self.fence = Fence.take(self.sessions, self.write_lock)
        if self.turns:
            self.state = control_loop.LoopState(min_decision_interval_s=1.0)
            self.queue.new_turn()
        self.turns += 1
        self.active_since = datetime.now(UTC)
        url = self.engine.url.render_as_string()
        log.info("controller active on %s (epoch %d)", url, self.fence.epoch)

    def _rounds(self, stop: threading.Event, lock: ControllerLock) -> None:
        done = threading.Event()  # this controller's turn is over: the placement thread ends
        placer = threading.Thread(
            target=self.placements, args=(stop, done), name=PLACEMENT_THREAD, daemon=True
        )
        placer.start()
        self._lock = lock
        try:
            self._round_loop(stop)
        finally:
            self._lock = None
            done.set()
            self._place_wake.set()
            placer.join(PLACE_JOIN_S)

    def _round_loop(self, stop: threading.Event) -> None:
        s = self.settings
        next_reap = time.monotonic() + s.reaper_interval_s
        next_roll_up = time.monotonic() + s.retention_interval_s
        while not self._pause(stop, s.rebalance_interval_s):
            self._check_lock()
            sweep, self._sweep_now = self._sweep_now, False
            try:
                if sweep:
                    self.sweep()
            except FencedOut:
                raise
            except Exception:  # a failed round must not stop the loop
                log.exception("rebalance sweep failed")
            try:
                checkpoint(self.engine)
            except Exception:
                log.exception("WAL checkpoint failed")
            if time.monotonic() >= next_reap:
                next_reap = time.monotonic() + s.reaper_interval_s
                try:
                    self.reap()
                except FencedOut:
                    raise
                except Exception:  # the sweep must never take the server down
                    log.exception("lost-host sweep failed")
            if time.monotonic() >= next_roll_up:
                try:
                    self.roll_up_telemetry()
                except FencedOut:
                    raise
                except Exception:
                    log.exception("telemetry roll-up failed")
                next_roll_up = time.monotonic() + s.retention_interval_s

    def sweep(self) -> None:
        """Re-plan running jobs on their cadence and watch for stragglers; each job in its own
        short transaction, so ingest is never held up for a whole round. The job's new telemetry
        is read first, outside the writer lock (``control_loop.prefetch``). The work queue
        orders them: jobs poked as urgent first, also those poked while the round is under way
        (``poke``), then hot jobs with new telemetry, then the due ones."""
        started, cpu = time.perf_counter(), time.thread_time()
        mark = self.state.telemetry_mark
        with transaction(self.sessions) as s:
            live = control_loop.live_jobs(s)
            due = control_loop.jobs_to_sweep(s, self.state, live)
        try:
            self._sweep_round(started, cpu, live, due)
        except BaseException:  # the jobs left unswept are found fresh again next round
            self.state.telemetry_mark = mark
            raise

    def _sweep_round(self, started: float, cpu: float, live: list[int], due: list[int]) -> None:
        """``sweep``'s jobs, ``due`` and those poked meanwhile, one after another in the work
        queue's order; the lock is checked every ``LOCK_CHECK_S`` meanwhile."""
        next_lock = time.monotonic() + LOCK_CHECK_S

        def check_lock() -> None:
            nonlocal next_lock
            if time.monotonic() >= next_lock:
                self._check_lock()
                next_lock = time.monotonic() + LOCK_CHECK_S

        hooks = RoundHooks(
            live_jobs=self._live_jobs,
            newest_telemetry=self._newest_telemetry,
            open_events=self._open_events,
            before_each=check_lock,
        )
        self.queue.start_round(due, live)
        while (job_id := self.queue.next(hooks)) is not None:
            self._sweep_one(job_id)
        tally = self.queue.end_round()
        self.state.forget(tally.live)
        self.rounds += 1
        for wait in tally.urgent_waits_s:
            self.round_stats.add_urgent_wait(1000 * wait)
        self.round_stats.add(
            1000 * (time.perf_counter() - started),
            len(live),
            tally.taken,
            time.thread_time() - cpu,
            paced_s=tally.paced_s,
        )

    def _check_lock(self) -> None:
        """Use the lock's connection (between rounds, and within one every ``LOCK_CHECK_S``),
        and end the turn if it broke."""
        if self._lock is None:
            return
        try:
            self._lock.check()
        except Exception as exc:
            raise FencedOut(f"the controller lock's connection broke: {exc}") from exc

    def _wait_for_poke(self, seconds: float) -> None:
        """Wait up to ``seconds`` for the pace (``WorkQueue.next``), or until a poke, whose
        wake-up is taken here: the round under way takes up the poked jobs next."""
        if self._wake.wait(seconds):
            self._wake.clear()

    def _live_jobs(self) -> list[int]:
        with transaction(self.sessions) as s:
            return control_loop.live_jobs(s)

    def _newest_telemetry(self, job_ids: list[int]) -> dict[int, int]:
        with transaction(self.sessions) as s:
            return control_loop.newest_telemetry(s, self.state, job_ids)

    def _open_events(self) -> list[int]:
        """Jobs with an open straggler event: hot while it is open (``WorkQueue.hot``)."""
        return [j for j, watch in self.state.watches.items() if watch.detector.any_open()]

    def _sweep_one(self, job_id: int) -> None:
        """``_sweep_job`` within a round, its outcome and CPU told to the work queue. One job's
        failing sweep (a deadlock, a bug its data brings out) is logged and the round goes on
        without it until its back-off is over; ``ROUND_GIVES_UP_AFTER`` in a row end the round
        (the exception is raised): the database is away."""
        before = time.thread_time()
        try:
            self._sweep_job(job_id)
        except FencedOut:
            raise  # not the job's fault: this controller's turn is over
        except Exception:
            wait = self.queue.done(job_id, ok=False, cpu_s=time.thread_time() - before)
            if self.queue.gave_up:
                raise
            log.exception(
                "sweep of job %d failed; the round goes on (next try in %g s)", job_id, wait
            )
        else:
            self.queue.done(job_id, ok=True, cpu_s=time.thread_time() - before)

    def _sweep_job(self, job_id: int) -> None:
        """Sweep one job in a transaction of its own. One that fails leaves nothing of the
        job in ``state``: what the sweep read and decided there (rows taken in, a decision
        made, a ladder step) went with its transaction, and kept, it was taken for done (a
        static job whose one plan after warm-up rolled back was never planned again). The
        next sweep takes the job up from the database, as a controller that takes over does."""
        self.state.swept_at[job_id] = time.monotonic()
        try:
            if self.prefetch:  # reads only, outside SQLite's writer lock
                with transaction(self.sessions) as s:
                    control_loop.prefetch(s, self.state, job_id)
            with self._writing() as s:
                for job, version in control_loop.sweep_job(s, self.state, job_id):
                    log.info("job %d: plan v%d", job, version)
        except BaseException:
            self.state.drop(job_id)
            raise

    def placements(self, stop: threading.Event, done: threading.Event) -> None:
        """Place pending jobs whenever asked (``poke`` with ``PLACEMENT``, or the reaper freed
        devices) and every ``PLACE_EVERY_S``, passes paced by ``PassBudget``, until ``stop``
        or ``done``. A thread of its own: a pass may take seconds at fleet scale
        (an ILP per job, solved by CBC in a process of its own), during which the rounds go on
        sweeping, and a submission never waits for the job being swept."""
        budget = PassBudget(PLACE_GAP_S, PLACE_BURST)
        while not (stop.is_set() or done.is_set()):
            self._place_wake.wait(PLACE_EVERY_S)
            wait = budget.wait_s(time.monotonic())
            if wait > 0 and (stop.wait(wait) or done.is_set()):
                break
            if stop.is_set() or done.is_set():
                break
            self._place_wake.clear()
            budget.take(time.monotonic())
            try:
                self.place()
            except FencedOut:
                log.warning("placement stopped: another controller took over")
                return
            except Exception:  # a failed pass must not stop placement
                log.exception("placement failed")

    def place(self) -> list[int]:
        """Place pending jobs on free devices (``scheduler.place_pending``) and bring the
        reasons of those still waiting up to date. Submissions never wait for this (it may
        take seconds: the placement solver); the placement thread runs it (``placements``).
        A transaction aborted for another's sake runs again (``PLACE_ATTEMPTS``). Returns the
        jobs placed."""

        def once() -> list[int]:
            with self._writing() as s:
                now = datetime.now(UTC)
                placed = scheduler.place_pending(
                    s, now, hold=self.settings.queue_hold, history=self.speed_history
                )
                return [job.id for job in placed]

        cpu = time.thread_time()
        try:
            placed_ids = run_retrying(once, PLACE_ATTEMPTS, "placement")
        finally:
            self.round_stats.add_placement(time.thread_time() - cpu)
        for job_id in placed_ids:
            log.info("job %d placed", job_id)
        return placed_ids

    def roll_up_telemetry(self, budget_s: float = ROLL_UP_BUDGET_S) -> int:
        """Roll up telemetry older than each job's retention window, a chunk per short
        transaction, for at most ``budget_s`` (the next pass goes on where this one stopped),
        and not while a job poked as urgent waits for its sweep (``WorkQueue.has_urgent``: a
        straggler's detection waits for no roll-up). Returns the raw rows removed."""
        deadline = time.monotonic() + budget_s
        with transaction(self.sessions) as s:
            jobs = self.retention.candidates(s)
        removed = 0
        for job_id in jobs:
            while time.monotonic() < deadline and not self.queue.has_urgent():
                with self._writing() as s:
                    moved = self.retention.roll_up(s, job_id)
                removed += moved
                if not moved:
                    break
            if time.monotonic() >= deadline or self.queue.has_urgent():
                break
        if removed:
            log.info("rolled up %d telemetry rows", removed)
        return removed

    def reap(self) -> host_service.LostSweep:
        """Mark silent hosts lost (``hosts.mark_lost``) and release the devices of those silent
        for good. A transaction PostgreSQL aborts (a deadlock with a heartbeat, a restart's
        rows changed under it: ``db.retryable``) runs again, up to ``REAP_ATTEMPTS`` times. A
        pause of the loss guard is logged, and audited once per episode."""
        s = self.settings
        guard = host_service.LossGuard(s.host_loss_pause_share, s.host_loss_pause_min_hosts)

        def once() -> tuple[host_service.LostSweep, list[tuple[str, int]], list[tuple[int, int]]]:
            with self._writing() as session:
                now = datetime.now(UTC)
                sweep = host_service.mark_lost(
                    session, now, s.host_lost_after_s, guard=guard, heard_since=self.active_since
                )
                self._note_pause(session, sweep)
                released = host_service.release_silent(session, now, s.host_lost_after_s)
                lost = [(h.name, h.id) for h in sweep.lost]
                return sweep, lost, [(d.id, d.host_id) for d in released]

        sweep, lost, freed = run_retrying(once, REAP_ATTEMPTS, "lost-host sweep")
        if lost or freed:  # jobs to place again, or devices to place them on
            self._place_wake.set()
        self.loss_paused = sweep.paused  # once committed: a retried sweep audits it again
        for name, host_id in lost:
            log.warning("host %s (%d) marked lost", name, host_id)
        for dev_id, host_id in freed:
            log.info("device %d of silent host %d released", dev_id, host_id)
        return sweep

    def _note_pause(self, session: Session, sweep: host_service.LostSweep) -> None:
        if sweep.paused:
            log.warning(
                "%d of %d active hosts are silent: none marked lost while more than %.0f%% are "
                "(is this server behind, or cut off from them?)",
                sweep.silent,
                sweep.active,
                100 * self.settings.host_loss_pause_share,
            )
        if sweep.paused != self.loss_paused:
            action = "hosts.loss_paused" if sweep.paused else "hosts.loss_resumed"
            detail = {"silent": sweep.silent, "active": sweep.active}
            record(session, "system", action, "hosts", detail)


class PassBudget:
    """A token bucket for placement passes: up to ``burst`` may start at once, then one per
    ``every_s``."""

    def __init__(self, every_s: float, burst: int) -> None:
        self.every_s, self.burst = every_s, burst
        self._tokens = float(burst)
        self._at = time.monotonic()

    def _refill(self, now: float) -> None:
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) / self.every_s)
        self._at = now

    def wait_s(self, now: float) -> float:
        """How long until a pass may start."""
        self._refill(now)
        return 0.0 if self._tokens >= 1 else (1 - self._tokens) * self.every_s

    def take(self, now: float) -> None:
        self._refill(now)
        self._tokens -= 1


class RoundStats:
    """Round times, summarised in the log every ``report_s`` seconds (how a round grows with
    the number of live jobs), with the CPU the
    rounds and the placement passes took meanwhile (each on its own thread, sharing the
    process's interpreter: what one takes, the other waits for)."""

    def __init__(self, report_s: float) -> None:
        self.report_s = report_s
        self._since = time.monotonic()
        self._ms: list[float] = []
        self._jobs: list[int] = []
        self._swept: list[int] = []
        self._cpu = 0.0
        self._lock = threading.Lock()
        self._passes = 0
        self._placement_cpu = 0.0
        self._urgent_ms: list[float] = []
        self._paced = 0.0

    def add_urgent_wait(self, ms: float) -> None:
        """A job poked as urgent waited ``ms`` for a round to take it up (the work under way
        when the poke came: a job's sweep, the reaper, a roll-up)."""
        self._urgent_ms.append(ms)

    def add_placement(self, cpu_s: float) -> None:
        """A placement pass took ``cpu_s`` of its thread's CPU (any thread may call it)."""
        with self._lock:
            self._passes += 1
            self._placement_cpu += cpu_s

    def add(
        self, ms: float, jobs: int, swept: int, cpu_s: float = 0.0, paced_s: float = 0.0
    ) -> None:
        """A round of ``ms`` over ``jobs`` live, ``swept`` of them, taking ``cpu_s`` of CPU and
        waiting ``paced_s`` of it for the pace (``CpuPace``)."""
        self._ms.append(ms)
        self._jobs.append(jobs)
        self._swept.append(swept)
        self._cpu += cpu_s
        self._paced += paced_s
        now = time.monotonic()
        if now - self._since < self.report_s:
            return
        ordered = sorted(self._ms)
        with self._lock:
            passes, placement_cpu = self._passes, self._placement_cpu
            self._passes, self._placement_cpu = 0, 0.0
        urgent = sorted(self._urgent_ms) or [0.0]
        log.info(
            "controller rounds: %d in %.0f s, live jobs %d-%d, swept per round %.1f, "
            "round ms p50 %.1f p99 %.1f max %.1f; cpu s: rounds %.1f, placement %.1f "
            "(%d passes); urgent jobs %d, waited ms p50 %.1f max %.1f; paced s %.1f",
            len(ordered),
            now - self._since,
            min(self._jobs),
            max(self._jobs),
            sum(self._swept) / len(self._swept),
            ordered[len(ordered) // 2],
            ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
            ordered[-1],
            self._cpu,
            placement_cpu,
            passes,
            len(self._urgent_ms),
            urgent[len(urgent) // 2],
            urgent[-1],
            self._paced,
        )
        self._since, self._ms, self._jobs, self._swept = now, [], [], []
        self._urgent_ms = []
        self._cpu = self._paced = 0.0


def connect(
    database_url: str, pool_size: int = 2
) -> tuple[Engine, sessionmaker[Session], list[Bus]]:
    """An engine and sessions for a process other than an API one (the controller): the job
    ids of the plans its sessions commit go out on the plan bus to the API processes, and the
    ids of the hosts whose heartbeat answer they change on the hosts bus, and the credentials
    they change (a job ended or restarted) on the tokens bus. Returns the buses, to close."""
    engine = make_engine(database_url, pool_size=pool_size, name="evenflow-controller")
    sessions = session_factory(engine)
    bus, hosts = open_bus(database_url), open_bus(database_url, "hosts")
    credentials = open_bus(database_url, "tokens")
    caches = Caches(sessions)
    caches.plan_listeners.append(bus.publish)
    caches.credential_listeners.append(credentials.publish)
    track(sessions, hosts.publish)
    return engine, sessions, [bus, hosts, credentials]


def run_process(settings: Settings, stop: threading.Event | None = None) -> None:
    """The controller as a process of its own: its own engine, writer lock and plan bus."""
    stop = stop or threading.Event()
    engine, sessions, buses = connect(settings.database_url)
    write_lock = writer_lock_for(settings.database_url)
    wake = open_bus(settings.database_url, "wake")
    controller = Controller(settings, engine=engine, sessions=sessions, write_lock=write_lock)
    listener = threading.Thread(
        target=_listen_for_pokes, args=(wake, controller, stop), name="wake-bus", daemon=True
    )
    listener.start()
    try:
        controller.run(stop)
    finally:
        listener.join(1.0)
        if write_lock is not None:
            write_lock.close()
        wake.close()
        for bus in buses:
            bus.close()
        engine.dispose()


def _listen_for_pokes(wake: Bus, controller: Controller, stop: threading.Event) -> None:
    """Poke the controller whenever an API process says a job sent urgent telemetry."""
    if isinstance(wake, PgNotifyBus):
        wake.subscribe(controller.poke)
        return
    sock = wake.listen()
    if sock is None:
        return
    while not stop.is_set():
        ready, _, _ = select.select([sock], [], [], WAKE_SLICE_S * 5)
        ids = wake.read(sock).ids if ready else set()  # a loss: the rounds' cadence covers it
        if ids:
            controller.poke(ids)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m server.controller",
        description="Run the control loop for EVENFLOW_DATABASE_URL (one per database).",
    )
    ap.add_argument("--log-level", default="info")
    ap.add_argument("--parent-pid", type=int, default=None, help="stop when this process ends")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s evenflow-controller %(levelname)s %(message)s",
    )
    settings = Settings()
    # Before any thread starts: on Linux a nice value is each thread's, and new ones inherit it.
    os.nice(settings.controller_nice)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.parent_pid is not None:
        threading.Thread(target=_orphan_watch, args=(args.parent_pid, stop), daemon=True).start()
    settle_heap()  # its rounds hold the interpreter too: the same collections as the API's
    run_process(settings, stop)


def _orphan_watch(parent: int, stop: threading.Event) -> None:
    """Stop when the server that started us is gone (even SIGKILLed): an orphan would hold
    the controller lock against the next server's controller."""
    while not stop.wait(1.0):
        if os.getppid() != parent:
            log.warning("parent %d is gone; stopping", parent)
            stop.set()


if __name__ == "__main__":
    main()
