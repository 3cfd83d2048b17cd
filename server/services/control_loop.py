"""The control loop: one round over every live job, run by the server every
``rebalance_interval_s``. The rebalancer re-plans on its cadence (``server.services.rebalancer``);
when it makes no plan this round, the straggler watch looks at the new iterations
(``server.services.stragglers``)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from contract.enums import JobStatus, PlanSource
from server.models import IterationTelemetry, Job, StragglerEvent
from server.services import memory, rebalancer
from server.services.audit import record
from server.services.memory import OOM_EVENT
from server.services.rebalancer import (
    REREAD_IDS,
    FitWindow,
    LastDecision,
    NewColumns,
    NewRows,
    Progress,
    Tracker,
)
from server.services.stragglers import Detected, Watch, detect, follow_up, resume


@dataclass
class LoopState:
    """What the loop remembers about live jobs between rounds (an optimisation: after a
    restart, or in a controller that takes over, it is rebuilt from the database, costing one
    early decision; whether a job's rebalancer has settled is kept in the job, as a settled
    ``static`` or ``adaptive`` plan must not be made again: ``recall``)."""

    decisions: dict[int, LastDecision] = field(default_factory=dict)
    readers: dict[int, NewRows] = field(default_factory=dict)
    """Each job's reader of new telemetry rows: read once per sweep for the three below."""
    watches: dict[int, Watch] = field(default_factory=dict)
    trackers: dict[int, Tracker] = field(default_factory=dict)
    windows: dict[int, FitWindow] = field(default_factory=dict)
    """Each job's fit window (``rebalancer.FitWindow``), for the rebalancer's decisions and the
    straggler watch's normal models."""
    decided_at: dict[int, float] = field(default_factory=dict)
    """Monotonic time of each job's last rebalancer decision."""
    telemetry_mark: int = 0
    """Newest telemetry row id the loop has looked past (:func:`jobs_with_new_telemetry`)."""
    swept_at: dict[int, float] = field(default_factory=dict)
    """Monotonic time each job was last swept."""
    attempts: dict[int, int] = field(default_factory=dict)
    """The attempt of each job the state above is about: a restarted job (a new attempt, on
    other devices or another number of them) starts afresh."""
    min_decision_interval_s: float = 0.0
    """At most one rebalancer decision per job per this many seconds. Cadences are counted in
    iterations; this bounds what a job racing through iterations costs the server (each
    decision refits every rank's model). The server sets 1 s; tests drive rounds by hand."""

    def forget(self, live: set[int]) -> None:
        for table in self._tables():
            for job_id in set(table) - live:
                del table[job_id]

    def drop(self, job_id: int) -> None:
        """Forget all about ``job_id``: its next sweep takes it up from the database."""
        for table in self._tables():
            table.pop(job_id, None)

    def follow(self, job: Job) -> None:
        """Forget what was learnt about an earlier attempt of ``job``."""
        if self.attempts.get(job.id, job.attempt) != job.attempt:
            self.drop(job.id)
        self.attempts[job.id] = job.attempt

    def recall(self, job: Job) -> None:
        """Take up what ``job`` keeps of the rebalancer's decisions, and keep it there (after
        ``take_in``: it reads the tracker's plan). A controller without a memory of the job (it
        took over, or forgot the job with a sweep that failed) knows a job settled after
        warm-up from its ``settled_through`` (else it would take the job for one still
        exploring and plan it again), and an unsettled job's automatic plan for one made while
        exploring (a decision on identified models marks the job settled in the same
        transaction): replaced once the models are identified, whatever the gain, as it would
        have been. A settled mark lost with a sweep that rolled back is written again."""
        last = self.decisions.get(job.id)
        if last is not None:
            _mark_settled(job, last)
        elif job.settled_through is not None:
            self.decisions[job.id] = LastDecision(job.settled_through, exploring=False)
        else:
            plan = self.trackers[job.id].plan
            if plan is not None and PlanSource(plan.source) is PlanSource.AUTOMATIC:
                self.decisions[job.id] = LastDecision(-1, exploring=True)

    def _tables(self) -> tuple[dict[int, Any], ...]:
        return (
            self.decisions,
            self.readers,
            self.watches,
            self.trackers,
            self.windows,
            self.decided_at,
            self.swept_at,
            self.attempts,
        )


def live_jobs(session: Session) -> list[int]:
    return list(
        session.scalars(
            select(Job.id).where(
                Job.status.in_((JobStatus.STARTING.value, JobStatus.RUNNING.value))
            )
        )
    )


IDLE_SWEEP_S = 5.0
"""A live job with no new telemetry is still swept this often (time-based decisions)."""


def jobs_to_sweep(session: Session, state: LoopState, live: list[int]) -> list[int]:
    """The live jobs with telemetry since the last look, jobs never swept, and jobs idle for
    :data:`IDLE_SWEEP_S`: a round costs what is new, not every job on the cluster.

    One range scan over the telemetry rows added since the last round (the primary key), not
    a query per job. On PostgreSQL ids are handed out before commit, so the last
    ``REREAD_IDS`` ids are looked at again."""
    T = IterationTelemetry
    reread = REREAD_IDS if session.get_bind().dialect.name == "postgresql" else 0
    since = state.telemetry_mark - reread
    newest = session.execute(select(func.max(T.id))).scalar() or 0
    fresh = set(session.scalars(select(T.job_id).where(T.id > since, T.id <= newest).distinct()))
    state.telemetry_mark = max(state.telemetry_mark, newest)
    now = time.monotonic()
    return [
        job_id
        for job_id in live
        if job_id in fresh or now - state.swept_at.get(job_id, -math.inf) >= IDLE_SWEEP_S
    ]


def newest_telemetry(session: Session, state: LoopState, job_ids: list[int]) -> dict[int, int]:
    """The newest telemetry row id of each of ``job_ids`` among the rows added since the round
    began (``jobs_to_sweep``'s mark, less ``REREAD_IDS`` on PostgreSQL): one range scan of the
    newest rows, for the controller's watch on hot jobs in the middle of a round."""
    T = IterationTelemetry
    reread = REREAD_IDS if session.get_bind().dialect.name == "postgresql" else 0
    rows = session.execute(
        select(T.job_id, func.max(T.id))
        .where(T.id > state.telemetry_mark - reread, T.job_id.in_(job_ids))
        .group_by(T.job_id)
    )
    return {int(job_id): int(newest) for job_id, newest in rows}


def sweep(session: Session, state: LoopState, *, watch: bool = True) -> list[tuple[int, int]]:
    """One round over live jobs; returns (job id, new plan version) for every plan made.
    With ``watch`` the straggler watch runs too: events for every job, the mitigation ladder
    for ``adaptive`` ones. (The server runs ``sweep_job`` per job, each in its own short
    transaction, so a round never holds the database for long.)"""
    made: list[tuple[int, int]] = []
    live = live_jobs(session)
    for job_id in live:
        made += sweep_job(session, state, job_id, watch=watch)
    state.forget(set(live))
    return made


def take_in(session: Session, state: LoopState, job: Job) -> Progress:
    """Read the job's new telemetry rows once (``NewRows``) and hand them to its tracker, fit
    window and straggler watch, as columns (``NewColumns``); the job's progress."""
    rows = state.readers.setdefault(job.id, NewRows()).read(session, job)
    columns = NewColumns(rows) if rows else None
    progress = state.trackers.setdefault(job.id, Tracker()).absorb(session, job, rows, columns)
    window = state.windows.setdefault(job.id, FitWindow())
    window.add(session, job, rows, rebalancer.FIT_WINDOW, columns)
    watch = state.watches.get(job.id)
    if watch is None:  # a new job, or one under way that this controller took over
        watch = state.watches[job.id] = resume(session, job)
    watch.add(rows, columns)
    return progress


def prefetch(session: Session, state: LoopState, job_id: int) -> None:
    """The reading part of ``sweep_job``'s next call: the job's new telemetry rows
    (``take_in``). The server runs it in a transaction of its own before taking SQLite's writer
    lock for ``sweep_job``, which then reads only what came since."""
    job = session.get(Job, job_id)
    if job is None or JobStatus(job.status).terminal:
        return
    state.follow(job)
    take_in(session, state, job)


def sweep_job(
    session: Session, state: LoopState, job_id: int, *, watch: bool = True
) -> list[tuple[int, int]]:
    """One job's sweep: read its new rows (``take_in``); with ``watch``, feed the straggler
    detector and store its events first (``stragglers.detect``: a straggler's event never
    waits for a decision of the rebalancer's); re-plan after an out-of-memory report, or on
    the rebalancer's cadence; when neither made a plan, the rest of the watch
    (``stragglers.follow_up``: normal models, the mitigation ladder). A sweep that made a plan
    leaves the ladder out: the next one asks it all the same, since the plan in force is one of
    what it decides on (``stragglers._ladder_rests``). Returns (job id, plan version) for a plan
    made."""
    job = session.get(Job, job_id)
    if job is None or JobStatus(job.status).terminal:
        return []
    state.follow(job)
    progress = take_in(session, state, job)
    state.recall(job)
    w = state.watches[job.id]
    window = state.windows[job.id]  # ``take_in`` keeps one for every job it took in
    detected: Detected | None = detect(session, job, w, progress, window) if watch else None
    tracker = state.trackers[job.id]
    if tracker.ooms:
        planned = _out_of_memory(session, job, tracker, window)
        if planned is not None:
            return [(job.id, planned)]
    now = time.monotonic()
    if now - state.decided_at.get(job.id, -math.inf) >= state.min_decision_interval_s:
        before = state.decisions.get(job.id)
        planned = _rebalance(session, job, state, progress)
        if state.decisions.get(job.id) is not before:
            state.decided_at[job.id] = now
        if planned is not None:
            return [(job.id, planned)]
    if detected is None:
        return []
    last = state.decisions.get(job.id)
    settled = last is not None and not last.exploring
    version = follow_up(session, job, w, progress, detected, mitigate=settled, window=window)
    return [(job.id, version)] if version is not None else []


def _out_of_memory(
    session: Session, job: Job, tracker: Tracker, kept: FitWindow | None
) -> int | None:
    """Record an ``oom`` event per report and re-plan at once under the lowered caps (every
    policy, ``equal`` included: the plan carries the caps the ranks accumulate under). A fresh
    tracker re-reads the whole history, so a report already recorded is not recorded again."""
    reports, tracker.ooms = tracker.ooms, []
    caps = (
        memory.caps(session, job)
        if kept is None
        else memory.caps(session, job, kept.memory, kept.plan_caps())
    )
    known = {
        (e.rank, e.start_iteration)
        for e in session.scalars(
            select(StragglerEvent).where(
                StragglerEvent.job_id == job.id, StragglerEvent.kind == OOM_EVENT
            )
        )
    }
    fresh = [r for r in reports if (r[0], r[1]) not in known]
    for rank, iteration, size in fresh:
        cap = caps[rank] if rank < len(caps) else None
        session.add(
            StragglerEvent(
                job_id=job.id,
                rank=rank,
                kind=OOM_EVENT,
                severity=1.0,
                start_iteration=iteration,
                end_iteration=iteration,
                action=f"redone in smaller passes; cap {cap} per pass",
                detail={"batch": size, "cap": cap},
            )
        )
    if not fresh or job.frozen:
        return None
    decision = rebalancer.propose(session, job, kept=kept)
    reason = "out of memory on rank(s) " + ", ".join(sorted({str(r[0]) for r in fresh}))
    version = rebalancer.apply(
        session,
        job,
        decision,
        PlanSource.AUTOMATIC,
        by="rebalancer",
        reason=f"{reason}; {decision.reason}",
    )
    if version is not None:
        record(
            session,
            "rebalancer",
            "plan.automatic",
            f"job:{job.id}",
            {"version": version, "reason": reason},
        )
    return version


def _mark_settled(job: Job, last: LastDecision) -> None:
    """Keep the job's ``settled_through`` as the controller's memory has it (written only when
    that changes: once per attempt, and again if the rebalancer goes back to exploring)."""
    if last.exploring:
        if job.settled_through is not None:
            job.settled_through = None
    elif job.settled_through is None:
        job.settled_through = last.through


def _rebalance(session: Session, job: Job, state: LoopState, progress: Progress) -> int | None:
    memo = state.decisions
    p = rebalancer.due(job, memo.get(job.id), progress)
    if p is None or p.complete_through is None:
        return None
    last = memo.get(job.id)
    decision = rebalancer.propose(
        session,
        job,
        current_from_guesses=last is not None and last.exploring,
        kept=state.windows.get(job.id),
        progress=progress,
    )
    memo[job.id] = LastDecision(p.complete_through, decision.exploring)
    _mark_settled(job, memo[job.id])
    version = rebalancer.apply(session, job, decision, PlanSource.AUTOMATIC, by="rebalancer")
    if version is not None:
        record(
            session,
            "rebalancer",
            "plan.automatic",
            f"job:{job.id}",
            {"version": version, "reason": decision.reason},
        )
    return version
