"""Hosts and their devices: registration, heartbeats, and marking silent hosts lost.

A device is never shown free while a worker may still run on it. When a job ends, the device of
each rank its agent has not yet reported ended stays busy (``releases.may_still_run``), until that
agent reports the rank ended (it stops the process first), or the host has been silent for
``after_s + WORKER_ORPHAN_EXIT_S`` (``release_silent``): lost, and long enough that a dead
agent's workers have certainly exited by their own check (``agent.runtime.parent``). A lost
host's devices are offline meanwhile; if it comes back (an agent that was only cut off keeps
its workers), they are busy again until its agent reports those ranks ended.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Any, NamedTuple

from sqlalchemy import Row, bindparam, exists, func, or_, select, update
from sqlalchemy.orm import Session, joinedload, selectinload

from contract.agent import (
    WORKER_ORPHAN_EXIT_S,
    Assignment,
    Heartbeat,
    HeartbeatAck,
    HostRegister,
    WorkerReport,
)
from contract.base import PROTOCOL_VERSION
from contract.enums import DeviceKind, DeviceStatus, HostStatus, JobStatus, Role, WorkerState
from server.db import ReadChanged
from server.errors import Conflict, Forbidden, NotFound, ProtocolMismatch
from server.models import Device, Host, Job, Worker
from server.services import jobs, rank_reports, releases, scheduler, tokens
from server.services.audit import record
from server.services.paging import Paging, page
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
        dev.job_id = releases.job_still_running_on(session, dev.id)
    dev.status = DeviceStatus.BUSY if dev.job_id else DeviceStatus.FREE


_HOST = select(Host).options(joinedload(Host.devices)).where(Host.id == bindparam("host_id"))
"""A host with its devices; built once (a heartbeat reads it every time)."""


def get(session: Session, host_id: int) -> Host:
    host = session.execute(_HOST, {"host_id": host_id}).unique().scalar_one_or_none()
    if host is None:
        raise NotFound(f"host {host_id} not found")
    return host


def list_hosts(session: Session, paging: Paging = Paging()) -> tuple[list[Host], int]:
    """A page of hosts by id, with their devices, and how many there are."""
    return page(session, select(Host).order_by(Host.id).options(selectinload(Host.devices)), paging)


class Answered(NamedTuple):
    """A heartbeat's answer, and what it says of heartbeats like it."""

    ack: HeartbeatAck
    fewer_alike: bool
    """Whether a heartbeat with only some of the same reports, sent after this one committed
    and nothing else changed, gets this same answer and changes nothing: a report repeated
    changes nothing once applied (an agent resends a heartbeat whose answer it lost), and one
    left out changes nothing either, unless it is what kept a device held
    (``releases.release_replaced``). So an agent that reports a change once and then no more (it
    reports a rank's new state until a heartbeat has carried it) is answered from memory on
    the heartbeat after (``server.scale.host_answers``)."""
    to_advance: Mapping[int, int] = MappingProxyType({})
    """The jobs (id: attempt) its reports may have moved on, to advance once it has committed
    (``rank_reports.ready_to_advance``, ``rank_reports.advance_jobs``)."""


def heartbeat(
    session: Session, host_id: int, hb: Heartbeat, principal: Principal, now: datetime
) -> Answered:
    """Record liveness and worker reports; answer with what the host must run or stop.

    A steady heartbeat (nothing changed) reads plain rows, not entities, and costs three
    statements whatever the host's history or the size of its jobs: the host with its devices,
    its ranks and their jobs. It writes nothing: the host's time goes out with the caller's
    liveness batch (``server.scale.host_answers.Liveness``), as a heartbeat answered from memory's
    does; only a host coming back (lost before) has its time written here, with its status, so
    that the reaper never finds it active with the time it was lost at. Written here, the time
    held the host's row to the commit, and the batch skipped it meanwhile."""
    host = get(session, host_id)
    _check_host_rights(principal, host.name)
    if host.agent_instance is not None and hb.instance != host.agent_instance:
        raise Conflict(
            f"host {host.name} is now held by another agent instance ({host.agent_instance}); "
            "this agent was replaced and must stop",
            field="instance",
        )
    if host.status != HostStatus.ACTIVE.value:
        host.status = HostStatus.ACTIVE
        host.last_heartbeat = now
        for dev in host.devices:
            if dev.status == DeviceStatus.OFFLINE.value:
                _back_online(session, dev)
        record(session, principal.name, "host.recovered", f"host:{host.id}")
        scheduler.request_placement(session)
    reported = {r.job_id for r in hb.workers}
    placed = _placed_here(session, host, reported)
    changes = []
    again: dict[int, int] = {}
    for report in hb.workers:
        known = placed.get((report.job_id, report.rank))
        if known is not None and known.attempt != report.attempt:
            continue  # an earlier attempt's
        if known is not None and report.log_tail and known.state == report.state == _RUNNING:
            _live_log_tail(session, known.worker_id, report)  # its logs are followed
            continue
        if known is not None and known.state == report.state:
            # Nothing new, the common case, with no query. A report carried before may still
            # move its job on: one whose reports committed and whose jobs' advance then
            # failed (the database went away, the process died) was not answered, and the
            # agent sends the same reports again; they advance the jobs then.
            if rank_reports.may_move(JobStatus(known.job_status), report.state):
                again[known.job_id] = known.attempt
            continue
        changes.append(report)
    applied = rank_reports.apply_worker_reports(session, host, changes, now)
    if applied.moved is None:  # a failure may have restarted a job: its ranks may be gone
        session.flush()
        placed = _placed_here(session, host, reported)
    else:  # the same ranks, some in a new state
        for key, state in applied.moved.items():
            placed[key] = placed[key]._replace(state=state)
    on_devices = {(p.device_id, p.job_id) for p in placed.values()}
    held = releases.release_replaced(session, host, hb.workers, now, placed=on_devices)
    ack = HeartbeatAck(
        host_id=host.id,
        status=HostStatus(host.status),
        assignments=assignments(session, host, placed),
    )
    # The jobs are advanced by the caller once this commits (``rank_reports.ready_to_advance``).
    # Advancing changes nothing the answer says: a job that starts running is ``run`` either
    # way, and one that succeeds has none of its ranks live here.
    return Answered(ack, fewer_alike=not held, to_advance=again | applied.to_advance)


class Placed(NamedTuple):
    """A rank placed on a host, as a heartbeat needs it."""

    worker_id: int
    job_id: int
    rank: int
    state: WorkerState
    device_id: int | None
    attempt: int
    """Its job's current attempt."""
    job_status: str
    """Its job's status."""


_LIVE = (WorkerState.ASSIGNED.value, WorkerState.LAUNCHING.value, WorkerState.RUNNING.value)

# A heartbeat's statements, built once: building a statement and its cache key each time costs
# more than running it.
_PLACED_COLUMNS = (Worker.id, Worker.job_id, Worker.rank, Worker.state, Worker.device_id)
_PLACED_LIVE = (
    select(*_PLACED_COLUMNS, Job.attempt, Job.status)
    .join(Job, Worker.job_id == Job.id)
    .where(Worker.host_id == bindparam("host_id"), Worker.state.in_(_LIVE))
)
_PLACED_LIVE_OR_JOBS = (
    select(*_PLACED_COLUMNS, Job.attempt, Job.status)
    .join(Job, Worker.job_id == Job.id)
    .where(
        Worker.host_id == bindparam("host_id"),
        or_(Worker.state.in_(_LIVE), Worker.job_id.in_(bindparam("job_ids", expanding=True))),
    )
)
_JOB_SHAPES = select(
    Job.id,
    Job.status,
    Job.attempt,
    Job.master_port,
    Job.spec,
    Job.logs_followed_until,
    select(func.count(Worker.id))
    .where(Worker.job_id == Job.id)
    .scalar_subquery()
    .label("world_size"),
    select(Host.address)
    .join(Worker, Worker.host_id == Host.id)
    .where(Worker.job_id == Job.id, Worker.rank == 0)
    .scalar_subquery()
    .label("rank0_address"),
).where(Job.id.in_(bindparam("job_ids", expanding=True)))


_RUNNING = WorkerState.RUNNING.value


def _live_log_tail(session: Session, worker_id: int, report: WorkerReport) -> None:
    """A running rank's log tail, uploaded while its job's logs are followed."""
    values = {"log_tail": report.log_tail, "log_end": report.log_end}
    session.execute(update(Worker).where(Worker.id == worker_id).values(**values))


def _placed_here(session: Session, host: Host, reported: set[int]) -> dict[tuple[int, int], Placed]:
    """The ranks on ``host`` that are live (to run or stop; one of a job cancelled before its
    launch holds no device), of the jobs its devices hold, or that its agent ``reported``, by
    (job, rank): one query through the (host, state) and job indexes, so neither the host's
    past jobs nor its unchanged reports cost more."""
    job_ids = reported | {d.job_id for d in host.devices if d.job_id is not None}
    if job_ids:
        params = {"host_id": host.id, "job_ids": sorted(job_ids)}
        rows = session.execute(_PLACED_LIVE_OR_JOBS, params).all()
    else:
        rows = session.execute(_PLACED_LIVE, {"host_id": host.id}).all()
    return {(r[1], r[2]): Placed(*r) for r in rows}


def assignments(
    session: Session, host: Host, placed: dict[tuple[int, int], Placed]
) -> list[Assignment]:
    """Ranks ``placed`` on this host: ``run`` while their job is live, ``stop`` once it has
    ended. A rank still to be launched comes with a fresh worker credential (the one before it,
    never used, stops working); a launched one with none: its process has it already."""
    devices = {d.id: d for d in host.devices}
    live = sorted(
        (p for p in placed.values() if p.state in _LIVE and p.device_id in devices),
        key=lambda p: (p.job_id, p.rank),
    )
    if not live:
        return []
    shapes = _job_shapes(session, {p.job_id for p in live})
    to_launch = [p.worker_id for p in live if p.state == WorkerState.ASSIGNED.value]
    launching = (  # read together (and held: the session keeps its entities only while used)
        {w.id: w for w in session.scalars(select(Worker).where(Worker.id.in_(to_launch)))}
        if to_launch
        else {}
    )
    if len(launching) < len(to_launch):
        gone = sorted(set(to_launch) - launching.keys())
        raise ReadChanged(f"ranks {gone} to launch were deleted meanwhile (their job restarted)")
    out = []
    for p in live:
        device, job = devices[p.device_id], shapes[p.job_id]  # type: ignore[index]
        status = JobStatus(job.status)
        launch = not status.terminal and p.state == WorkerState.ASSIGNED.value
        token = None
        if launch:
            token = tokens.mint_worker_token(launching[p.worker_id])
        out.append(
            Assignment(
                job_id=p.job_id,
                rank=p.rank,
                world_size=job.world_size,
                device_index=device.index,
                device_kind=DeviceKind(device.kind),
                master_addr=job.rank0_address or "127.0.0.1",
                master_port=job.master_port or 0,  # 0: rank 0 binds one and publishes it
                backend="nccl" if device.kind == DeviceKind.CUDA.value else "gloo",
                desired="stop" if status.terminal else "run",
                spec=job.spec,
                worker_token=token,
                attempt=job.attempt,
                follow_log_until=None if status.terminal else job.logs_followed_until,
            )
        )
    return out


def _job_shapes(session: Session, job_ids: set[int]) -> dict[int, Row[Any]]:
    """What an assignment says of each job: status, attempt, rendezvous port, spec, until when
    its logs are followed, world size and the address of its rank 0's host (None while it has none), in one read."""
    rows = session.execute(_JOB_SHAPES, {"job_ids": sorted(job_ids)}).all()
    return {row.id: row for row in rows}


@dataclass(frozen=True)
class LossGuard:
    """When silence is taken for the control plane's trouble rather than the hosts'
    (``Settings.host_loss_pause_share``): more than ``share`` of the active hosts, and at least
    ``min_hosts`` of them, silent at once."""

    share: float = 1.0
    min_hosts: int = 1

    def pauses(self, silent: int, active: int) -> bool:
        return self.share < 1.0 and silent >= self.min_hosts and silent > self.share * active


@dataclass
class LostSweep:
    """What :func:`mark_lost` did: the hosts it marked lost, or none because the guard paused
    it with ``silent`` of the ``active`` hosts silent."""

    lost: list[Host]
    silent: int
    active: int
    paused: bool = False


def mark_lost(
    session: Session,
    now: datetime,
    after_s: float,
    *,
    guard: LossGuard = LossGuard(),
    heard_since: datetime | None = None,
) -> LostSweep:
    """Hosts silent for longer than ``after_s`` become lost; their devices go offline and the
    jobs running there restart elsewhere while their ``max_restarts`` allows, else fail (a
    synchronous job cannot go on without a rank). Silence counts from ``heard_since`` (when the
    controller became active) for a host last heard before it. None is marked when ``guard``
    pauses the sweep.

    On PostgreSQL the silent hosts' rows are locked as they are read, skipping those locked
    already: a host whose heartbeat is being written right now is not silent, and waiting for
    it (or deadlocking with it) would hold the sweep up. Their devices are locked next, and a
    host any of whose devices another transaction holds (a placement pass taking them) is left
    for the next sweep (``_lockable``). Both locks are ``NO KEY UPDATE``, what the sweep's own
    updates take (no key changes)."""
    cutoff = now - timedelta(seconds=after_s)
    if heard_since is not None and heard_since > cutoff:
        return LostSweep([], 0, 0)  # no host has been silent that long under this controller
    silent = list(
        session.scalars(
            select(Host)
            .where(Host.status == HostStatus.ACTIVE.value, Host.last_heartbeat < cutoff)
            .order_by(Host.id)
            .with_for_update(skip_locked=True, key_share=True)
        )
    )
    if not silent:
        return LostSweep([], 0, 0)
    active = session.scalar(
        select(func.count()).select_from(Host).where(Host.status == HostStatus.ACTIVE.value)
    )
    sweep = LostSweep(silent, len(silent), int(active or 0))
    if guard.pauses(sweep.silent, sweep.active):
        sweep.lost, sweep.paused = [], True
        return sweep
    sweep.lost = _lockable(session, silent)
    for host in sweep.lost:
        _lose(session, host, now)
    return sweep


_LOCK_DEVICES = (
    select(Device.id)
    .where(Device.host_id.in_(bindparam("host_ids", expanding=True)))
    .order_by(Device.id)
    .with_for_update(skip_locked=True, key_share=True)
)
_DEVICES_OF = select(Device.id, Device.host_id).where(
    Device.host_id.in_(bindparam("host_ids", expanding=True))
)


def _lockable(session: Session, silent: list[Host]) -> list[Host]:
    """The ``silent`` hosts all of whose devices this transaction could lock (PostgreSQL:
    ``FOR NO KEY UPDATE SKIP LOCKED``; SQLite has one writer, so all). Waiting for a device
    another transaction holds could deadlock with the controller's placement pass: the pass
    takes a silent host's free devices (``scheduler._take``) and inserts its ranks there, whose
    reference to the host waits for the sweep's lock on the host's row, while the sweep would
    wait for the devices. A device held means the host is being placed on or written; the next sweep
    sees it again."""
    params = {"host_ids": [h.id for h in silent]}
    locked = set(session.scalars(_LOCK_DEVICES, params))
    held = {host_id for id_, host_id in session.execute(_DEVICES_OF, params) if id_ not in locked}
    return [h for h in silent if h.id not in held]


def _lose(session: Session, host: Host, now: datetime) -> None:
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
        # may still hold devices here: they just go offline; a rank that left the job
        # for good is no loss)
        here = (
            sorted(
                w.rank for w in job.workers if w.host_id == host.id and w.rank not in job.departed
            )
            if job is not None
            else []
        )
        if (
            job is not None
            and here
            and JobStatus(job.status) in (JobStatus.STARTING, JobStatus.RUNNING)
        ):
            jobs.fail_or_restart(session, job, lost_reason(host, here, job.id, now), now)


def lost_reason(host: Host, ranks: list[int], job_id: int, now: datetime) -> str:
    """Why a job lost ranks with a host: its agent's heartbeats stopped (the host is down, cut
    off, or its agent did not come back in time)."""
    silent = (now - host.last_heartbeat).total_seconds()
    which = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    return (
        f"host '{host.name}' was lost (no heartbeat from its agent for {silent:.0f} s while "
        f"{which} of job {job_id} ran there)"
    )


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
        releases.release(dev)
    if held:
        session.flush()
        scheduler.request_placement(session)
    return held
