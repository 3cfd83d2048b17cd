"""A heartbeat's rank reports: each rank moved to the state its agent reports, and through
them its job (started, succeeded, restarted or failed after a rank failed, a departed rank let
go); and who may write a rank's telemetry, metrics, checkpoints and artifacts."""

from __future__ import annotations

import signal
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import Connection, bindparam, select, text
from sqlalchemy.orm import Session

from contract.agent import WORKER_EXIT_AGENT_GONE, WORKER_EXIT_FATAL, WorkerReport
from contract.enums import (
    WORKER_TRANSITIONS,
    JobStatus,
    Role,
    WorkerState,
)
from server.errors import Forbidden
from server.models import (
    Host,
    Job,
    Worker,
    departed_ranks,
)
from server.services import departures
from server.services.jobs import fail_or_restart, finish, transition
from server.services.releases import release_departed, release_ended_rank
from server.services.tokens import Principal

REPORTS_LOCK_CLASS = 0x45_46_4C_57  # "EFLW": the key space of the two-key advisory locks
"""PostgreSQL advisory locks ``(REPORTS_LOCK_CLASS, job id)``: one host's rank reports of a job
at a time (``apply_worker_reports``, ``advance_jobs``). Two-key locks never meet the one-key
locks of ``server.locks``."""


_REPORTS_LOCK = text("SELECT pg_advisory_xact_lock(:cls, :job_id)").bindparams(
    cls=REPORTS_LOCK_CLASS
)


REPORT_LOCK_WAIT = "evenflow.report_lock_wait_s"
"""Where a session notes the seconds it waited for jobs' report locks (``_lock_reports``), for
the heartbeat's timing by phase (``evenflow_heartbeat_database_seconds{phase="report_lock"}``)."""


def _lock_reports(session: Session, job_ids: Iterable[int]) -> None:
    """Take the jobs' report locks (PostgreSQL), in id order as every host takes them, held to
    the commit: one host at a time moves a job on (``advance_jobs``, once its reports have
    committed and it found the job ready) or handles a failure (``_apply_with_failures``, which
    must see every other report of the job). An advisory lock, not the job's row: the
    controller updates job rows in its sweeps, and a row lock made heartbeats and sweeps wait
    for each other. (SQLite has one writer at a time: no such race.)"""
    if session.get_bind().dialect.name == "postgresql":
        asked = time.perf_counter()
        for job_id in sorted(job_ids):
            session.execute(_REPORTS_LOCK, {"job_id": job_id})
        waited = time.perf_counter() - asked
        session.info[REPORT_LOCK_WAIT] = session.info.get(REPORT_LOCK_WAIT, 0.0) + waited


@dataclass(frozen=True)
class Applied:
    """What a heartbeat's rank reports did (``apply_worker_reports``)."""

    to_advance: dict[int, int] = field(default_factory=dict)
    """The jobs (id: attempt reported) that may now start running or succeed, for the caller
    to look at once this transaction has committed (``ready_to_advance``, ``advance_jobs``)."""
    moved: dict[tuple[int, int], WorkerState] | None = field(default_factory=dict)
    """The ranks (job, rank) moved, by their new state: nothing else about the host's ranks
    changed. None after a failure, which may have restarted a job or let a rank go."""


def apply_worker_reports(
    session: Session, host: Host, reports: list[WorkerReport], now: datetime
) -> Applied:
    """Workers changed state on ``host`` (one heartbeat's reports, in order); advance each
    worker and, through them, their jobs.

    A report about a rank the control plane does not know (its database was reset, or the job
    removed) is skipped rather than refusing the whole heartbeat: the answer does not list that
    rank, so the agent stops the process. Reports about an earlier attempt's processes are
    ignored too (that attempt has been replaced; ``release_replaced`` frees their devices once
    the host reports none of them running).

    The reports' ranks are read (with their jobs' status and attempt) in one statement and
    their state changes written together: a job starting on a host of 8 GPUs reports 8 ranks
    at once, and a statement or two per report would make a fleet's start a burst of thousands
    of round trips.

    A job that may now start running or succeed is left to the caller, to look at once this
    transaction has committed (``ready_to_advance``, then ``advance_jobs`` for those ready):
    a whole fleet job's hosts report its start (and its end) within one heartbeat period, and
    only the last of them takes the job's report lock. A rank reported launching (or running
    in a job already running) cannot advance its job: it counts no ranks.

    A heartbeat that reports a failure takes its jobs' locks first and advances them here
    (``_apply_with_failures``), as the failure's handling (a restart) must see every other
    report."""
    if not reports:
        return Applied()
    if any(r.state is WorkerState.FAILED for r in reports):
        _apply_with_failures(session, host, reports, now)
        return Applied(moved=None)
    rows = session.execute(
        select(Worker, Job.status, Job.attempt)
        .join(Job, Worker.job_id == Job.id)
        .where(
            Worker.job_id.in_(sorted({r.job_id for r in reports})),
            Worker.rank.in_(sorted({r.rank for r in reports})),
        )
    ).all()
    found = {(w.job_id, w.rank): (w, JobStatus(status), attempt) for w, status, attempt in rows}
    moved: dict[tuple[int, int], WorkerState] = {}
    last: dict[int, tuple[WorkerReport, JobStatus]] = {}
    """Per live job, its last rank moved: whether the job may advance depends on it alone."""
    for report in reports:
        hit = found.get((report.job_id, report.rank))
        if hit is None or report.attempt != hit[2]:
            continue
        worker, status, _ = hit
        if not _move_worker(worker, host, report, now):
            continue
        moved[(report.job_id, report.rank)] = report.state
        if status.terminal:
            release_ended_rank(session, worker, now)
        else:
            last[report.job_id] = (report, status)
    to_advance = {
        job_id: report.attempt
        for job_id, (report, status) in last.items()
        if may_move(status, report.state)
    }
    return Applied(to_advance, moved)


def may_move(status: JobStatus, state: WorkerState) -> bool:
    """Whether a rank in ``state`` may move its job, in ``status``, on: a rank succeeded in a
    live job, or running in a starting one. Any other rank's report counts no ranks."""
    if status.terminal:
        return False
    return state is WorkerState.SUCCEEDED or (
        state is WorkerState.RUNNING and status is JobStatus.STARTING
    )


def _apply_with_failures(
    session: Session, host: Host, reports: list[WorkerReport], now: datetime
) -> None:
    """``apply_worker_reports`` for a heartbeat that reports a failure: under its jobs' report
    locks from the start, each job advanced here once for its reports (its rank states counted
    once), except that a failure is handled where it comes, as it may restart the job (later
    reports of the replaced attempt are then ignored)."""
    job_ids = sorted({r.job_id for r in reports})
    _lock_reports(session, job_ids)
    found = {j.id: j for j in session.scalars(select(Job).where(Job.id.in_(job_ids)))}
    workers = {
        (w.job_id, w.rank): w
        for w in session.scalars(
            select(Worker).where(
                Worker.job_id.in_(job_ids), Worker.rank.in_(sorted({r.rank for r in reports}))
            )
        )
    }
    to_advance: dict[int, WorkerReport] = {}
    """Jobs whose ranks moved, with the last such report: advanced once, after them all."""
    for report in reports:
        job = found.get(report.job_id)
        worker = workers.get((report.job_id, report.rank))
        if job is None or worker is None or report.attempt != job.attempt:
            continue
        if not _move_worker(worker, host, report, now):
            continue
        to = report.state
        if to is WorkerState.FAILED and (earlier := to_advance.pop(job.id, None)) is not None:
            _advance_job(session, job, earlier, now)  # what came before the failure, first
        if JobStatus(job.status).terminal:
            release_ended_rank(session, worker, now)
        elif to is WorkerState.FAILED:
            _advance_job(session, job, report, now)
        else:
            to_advance[job.id] = report
    for job_id, report in to_advance.items():
        job = found[job_id]
        if not JobStatus(job.status).terminal and report.attempt == job.attempt:
            _advance_job(session, job, report, now)


def ready_to_advance(session: Session, pending: Mapping[int, int]) -> dict[int, int]:
    """Of the jobs ``apply_worker_reports`` left (id: the attempt reported), those that their
    ranks, as committed now, move on (to running, or to their success): read without any lock,
    in a transaction after the reports' own commit, so that only those go on to
    ``advance_jobs`` and its locks.

    Hosts reporting a job's ranks at once each commit theirs, then read. Whichever of them
    commits last reads after every one of their commits, so it sees every rank as it was
    reported and finds the job ready; the ones before it read too early, find it not, and
    take no lock. (Read inside the reports' own transaction, each could miss the others'
    uncommitted ranks and none would find it ready; counting under the job's lock instead
    would queue a large job's hosts on it, each holding one of the API's database slots.)"""
    if not pending:
        return {}
    ready = {}
    for job_id, status, attempt, gone in session.execute(_LIVE_JOBS, {"job_ids": sorted(pending)}):
        if attempt != pending[job_id]:
            continue
        departed = departed_ranks(gone, attempt)
        if _moves(JobStatus(status), _rank_states(session, job_id, departed)) is not None:
            ready[job_id] = attempt
    return ready


_LIVE_JOBS = select(Job.id, Job.status, Job.attempt, Job.departures).where(
    Job.id.in_(bindparam("job_ids", expanding=True)),
    Job.status.in_([s.value for s in JobStatus if not s.terminal]),
)


def advance_jobs(session: Session, pending: Mapping[int, int], now: datetime) -> None:
    """Advance the jobs ``ready_to_advance`` found (id: the attempt reported), under their
    report locks: two hosts that both found a job ready count its ranks again in turn, and the
    second finds it moved already (as the first committed it before letting the lock go)."""
    if not pending:
        return
    _lock_reports(session, pending)
    fresh = session.scalars(  # as committed before the locks were granted
        select(Job).where(Job.id.in_(sorted(pending))).execution_options(populate_existing=True)
    )
    for job in fresh:
        if not JobStatus(job.status).terminal and job.attempt == pending[job.id]:
            _advance_live(session, job, now)


def _move_worker(worker: Worker, host: Host, report: WorkerReport, now: datetime) -> bool:
    """Move ``worker`` to the state ``report`` says, if that is a move it can make; False for
    a late or repeated report (an agent restarting), which is not an error: the first end
    state stays."""
    if worker.host_id != host.id:
        raise Forbidden(
            f"rank {report.rank} of job {report.job_id} does not run on host '{host.name}'"
        )
    frm, to = WorkerState(worker.state), report.state
    if to == frm or to not in WORKER_TRANSITIONS[frm]:
        return False
    worker.state, worker.exit_code, worker.updated_at = to, report.exit_code, now
    if report.error:
        worker.error = report.error
    if report.log_tail:
        worker.log_tail, worker.log_end = report.log_tail, report.log_end
    return True


def _advance_job(session: Session, job: Job, report: WorkerReport, now: datetime) -> None:
    """A live job after one of its ranks changed state: on a failure, go on without the rank
    when it was out of the all-reduce group and the others can (``departures``), else restart
    or fail the job; then as ``_advance_live``."""
    to = report.state
    if to is WorkerState.FAILED:
        reason = failure_reason(report)
        retry = report.exit_code != WORKER_EXIT_FATAL
        decision = departures.decide_for(session, job, report.rank) if retry else None
        if decision is None or not decision.go_on:
            if decision is not None and decision.why is not None:
                reason = f"{reason} ({decision.why})"
            fail_or_restart(session, job, reason, now, retry=retry)
            return
        # out of the all-reduce group: the others go on without it (``departures``)
        departures.depart(session, job, report.rank, reason, now)
        release_departed(session, job, report.rank)
    _advance_live(session, job, now)


def _advance_live(session: Session, job: Job, now: datetime) -> None:
    """A live job whose ranks moved: succeed when every rank still in the job did, run once
    every rank runs."""
    to = _moves(JobStatus(job.status), _rank_states(session, job.id, job.departed))
    if to is JobStatus.SUCCEEDED:
        if job.status == JobStatus.STARTING.value:
            transition(job, JobStatus.RUNNING)
        finish(session, job, JobStatus.SUCCEEDED, now)
    elif to is JobStatus.RUNNING:
        transition(job, JobStatus.RUNNING)
        job.started_at = now


def _moves(status: JobStatus, states: set[WorkerState]) -> JobStatus | None:
    """Where a live job in ``status`` goes with its ranks in ``states`` (those still in it):
    succeeded once all succeeded, running once a starting job's all run; None: nowhere yet."""
    if all(s is WorkerState.SUCCEEDED for s in states):
        return JobStatus.SUCCEEDED
    if status is JobStatus.STARTING and states <= {WorkerState.RUNNING, WorkerState.SUCCEEDED}:
        return JobStatus.RUNNING
    return None


def _rank_states(session: Session, job_id: int, departed: Collection[int]) -> set[WorkerState]:
    """The states of the job's ranks still in it (not ``departed``), in one aggregate read, not
    the job's workers loaded as entities: it runs at every rank's start and end."""
    rows = session.execute(_RANK_STATES, {"job_id": job_id, "departed": sorted(departed)})
    return {WorkerState(state) for (state,) in rows}


_RANK_STATES = (
    select(Worker.state)
    .where(
        Worker.job_id == bindparam("job_id"),
        Worker.rank.not_in(bindparam("departed", expanding=True)),
    )
    .group_by(Worker.state)
)
"""Built once: building it and its cache key each time cost about as much as running it."""


def failure_reason(report: WorkerReport) -> str:
    """One line on why a rank failed, in words a person reads: its agent's end (the agent
    that came back says so, ``WORKER_EXIT_AGENT_GONE``), the signal that killed it (its log's
    last line would be whatever it was doing), else its error's last line (a traceback's
    exception)."""
    if report.exit_code == WORKER_EXIT_AGENT_GONE and report.signal is None:
        said = (report.error or "").strip().splitlines()[-1:]
        return " ".join(said) or f"rank {report.rank}'s agent died while it ran"
    if report.signal is not None:
        return f"rank {report.rank} killed by {report.signal}"
    code = report.exit_code
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"rank {report.rank} killed by {name}"
    tail = (report.error or f"exit code {code}").strip().splitlines()[-1:]
    return f"rank {report.rank} failed: {' '.join(tail)}"


_RANKS_ON_HOST = (
    select(Worker.rank)
    .join(Host, Worker.host_id == Host.id)
    .where(Worker.job_id == bindparam("job_id"), Host.name == bindparam("host"))
)


def check_may_write_ranks(
    db: Session | Connection,
    principal: Principal,
    job_id: int,
    ranks: list[int],
    action: str = "post telemetry",
    placed: Collection[int] | None = None,
) -> None:
    """Who may post timings, metrics or checkpoints (``action``, for the messages) of these ranks of a job
    (``db``: a session, or the Core connection of the telemetry ingest's hot path): an admin
    any; an agent only ranks placed on its own host; a worker credential only its own job and
    rank; nobody else. ``placed``: the job's ranks on the agent's host, when the caller has
    read them already (the telemetry ingest reads those of a whole group of posts at once)."""
    if principal.role is Role.ADMIN:
        return
    if principal.role is Role.WORKER:
        if principal.job_id != job_id:
            raise Forbidden(
                f"'{principal.name}' is a worker credential of job {principal.job_id}; "
                f"it may not {action} for job {job_id}"
            )
        other = next((r for r in ranks if r != principal.rank), None)
        if other is not None:
            raise Forbidden(
                f"'{principal.name}' may {action} for rank {principal.rank} only, not rank {other}"
            )
        return
    if principal.role is not Role.AGENT:
        raise Forbidden(
            f"only an agent, worker or admin token may {action}; '{principal.name}' is "
            f"{principal.role.value}"
        )
    if placed is None:
        placed = set(db.scalars(_RANKS_ON_HOST, {"job_id": job_id, "host": principal.host}))
    other = next((r for r in ranks if r not in placed), None)
    if other is not None:
        raise Forbidden(
            f"rank {other} of job {job_id} is not placed on host '{principal.host}'; agent "
            f"token '{principal.name}' may {action} only for that host's ranks"
        )
