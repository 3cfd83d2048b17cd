"""Devices given back: when a job ends, when a rank of an ended or restarted job is reported
ended, when a rank leaves a job for good. A device stays its job's while a process of the job
may still run on it (``may_still_run``), so no two processes ever share one."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import bindparam, case, exists, select, update
from sqlalchemy.orm import Session

from contract.agent import WorkerReport
from contract.enums import (
    DeviceStatus,
    WorkerState,
)
from server.models import (
    Device,
    Host,
    Job,
    Worker,
)
from server.services import scheduler

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
the job ``may_still_run`` on), in one statement, not every rank and device loaded as entities
and each device written back, which would weigh on the heartbeat that ends a large job.
``fetch``: the session's devices (a heartbeat's host's) see what it wrote."""


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


def release_departed(session: Session, job: Job, rank: int) -> None:
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


def release_ended_rank(session: Session, worker: Worker, now: datetime) -> None:
    """The rank of an ended job is now reported ended too: its device is free at last."""
    device = session.get(Device, worker.device_id) if worker.device_id is not None else None
    if device is not None and device.job_id == worker.job_id and not may_still_run(worker):
        release(device)
        session.flush()
        scheduler.request_placement(session)


def release_ended_job(session: Session, job_id: int) -> None:
    """Every device of the ended job no rank of it ``may_still_run`` on is free."""
    session.execute(_RELEASE_ENDED, {"ended_job": job_id})
