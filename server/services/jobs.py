"""Jobs: submission, cancellation, worker reports and the job state machine
(``contract.enums.JobStatus`` draws it)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Connection, bindparam, func, select
from sqlalchemy.orm import Session, selectinload

from contract.agent import WorkerReport
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
from server.models import Device, Host, Job, Worker
from server.services import events, scheduler
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


def create(session: Session, spec: JobSpec, principal: Principal, now: datetime) -> Job:
    if spec.devices is not None:
        known = set(session.scalars(select(Device.id).where(Device.id.in_(spec.devices))))
        missing = [d for d in spec.devices if d not in known]
        if missing:
            raise Invalid(f"unknown device ids {missing}", field="devices")
    scheduler.check_placeable(session, spec)
    job = Job(
        name=spec.name,
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
    job.pending_reason = scheduler.explain(
        session, spec, scheduler.free_devices(session), tried=False
    )
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


def transition(job: Job, to: JobStatus) -> None:
    frm = JobStatus(job.status)
    if to not in JOB_TRANSITIONS[frm]:
        raise Conflict(f"job {job.id} is {frm.value}; it cannot become {to.value}", field="status")
    job.status = to


def finish(
    session: Session, job: Job, status: JobStatus, now: datetime, *, error: str | None = None
) -> None:
    """Move a job to a terminal state and give its devices back."""
    transition(job, status)
    job.finished_at = now
    job.error = error
    events.close_open(session, job.id)  # the straggler watch stops with the job
    mark_tokens_changed(session)  # its workers' credentials die with it (cached ones too)
    for dev in session.scalars(select(Device).where(Device.job_id == job.id)):
        dev.job_id = None
        if dev.status == DeviceStatus.BUSY.value:
            dev.status = DeviceStatus.FREE
    session.flush()
    scheduler.request_placement(session)  # its devices are free for pending jobs


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


def apply_worker_report(
    session: Session, host: Host, report: WorkerReport, principal: Principal, now: datetime
) -> None:
    """A worker changed state on ``host``; advance the worker and, through it, the job."""
    worker = session.scalars(
        select(Worker).where(Worker.job_id == report.job_id, Worker.rank == report.rank)
    ).first()
    if worker is None:
        raise NotFound(f"job {report.job_id} has no rank {report.rank}", field="workers")
    if worker.host_id != host.id:
        raise Forbidden(
            f"rank {report.rank} of job {report.job_id} does not run on host '{host.name}'"
        )
    frm, to = WorkerState(worker.state), report.state
    if to == frm:
        return
    if to not in WORKER_TRANSITIONS[frm]:
        # Late or repeated reports (an agent restarting) are not errors: keep the first end state.
        return
    worker.state, worker.exit_code, worker.updated_at = to, report.exit_code, now
    if report.error:
        worker.error = report.error
    if report.log_tail:
        worker.log_tail = report.log_tail
    job = get(session, report.job_id)
    status = JobStatus(job.status)
    if status.terminal:
        return
    states = [WorkerState(w.state) for w in job.workers]
    if to is WorkerState.FAILED:
        tail = (report.error or f"exit code {report.exit_code}").strip().splitlines()[-1:]
        finish(
            session,
            job,
            JobStatus.FAILED,
            now,
            error=f"rank {report.rank} failed: {' '.join(tail)}",
        )
        record(session, principal.name, "job.failed", f"job:{job.id}", {"rank": report.rank})
    elif all(s is WorkerState.SUCCEEDED for s in states):
        if status is JobStatus.STARTING:
            transition(job, JobStatus.RUNNING)
        finish(session, job, JobStatus.SUCCEEDED, now)
    elif status is JobStatus.STARTING and all(
        s in (WorkerState.RUNNING, WorkerState.SUCCEEDED) for s in states
    ):
        transition(job, JobStatus.RUNNING)
        job.started_at = now


_RANKS_ON_HOST = (
    select(Worker.rank)
    .join(Host, Worker.host_id == Host.id)
    .where(Worker.job_id == bindparam("job_id"), Host.name == bindparam("host"))
)


def check_may_write_ranks(
    db: Session | Connection, principal: Principal, job_id: int, ranks: list[int]
) -> None:
    """Who may post timings of these ranks of a job (``db``: a session, or the Core connection
    of the telemetry ingest's hot path): an admin any; an agent only ranks placed on its own
    host; a worker credential only its own job and rank; nobody else."""
    if principal.role is Role.ADMIN:
        return
    if principal.role is Role.WORKER:
        if principal.job_id != job_id:
            raise Forbidden(
                f"'{principal.name}' is a worker credential of job {principal.job_id}; "
                f"it may not post telemetry for job {job_id}"
            )
        other = next((r for r in ranks if r != principal.rank), None)
        if other is not None:
            raise Forbidden(
                f"'{principal.name}' may post telemetry for rank {principal.rank} only, "
                f"not rank {other}"
            )
        return
    if principal.role is not Role.AGENT:
        raise Forbidden(
            f"posting telemetry needs an agent, worker or admin token; '{principal.name}' is "
            f"{principal.role.value}"
        )
    placed = set(db.scalars(_RANKS_ON_HOST, {"job_id": job_id, "host": principal.host}))
    other = next((r for r in ranks if r not in placed), None)
    if other is not None:
        raise Forbidden(
            f"rank {other} of job {job_id} is not placed on host '{principal.host}'; agent "
            f"token '{principal.name}' may post telemetry only for that host's ranks"
        )
