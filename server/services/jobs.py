"""Jobs: submission, cancellation, worker reports, restarts after a failure and the job state
machine (``contract.enums.JobStatus`` draws it).

A failure (a rank reports FAILED, or the host of one of its ranks is lost) restarts the job
while its spec's ``max_restarts`` allows: the job becomes a new *attempt* (``Job.attempt``), its
devices are given back and its workers (with their credentials) deleted, and it is placed
again as a pending job: the same devices when they are free, others otherwise, between
``workers`` and ``max_workers`` of them, with a new initial plan and rendezvous port. Agents
launch the new attempt's ranks and stop the old ones; the runtime resumes from the job's
newest checkpoint (or from iteration 0 without checkpoints). After ``max_restarts`` restarts,
the next failure fails the job with every reason listed. A rank that exits with
``WORKER_EXIT_FATAL`` (the job cannot run as specified) fails it at once."""

from __future__ import annotations

import signal
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import Connection, bindparam, case, exists, func, select, text, update
from sqlalchemy.orm import Session, selectinload

from contract.agent import WORKER_EXIT_AGENT_GONE, WORKER_EXIT_FATAL, WorkerReport
from contract.api import RestartOut
from contract.enums import (
    JOB_TRANSITIONS,
    WORKER_TRANSITIONS,
    DeviceStatus,
    JobStatus,
    Role,
    WorkerState,
)
from contract.spec import JobSpec
from server.cache import mark_tokens_changed
from server.errors import Conflict, Forbidden, Invalid, NotFound
from server.models import (
    Checkpoint,
    Device,
    Host,
    IterationTelemetry,
    Job,
    Worker,
    departed_ranks,
)
from server.services import contexts, departures, events, scheduler
from server.services.audit import record
from server.services.tokens import Principal


def get(session: Session, job_id: int) -> Job:
    job = session.get(Job, job_id, options=[selectinload(Job.workers)])
    if job is None:
        raise NotFound(f"job {job_id} not found")
    return job


def list_jobs(
    session: Session, *, status: JobStatus | None, limit: int, offset: int
) -> tuple[list[Job], int]:
    q = select(Job)
    count = select(func.count(Job.id))
    if status is not None:
        q = q.where(Job.status == status.value)
        count = count.where(Job.status == status.value)
    rows = session.scalars(
        q.order_by(Job.id.desc()).limit(limit).offset(offset).options(selectinload(Job.workers))
    )
    return list(rows), int(session.scalar(count) or 0)


def _check_devices(session: Session, ids: list[int]) -> None:
    """Explicit devices must exist and be of one kind (one process group, one backend)."""
    kinds = dict(session.execute(select(Device.id, Device.kind).where(Device.id.in_(ids))).all())
    missing = [d for d in ids if d not in kinds]
    if missing:
        raise Invalid(f"unknown device ids {missing}", field="devices")
    by_kind: dict[str, list[int]] = {}
    for d in ids:
        by_kind.setdefault(kinds[d], []).append(d)
    if len(by_kind) > 1:
        listed = "; ".join(f"{k} {v}" for k, v in sorted(by_kind.items()))
        raise Invalid(
            f"devices mixes device kinds ({listed}): a job's ranks share one backend, so they "
            "must be all CUDA devices (NCCL) or all CPU slots (gloo)",
            field="devices",
        )


def create(session: Session, spec: JobSpec, principal: Principal, now: datetime) -> Job:
    if spec.devices is not None:
        _check_devices(session, spec.devices)
    if spec.workload.context is not None:
        contexts.require(session, spec.workload.context)
    scheduler.check_placeable(session, spec)
    job = Job(
        name=spec.name,
        context=spec.workload.context,
        owner=principal.name,
        spec=spec.model_dump(mode="json"),
        status=JobStatus.PENDING.value,
        priority=spec.priority,
        emulated=spec.emulation is not None,
        created_at=now,
    )
    session.add(job)
    session.flush()
    record(session, principal.name, "job.create", f"job:{job.id}", {"name": spec.name})
    # Placement is the controller's (it may take seconds): the submission answers at once.
    job.pending_reason = scheduler.explain_submitted(session, spec)
    scheduler.request_placement(session)
    return job


def logs(session: Session, job_id: int, rank: int | None) -> list[Worker]:
    """The job's ranks (one, with ``rank``) with their root cause and log tail."""
    job = get(session, job_id)
    if rank is None:
        return list(job.workers)
    found = [w for w in job.workers if w.rank == rank]
    if not found:
        raise NotFound(f"job {job_id} has no rank {rank}", field="rank")
    return found


FOLLOW_S = 30.0
"""How long one ``follow_logs`` keeps a job's live logs coming: a follower asks again sooner."""


def follow_logs(session: Session, job_id: int, rank: int | None, now: datetime) -> list[Worker]:
    """``logs``, and the job's agents told to upload its running ranks' live log tails for the
    next ``FOLLOW_S`` (written at most once per half of it: several followers, or one polling
    every second, cost one write a quarter-minute)."""
    job = get(session, job_id)
    until = job.logs_followed_until
    if not JobStatus(job.status).terminal and (
        until is None or until < now + timedelta(seconds=FOLLOW_S / 2)
    ):
        job.logs_followed_until = now + timedelta(seconds=FOLLOW_S)
        session.flush()
    return logs(session, job_id, rank)


def transition(job: Job, to: JobStatus) -> None:
    frm = JobStatus(job.status)
    if to not in JOB_TRANSITIONS[frm]:
        raise Conflict(f"job {job.id} is {frm.value}; it cannot become {to.value}", field="status")
    job.status = to


def finish(
    session: Session, job: Job, status: JobStatus, now: datetime, *, error: str | None = None
) -> None:
    """Move a job to a terminal state and give back the devices no rank of it may still run on
    (``may_still_run``); the others follow as their agents report the ranks ended."""
    transition(job, status)
    job.finished_at = now
    job.error = error
    events.close_open(session, job.id)  # the straggler watch stops with the job
    mark_tokens_changed(session, job_ids=[job.id])  # its workers' credentials die with it
    session.execute(_RELEASE_ENDED, {"ended_job": job.id})
    session.flush()
    scheduler.request_placement(session)  # its devices are free for pending jobs


_TERMINAL_RANKS = tuple(s.value for s in WorkerState if s.terminal)
_RELEASE_ENDED = (
    update(Device)
    .where(
        Device.job_id == bindparam("ended_job"),
        ~exists().where(  # a rank of the job that ``may_still_run`` on the device
            Worker.job_id == Device.job_id,
            Worker.device_id == Device.id,
            Worker.token_hash.is_not(None),
            Worker.state.not_in(_TERMINAL_RANKS),
        ),
    )
    .values(
        job_id=None,
        status=case(
            (Device.status == DeviceStatus.BUSY.value, DeviceStatus.FREE.value),
            else_=Device.status,
        ),
    )
    .execution_options(synchronize_session="fetch")
)
"""``finish``'s release of an ended job's devices (``release``, for each device no rank of
the job ``may_still_run`` on), in one statement: the job's last heartbeat loaded every rank
and device of it as entities and wrote each device back, a seventh of the CPU of a fleet's
heartbeats worked out in the database (bench/fleet.py, 256-rank jobs). ``fetch``: the session's
devices (a heartbeat's host's) see what it wrote."""


def may_still_run(worker: Worker | None) -> bool:
    """Whether a process of this rank may still be running, so its device is not free even
    though its job has ended: the rank was handed to its agent (its credential was minted) and
    the agent has not reported it ended (succeeded, failed or stopped; an agent reports a rank
    stopped only once its process is gone). ``hosts.release_silent`` frees the device of a rank
    whose host has fallen silent for good."""
    return (
        worker is not None
        and worker.token_hash is not None
        and not WorkerState(worker.state).terminal
    )


def job_still_running_on(session: Session, device_id: int) -> int | None:
    """The job of a rank on this device that ``may_still_run``, if any."""
    return session.scalar(
        select(Worker.job_id).where(
            Worker.device_id == device_id,
            Worker.token_hash.is_not(None),
            Worker.state.not_in([s.value for s in WorkerState if s.terminal]),
        )
    )


def release(device: Device) -> None:
    """Give a device of an ended job back: free, or offline while its host is lost."""
    device.job_id = None
    if device.status == DeviceStatus.BUSY.value:
        device.status = DeviceStatus.FREE


def fail_or_restart(
    session: Session, job: Job, reason: str, now: datetime, *, retry: bool = True
) -> None:
    """A rank of a live job failed or was lost: restart the job while its ``max_restarts``
    allows (and ``retry``: a restart can mend the failure), else fail it with every reason."""
    if retry and job.restarts < job.job_spec.max_restarts:
        restart(session, job, reason, now)
        return
    reasons = [*(r["reason"] for r in job.restart_history), reason]
    error = reason
    if len(reasons) > 1:
        listed = "; ".join(f"attempt {i}: {r}" for i, r in enumerate(reasons))
        error = f"failed after {len(reasons) - 1} restart(s): {listed}"
    finish(session, job, JobStatus.FAILED, now, error=error)
    record(session, "system", "job.failed", f"job:{job.id}", {"reason": reason})


def restart(session: Session, job: Job, reason: str, now: datetime) -> None:
    """Begin the job's next attempt: devices back, workers gone, pending again, placed anew."""
    resumed_from, lost = _progress_lost(session, job)
    entry = RestartOut(
        attempt=job.attempt + 1,
        at=now,
        reason=reason if job.job_spec.checkpoint else f"{reason} (no checkpoint: from iteration 0)",
        resumed_from=resumed_from,
        iterations_lost=lost,
    )
    job.restart_history = [*(job.restart_history or []), entry.model_dump(mode="json")]
    job.attempt += 1
    job.settled_through = None  # the next attempt's ranks are identified afresh
    transition(job, JobStatus.PENDING)
    events.close_open(session, job.id, why="job restarted")  # the watch starts anew with it
    mark_tokens_changed(session, job_ids=[job.id])  # the old attempt's die with its workers
    on_device = {w.device_id: w for w in job.workers}
    for dev in session.scalars(select(Device).where(Device.job_id == job.id)):
        if not may_still_run(on_device.get(dev.id)):
            release(dev)  # the others stay the job's until ``release_replaced``
    job.workers.clear()
    session.flush()  # the old ranks' rows go before the new attempt's are added
    session.expire(job, ["workers"])
    record(session, "system", "job.restart", f"job:{job.id}", entry.model_dump(mode="json"))
    scheduler.request_placement(session)


def _progress_lost(session: Session, job: Job) -> tuple[int | None, int | None]:
    """(the newest checkpoint's iteration, iterations done since it), as far as the control
    plane has heard: checkpoints and telemetry reported so far."""
    newest = session.scalar(
        select(func.max(Checkpoint.iteration)).where(Checkpoint.job_id == job.id)
    )
    T = IterationTelemetry
    last = session.scalar(
        select(func.max(T.iteration)).where(T.job_id == job.id, T.probe.is_(False))
    )
    start = int(newest) if newest is not None else 0
    lost = max(0, int(last) + 1 - start) if last is not None else None
    return (int(newest) if newest is not None else None), lost


def cancel(session: Session, job_id: int, principal: Principal, now: datetime) -> Job:
    job = get(session, job_id)
    if JobStatus(job.status).terminal:
        raise Conflict(f"job {job_id} already {job.status}", field="status")
    finish(session, job, JobStatus.CANCELLED, now, error=f"cancelled by {principal.name}")
    record(session, principal.name, "job.cancel", f"job:{job.id}")
    return job


def rank0_address(session: Session, job: Job) -> str:
    w0 = next((w for w in job.workers if w.rank == 0), None)
    host = session.get(Host, w0.host_id) if w0 is not None and w0.host_id is not None else None
    return host.address if host is not None else "127.0.0.1"


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
    at once, and a statement or two per report made the fleet's start a burst of thousands of
    round trips.

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
            _release_ended_rank(session, worker, now)
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
            _release_ended_rank(session, worker, now)
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
    uncommitted ranks and none would find it ready; so the count was made under the job's
    lock, and a 256-rank job's 32 hosts queued on it, holding the API's database slots,
    ``bench/fleet.py``.)"""
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
        _release_departed(session, job, report.rank)
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
    """The states of the job's ranks still in it (not ``departed``), in one aggregate read: at
    every rank's start and end, loading a 256-rank job's workers was most of a fleet's
    heartbeat work."""
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


def _release_departed(session: Session, job: Job, rank: int) -> None:
    """The device of a rank that left the job for good (its process is gone) is free."""
    worker = next(w for w in job.workers if w.rank == rank)
    device = session.get(Device, worker.device_id) if worker.device_id is not None else None
    if device is not None and device.job_id == job.id:
        release(device)
        session.flush()
        scheduler.request_placement(session)


_PROCESS_LIVES = (WorkerState.LAUNCHING, WorkerState.RUNNING)
"""Reported states in which a rank's process holds its device (one being launched does too)."""


def release_replaced(
    session: Session,
    host: Host,
    reports: list[WorkerReport],
    now: datetime,
    *,
    placed: set[tuple[int | None, int]],
) -> bool:
    """Free the devices of ``host`` that a restarted job's earlier attempt still holds (no rank
    of the job is ``placed`` there: (device, job) of the host's ranks) once its agent reports
    none of that attempt's processes running: the heartbeat answer no longer lists them, so the
    agent stops them, and a process is reported launching or running for as long as it
    lives. Returns whether one of ``reports`` kept a device held (the same heartbeat without
    it would have freed the device)."""
    released = held = False
    for dev in host.devices:
        if dev.job_id is None or (dev.id, dev.job_id) in placed:
            continue
        attempt = session.scalar(select(Job.attempt).where(Job.id == dev.job_id))
        if attempt is None:
            continue
        if any(
            r.job_id == dev.job_id and r.attempt < attempt and r.state in _PROCESS_LIVES
            for r in reports
        ):
            held = True
            continue
        release(dev)
        released = True
    if released:
        session.flush()
        scheduler.request_placement(session)
    return held


def _release_ended_rank(session: Session, worker: Worker, now: datetime) -> None:
    """The rank of an ended job is now reported ended too: its device is free at last."""
    device = session.get(Device, worker.device_id) if worker.device_id is not None else None
    if device is not None and device.job_id == worker.job_id and not may_still_run(worker):
        release(device)
        session.flush()
        scheduler.request_placement(session)


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
