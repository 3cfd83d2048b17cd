"""Placement of pending jobs onto free devices, highest priority first."""

from __future__ import annotations

import random
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from agent.wire import DeviceStatus, HostStatus, JobSpec, JobStatus, PlanSource, WorkerState
from server.models import Device, Host, Job, Worker
from server.services import plans
from server.services.audit import record


def free_devices(session: Session) -> list[Device]:
    return list(
        session.scalars(
            select(Device)
            .join(Host)
            .where(Device.status == DeviceStatus.FREE.value, Host.status == HostStatus.ACTIVE.value)
            .order_by(Host.id, Device.kind, Device.index)
        )
    )


def choose_devices(spec: JobSpec, free: list[Device]) -> list[Device] | None:
    """Devices for one job, or None if it cannot start now. Explicit devices must all be free;
    otherwise first fit in host order (fills hosts before spreading)."""
    if spec.devices is not None:
        by_id = {d.id: d for d in free}
        if all(d in by_id for d in spec.devices):
            return [by_id[d] for d in spec.devices]
        return None
    n = spec.world_size
    return free[:n] if len(free) >= n else None


def place_pending(session: Session, now: datetime) -> list[Job]:
    """Give devices to every pending job that fits, by priority then age. Returns jobs placed."""
    pending = list(
        session.scalars(
            select(Job)
            .where(Job.status == JobStatus.PENDING.value)
            .order_by(Job.priority.desc(), Job.id)
        )
    )
    placed: list[Job] = []
    if not pending:
        return placed
    free = free_devices(session)
    for job in pending:
        spec = JobSpec.model_validate(job.spec)
        chosen = choose_devices(spec, free)
        if chosen is None:
            continue
        taken = {d.id for d in chosen}
        free = [d for d in free if d.id not in taken]
        for rank, dev in enumerate(chosen):
            dev.status, dev.job_id = DeviceStatus.BUSY.value, job.id
            session.add(
                Worker(
                    job_id=job.id,
                    rank=rank,
                    device_id=dev.id,
                    host_id=dev.host_id,
                    state=WorkerState.ASSIGNED.value,
                    updated_at=now,
                )
            )
        job.status = JobStatus.STARTING.value
        job.master_port = random.randint(29500, 39999)
        session.flush()
        plans.create(
            session,
            job,
            plans.equal_split(spec.global_batch, len(chosen)),
            PlanSource.INITIAL,
            "equal split until each worker's speed is measured",
            by="system",
        )
        record(
            session, "system", "job.placed", f"job:{job.id}", {"devices": [d.id for d in chosen]}
        )
        placed.append(job)
    return placed
