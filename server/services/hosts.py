"""Hosts and their devices: registration, heartbeats, and marking silent hosts lost.

A device is never shown free while a worker may still run on it. When a job ends, the device of
each rank its agent has not yet reported ended stays busy (``jobs.may_still_run``), until that
agent reports the rank ended (it stops the process first), or the host has been silent for
``after_s + WORKER_ORPHAN_EXIT_S`` (``release_silent``): lost, and long enough that a dead
agent's workers have certainly exited by their own check (``agent.runtime.parent``). A lost
host's devices are offline meanwhile; if it comes back (an agent that was only cut off keeps
its workers), they are busy again until its agent reports those ranks ended.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import exists, or_, select
from sqlalchemy.orm import Session, selectinload

from contract.agent import WORKER_ORPHAN_EXIT_S, Assignment, Heartbeat, HeartbeatAck, HostRegister
from contract.base import PROTOCOL_VERSION
from contract.enums import DeviceKind, DeviceStatus, HostStatus, JobStatus, Role, WorkerState
from server.errors import Conflict, Forbidden, NotFound, ProtocolMismatch
from server.models import Device, Host, Job, Worker
from server.services import jobs, scheduler, tokens
from server.services.audit import record
from server.services.tokens import Principal


def _check_host_rights(principal: Principal, host_name: str) -> None:
    if principal.role is Role.AGENT and principal.host != host_name:
        raise Forbidden(
            f"agent token '{principal.name}' is bound to host '{principal.host}', not '{host_name}'"
        )
    if principal.role not in (Role.AGENT, Role.ADMIN):
        raise Forbidden(
            f"registering hosts needs an agent or admin token; '{principal.name}' is "
            f"{principal.role.value}"
        )


def register(
    session: Session,
    req: HostRegister,
    principal: Principal,
    now: datetime,
    *,
    live_after_s: float = 30.0,
) -> Host:
    """Create or refresh a host and its devices. Re-registration keeps device ids stable.

    A host is held by one agent process (``req.instance``): another instance registering while
    the holder's last heartbeat is under ``live_after_s`` old is refused with 409, unless it
    asks to ``replace`` it."""
    if req.protocol_version != PROTOCOL_VERSION:
        raise ProtocolMismatch(
            f"agent speaks protocol {req.protocol_version}, this server speaks {PROTOCOL_VERSION}",
            field="protocol_version",
        )
    _check_host_rights(principal, req.name)
    host = session.scalars(
        select(Host).where(Host.name == req.name).options(selectinload(Host.devices))
    ).first()
    if host is None:
        host = Host(
            name=req.name,
            address=req.address,
            protocol_version=req.protocol_version,
            registered_at=now,
            last_heartbeat=now,
            status=HostStatus.ACTIVE.value,
            agent_instance=req.instance,
        )
        session.add(host)
        session.flush()
        record(session, principal.name, "host.register", f"host:{host.id}", {"name": req.name})
    else:
        _check_instance(session, host, req, principal, now, live_after_s)
        host.agent_instance = req.instance
        host.address = req.address
        host.protocol_version = req.protocol_version
        host.last_heartbeat = now
        host.status = HostStatus.ACTIVE
    existing = {(d.kind, d.index): d for d in host.devices}
    reported = {(d.kind.value, d.index) for d in req.devices}
    for info in req.devices:
        dev = existing.get((info.kind, info.index))
        if dev is None:
            host.devices.append(
                Device(
                    index=info.index,
                    kind=info.kind.value,
                    model=info.model,
                    memory_mb=info.memory_mb,
                    status=DeviceStatus.FREE.value,
                )
            )
        else:
            dev.model, dev.memory_mb = info.model, info.memory_mb
            if dev.status == DeviceStatus.OFFLINE.value:
                _back_online(session, dev)
    for key, dev in existing.items():
        if key not in reported and dev.job_id is None:
            dev.status = DeviceStatus.OFFLINE
    session.flush()
    scheduler.request_placement(session)
    return host


def _check_instance(
    session: Session,
    host: Host,
    req: HostRegister,
    principal: Principal,
    now: datetime,
    live_after_s: float,
) -> None:
    """Refuse a second live agent for one host name, unless it replaces the first."""
    if host.agent_instance == req.instance:
        return
    age = (now - host.last_heartbeat).total_seconds()
    live = host.status == HostStatus.ACTIVE.value and age < live_after_s
    if live and not req.replace:
        raise Conflict(
            f"host {host.name} is held by another live agent (last heartbeat {age:.0f}s ago); "
            "start with --replace to take over",
            field="name",
        )
    if host.agent_instance is not None:
        record(
            session,
            principal.name,
            "host.replace" if live else "host.reclaim",
            f"host:{host.id}",
            {"old": host.agent_instance, "new": req.instance},
        )


def _back_online(session: Session, dev: Device) -> None:
    """An offline device comes back: busy while a rank may still run on it (its job's, or that
    of an ended job whose rank the host's agent has not reported ended: ``release_silent`` may
    have let go of it while the host was lost, as its agent was taken for dead), else free."""
    if dev.job_id is None:
        dev.job_id = jobs.job_still_running_on(session, dev.id)
    dev.status = DeviceStatus.BUSY if dev.job_id else DeviceStatus.FREE


def get(session: Session, host_id: int) -> Host:
    host = session.get(Host, host_id, options=[selectinload(Host.devices)])
    if host is None:
        raise NotFound(f"host {host_id} not found")
    return host


def list_hosts(session: Session) -> list[Host]:
    return list(session.scalars(select(Host).order_by(Host.id).options(selectinload(Host.devices))))


def heartbeat(
    session: Session, host_id: int, hb: Heartbeat, principal: Principal, now: datetime
) -> HeartbeatAck:
    """Record liveness and worker reports; answer with what the host must run or stop."""
    host = get(session, host_id)
    _check_host_rights(principal, host.name)
    if host.agent_instance is not None and hb.instance != host.agent_instance:
        raise Conflict(
            f"host {host.name} is now held by another agent instance ({host.agent_instance}); "
            "this agent was replaced and must stop",
            field="instance",
        )
    host.last_heartbeat = now
    if host.status != HostStatus.ACTIVE.value:
        host.status = HostStatus.ACTIVE
        for dev in host.devices:
            if dev.status == DeviceStatus.OFFLINE.value:
                _back_online(session, dev)
        record(session, principal.name, "host.recovered", f"host:{host.id}")
        scheduler.request_placement(session)
    placed = _placed_here(session, host)
    changed = False
    for report in hb.workers:
        known = placed.get((report.job_id, report.rank))
        if known is not None and (known[1] != report.attempt or known[0].state == report.state):
            continue  # an earlier attempt's, or nothing new: the common case, with no query
        jobs.apply_worker_report(session, host, report, principal, now)
        changed = True
    if changed:  # a report may have ended or restarted a job: its ranks may be gone
        session.flush()
        placed = _placed_here(session, host)
    on_devices = {(w.device_id, w.job_id) for w, _ in placed.values()}
    jobs.release_replaced(session, host, hb.workers, now, placed=on_devices)
    return HeartbeatAck(
        host_id=host.id, status=HostStatus(host.status), assignments=assignments(session, host)
    )


def _placed_here(session: Session, host: Host) -> dict[tuple[int, int], tuple[Worker, int]]:
    """The ranks placed on ``host`` with their job's current attempt, by (job, rank): one
    query, so a heartbeat's unchanged reports cost nothing more."""
    rows = session.execute(
        select(Worker, Job.attempt)
        .join(Job, Worker.job_id == Job.id)
        .where(Worker.host_id == host.id)
    ).all()
    return {(w.job_id, w.rank): (w, attempt) for w, attempt in rows}


def assignments(session: Session, host: Host) -> list[Assignment]:
    """Ranks placed on this host: ``run`` while their job is live, ``stop`` once it has ended.
    A rank still to be launched comes with a fresh worker credential (the one before it, never
    used, stops working); a launched one with none: its process has it already."""
    rows = session.execute(
        select(Worker, Job, Device)
        .join(Job, Worker.job_id == Job.id)
        .join(Device, Worker.device_id == Device.id)
        .where(Worker.host_id == host.id, Worker.state.in_(("assigned", "launching", "running")))
        .order_by(Job.id, Worker.rank)
    ).all()
    out = []
    for worker, job, device in rows:
        status = JobStatus(job.status)
        rank0_host = jobs.rank0_address(session, job)
        launch = not status.terminal and worker.state == WorkerState.ASSIGNED.value
        out.append(
            Assignment(
                job_id=job.id,
                rank=worker.rank,
                world_size=len(job.workers),
                device_index=device.index,
                device_kind=DeviceKind(device.kind),
                master_addr=rank0_host,
                master_port=job.master_port or 0,  # 0: rank 0 binds one and publishes it
                backend="nccl" if device.kind == DeviceKind.CUDA.value else "gloo",
                desired="stop" if status.terminal else "run",
                spec=job.spec,
                worker_token=tokens.mint_worker_token(worker) if launch else None,
                attempt=job.attempt,
            )
        )
    return out


def mark_lost(session: Session, now: datetime, after_s: float) -> list[Host]:
    """Hosts silent for longer than ``after_s`` become lost; their devices go offline and the
    jobs running there restart elsewhere while their ``max_restarts`` allows, else fail (a
    synchronous job cannot go on without a rank)."""
    cutoff = now - timedelta(seconds=after_s)
    lost = list(
        session.scalars(
            select(Host).where(Host.status == HostStatus.ACTIVE.value, Host.last_heartbeat < cutoff)
        )
    )
    for host in lost:
        host.status = HostStatus.LOST
        record(
            session,
            "system",
            "host.lost",
            f"host:{host.id}",
            {"last_heartbeat": host.last_heartbeat.isoformat()},
        )
        job_ids = set()
        for dev in host.devices:
            if dev.job_id is not None:
                job_ids.add(dev.job_id)
            dev.status = DeviceStatus.OFFLINE
        for job_id in sorted(job_ids):
            job = session.get(Job, job_id)
            # only a live attempt with a rank here loses it (a restarting job's old attempt
            # may still hold devices here: they just go offline)
            if (
                job is not None
                and any(w.host_id == host.id for w in job.workers)
                and JobStatus(job.status) in (JobStatus.STARTING, JobStatus.RUNNING)
            ):
                jobs.fail_or_restart(session, job, f"host '{host.name}' was lost", now)
    return lost


def release_silent(session: Session, now: datetime, after_s: float) -> list[Device]:
    """Let go of the devices that ended jobs (or a restarted job's earlier attempt) still hold
    on lost hosts silent for longer than
    ``after_s`` (the lost-host limit) plus ``WORKER_ORPHAN_EXIT_S``: their agent is taken for
    dead, and workers exit within that bound of their agent's death. The devices stay offline
    while their host is lost; should it come back, they are busy again until its agent reports
    those ranks ended (``_back_online``). Returns the devices released."""
    cutoff = now - timedelta(seconds=after_s + WORKER_ORPHAN_EXIT_S)
    held = list(
        session.scalars(
            select(Device)
            .join(Job, Device.job_id == Job.id)
            .join(Host, Device.host_id == Host.id)
            .where(
                or_(
                    Job.status.in_([s.value for s in JobStatus if s.terminal]),
                    ~exists().where(Worker.device_id == Device.id, Worker.job_id == Job.id),
                ),
                Host.status == HostStatus.LOST.value,
                Host.last_heartbeat < cutoff,
            )
        )
    )
    for dev in held:
        jobs.release(dev)
    if held:
        session.flush()
        scheduler.request_placement(session)
    return held
