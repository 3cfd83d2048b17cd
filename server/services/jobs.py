"""Jobs: submission, cancellation, restarts after a failure and the job state machine
(``contract.enums.JobStatus`` draws it); rank reports move jobs on (``rank_reports``) and
devices are given back by ``releases``.

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

from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session, selectinload

from contract.api import RestartOut
from contract.enums import (
    JOB_TRANSITIONS,
    JobStatus,
)
from contract.spec import JobSpec
from server.errors import Conflict, Invalid, NotFound
from server.models import (
    Checkpoint,
    Device,
    Host,
    IterationTelemetry,
    Job,
    Worker,
)
from server.scale.cache import mark_tokens_changed
from server.services import contexts, events, scheduler
from server.services.audit import record
from server.services.releases import may_still_run, release, release_ended_job
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
    release_ended_job(session, job.id)
    session.flush()
    scheduler.request_placement(session)  # its devices are free for pending jobs


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
