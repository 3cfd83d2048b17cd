"""Placement of pending jobs onto free devices, highest priority first.

Placement runs in the controller, every round (``server.controller``), never in a request: a
submission answers at once, and a job that cannot be placed yet carries ``pending_reason``
(``explain``). A job that could never be placed (more workers than devices exist on the
registered hosts) is refused at submission (``check_placeable``).

Jobs are placed by priority, then age. The first of them that is short of free devices keeps
the free ones it can use (``Hold``): jobs after it start only on the others, so a big job's
devices gather as running jobs end rather than each going to the next small job that fits.
Jobs that fit beside what it keeps still start (backfill); ``Settings.queue_hold`` turns the
hold off.

A job naming explicit ``devices`` gets exactly those once they are all free. Any other job is
placed by the planner's integer program (``server.planner.place``: maximise the predicted
throughput of the chosen devices, fewer hosts preferred, between ``workers`` and
``max_workers`` devices), warm-started from a greedy placement, with a time limit.

A job's ranks are all CUDA devices (NCCL) or all CPU slots (gloo), never a mix: one process
group has one backend. The program is solved per device kind and the better placement taken;
a job naming devices of both kinds is refused when submitted.

Device speeds for the job's workload come from telemetry of earlier (non-emulated) jobs of the
same workload on that device: samples over compute time. A device never measured on it gets the
published-figures prior (``server/planner/gpu_profiles.csv``), and a CPU a nominal one.
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import datetime
from functools import cache, cached_property
from typing import Any

from sqlalchemy import Select, func, select, update
from sqlalchemy.orm import Session

from contract.enums import DeviceKind, DeviceStatus, HostStatus, JobStatus, PlanSource, WorkerState
from contract.spec import JobSpec
from server.db import ReadChanged
from server.errors import Invalid
from server.models import (
    PENDING_REASON_LENGTH,
    Device,
    Host,
    IterationTelemetry,
    Job,
    TelemetryRollup,
    Worker,
)
from server.planner import (
    FreeDevice,
    GpuProfile,
    JobRequest,
    Placement,
    SolveStatus,
    load_gpu_profiles,
    place,
    prior_speed,
)
from server.services import plans
from server.services.audit import record

PLACEMENT_TIME_LIMIT_S = 5.0
HISTORY_JOBS = 200
"""How many recent jobs are searched for measurements of the same workload."""


@cache
def _profiles() -> tuple[GpuProfile, ...]:
    return load_gpu_profiles()


@dataclass(slots=True)
class Free:
    """A free device on a live host, as a placement pass reads it: a row, not an entity, since
    loading a large fleet's free devices as entities would take most of a pass; the devices a
    job is given are written with one statement (``_take``)."""

    id: int
    host_id: int
    kind: str
    index: int
    model: str
    memory_mb: int


_FREE = (
    select(Device.id, Device.host_id, Device.kind, Device.index, Device.model, Device.memory_mb)
    .join(Host)
    .where(Device.status == DeviceStatus.FREE.value, Host.status == HostStatus.ACTIVE.value)
    .order_by(Host.id, Device.kind, Device.index)
)


def free_devices(session: Session) -> list[Free]:
    return [Free(*row) for row in session.execute(_FREE)]


def _take(session: Session, job: Job, chosen: list[Free]) -> None:
    """Give ``chosen`` to ``job``: busy with it, in one statement, if each is still free
    (else ``ReadChanged``: the pass runs again on what is free now)."""
    ids = [d.id for d in chosen]
    taken = session.execute(
        update(Device)
        .where(Device.id.in_(ids), Device.status == DeviceStatus.FREE.value)
        .values(status=DeviceStatus.BUSY.value, job_id=job.id)
    )
    if taken.rowcount != len(ids):  # type: ignore[attr-defined]
        raise ReadChanged(f"devices {ids} for job {job.id} were not all free any more")


def _recent_jobs(session: Session) -> list[tuple[int, bool, dict[str, Any]]]:
    """(id, emulated, spec) of the ``HISTORY_JOBS`` newest jobs, newest first."""
    recent = select(Job.id, Job.emulated, Job.spec).order_by(Job.id.desc()).limit(HISTORY_JOBS)
    return [(i, emulated, spec) for i, emulated, spec in session.execute(recent)]


def _of_workload(
    recent: list[tuple[int, bool, dict[str, Any]]], workload: dict[str, Any]
) -> list[int]:
    """The non-emulated jobs of ``workload`` among ``recent``."""
    return [i for i, emulated, spec in recent if not emulated and spec.get("workload") == workload]


def measured_speeds(session: Session, workload: dict[str, Any]) -> dict[int, float]:
    """Samples/s per device for this workload, from earlier non-emulated jobs' telemetry, summed
    from their whole history (``SpeedHistory`` keeps the same sums up to date instead)."""
    job_ids = _of_workload(_recent_jobs(session), workload)
    if not job_ids:
        return {}
    sums = _rank_sums(session, job_ids)
    return _per_device(session, job_ids, sums)


_T = IterationTelemetry
_R = TelemetryRollup


Sums = dict[tuple[int, int], tuple[float, float]]
"""(samples, compute ms) per (job, rank)."""


def _raw_sums(*where: Any) -> Select[int, int, int, float]:
    """``Sums`` of the raw rows with samples outside probes that match ``where``."""
    return (
        select(_T.job_id, _T.rank, func.sum(_T.batch_size), func.sum(_T.compute_ms))
        .where(_T.batch_size > 0, _T.probe.is_(False), *where)
        .group_by(_T.job_id, _T.rank)
    )


def _add(sums: Sums, rows: Iterable[Any]) -> None:
    for job_id, rank, b, ms in rows:
        was = sums.get((job_id, rank), (0.0, 0.0))
        sums[(job_id, rank)] = (was[0] + float(b or 0), was[1] + float(ms or 0))


def _rank_sums(session: Session, job_ids: Collection[int], up_to_id: int | None = None) -> Sums:
    """``Sums`` of ``job_ids``: raw rows (those of ids up to ``up_to_id``) and the rolled-up
    history older than the retention window, weighted by its count."""
    below = [] if up_to_id is None else [_T.id <= up_to_id]
    rolled = (
        select(
            _R.job_id,
            _R.rank,
            func.sum(_R.batch_size * _R.count),
            func.sum(_R.compute_ms * _R.count),
        )
        .where(_R.job_id.in_(job_ids), _R.batch_size > 0)
        .group_by(_R.job_id, _R.rank)
    )
    sums: Sums = {}
    _add(sums, session.execute(_raw_sums(_T.job_id.in_(job_ids), *below)))
    _add(sums, session.execute(rolled))
    return sums


def _per_device(session: Session, job_ids: Collection[int], sums: Sums) -> dict[int, float]:
    """Samples/s per device: each (job, rank)'s sums counted for the device its rank holds."""
    places = session.execute(
        select(Worker.job_id, Worker.rank, Worker.device_id).where(Worker.job_id.in_(job_ids))
    )
    samples: dict[int, float] = defaultdict(float)
    millis: dict[int, float] = defaultdict(float)
    for job_id, rank, device_id in places:
        got = sums.get((job_id, rank))
        if device_id is not None and got is not None and got[1]:
            samples[device_id] += got[0]
            millis[device_id] += got[1]
    return {d: 1000.0 * samples[d] / millis[d] for d in samples if millis[d] > 0}


class SpeedHistory:
    """``measured_speeds``' sums per (job, rank), kept from one placement pass to the next and
    brought up to date from the telemetry rows added since (by id), instead of summed again from
    every recent job's whole history each pass: that sum grows with the history kept (up to
    20,000 iterations a rank) and would be the busiest statement in a fleet's database.

    The first use sums the recent jobs' history once (raw rows and roll-ups); each later one
    adds the rows of ids past the last it read, for every job (new rows are few), and drops the
    jobs that left the recent window. A row whose transaction commits after a later id was read
    (PostgreSQL, several API processes writing at once) is not counted: a few samples of the
    many an estimate has. Used by one placement thread (``Controller.place``); thread-safe."""

    def __init__(self) -> None:
        self.sums: Sums = {}
        self.last_id: int | None = None
        """The newest telemetry id read; None before the first use."""
        self._lock = threading.Lock()

    def speeds(self, session: Session, workload: dict[str, Any]) -> dict[int, float]:
        recent = _recent_jobs(session)
        job_ids = _of_workload(recent, workload)
        if not job_ids:
            return {}
        with self._lock:
            self._catch_up(session, [i for i, _, _ in recent])
            return _per_device(session, job_ids, self.sums)

    def _catch_up(self, session: Session, recent: list[int]) -> None:
        newest = session.scalar(select(func.max(_T.id))) or 0
        if self.last_id is None:
            self.sums = _rank_sums(session, recent, up_to_id=newest)
        elif newest > self.last_id:
            _add(self.sums, session.execute(_raw_sums(_T.id > self.last_id, _T.id <= newest)))
        self.last_id = max(newest, self.last_id or 0)
        oldest = min(recent, default=0)
        if any(job_id < oldest for job_id, _ in self.sums):
            self.sums = {k: v for k, v in self.sums.items() if k[0] >= oldest}


@cache
def _prior(model: str, cpu: bool, memory_mb: int) -> float:
    """The published-figures prior of a device (fuzzy name matching: worth doing once a model)."""
    return prior_speed(model, _profiles(), cpu=cpu, memory_gb=memory_mb / 1024).samples_per_s


class Speeds:
    """Measured samples/s per device for a workload (earlier jobs of it), read once per workload
    in a placement round (from ``history`` when the caller keeps one across rounds); a device
    without is predicted by its prior."""

    def __init__(self, session: Session, history: SpeedHistory | None = None) -> None:
        self.session = session
        self.history = history
        self.measured: dict[str, dict[int, float]] = {}

    @staticmethod
    def key(spec: JobSpec) -> str:
        return json.dumps(spec.workload.model_dump(mode="json"), sort_keys=True)

    def of(self, spec: JobSpec) -> dict[int, float]:
        key = self.key(spec)
        if key not in self.measured:
            workload = json.loads(key)
            self.measured[key] = (
                self.history.speeds(self.session, workload)
                if self.history is not None
                else measured_speeds(self.session, workload)
            )
        return self.measured[key]


class Pool:
    """The free devices of one placement pass, and each device as the planner sees it
    (``FreeDevice``), made once per workload in the pass and shared by every pending job of it,
    not made again for each job: that would cost pending jobs times devices every pass."""

    def __init__(
        self, session: Session, free: list[Free], history: SpeedHistory | None = None
    ) -> None:
        self.speeds = Speeds(session, history)
        self.by_id = {d.id: d for d in free}
        """Every device free when the pass began (the jobs' choices take from them)."""
        self._made: dict[str, dict[int, FreeDevice]] = {}

    def candidates(self, spec: JobSpec, usable: list[Free]) -> list[FreeDevice]:
        """The ``usable`` devices for ``spec``'s workload, in their order."""
        key = self.speeds.key(spec)
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = candidate_map(self.by_id.values(), self.speeds.of(spec))
        return [made[d.id] for d in usable]


def candidate_map(free: Iterable[Free], measured: dict[int, float]) -> dict[int, FreeDevice]:
    """Each device as the planner sees it, by id: its measured speed on the workload, or the
    published-figures prior for its model."""
    return {
        d.id: FreeDevice(
            id=d.id,
            host=str(d.host_id),
            model=d.model,
            memory_gb=d.memory_mb / 1024,
            samples_per_s=measured.get(d.id)
            or _prior(d.model, d.kind == DeviceKind.CPU.value, d.memory_mb),
        )
        for d in free
    }


def choose_devices(
    session: Session, job: Job, spec: JobSpec, usable: list[Free], pool: Pool
) -> list[Free] | None:
    """Devices for one job among the ``usable`` ones of the pass's ``pool``, or None if it
    cannot start now."""
    if spec.devices is not None:
        ids = {d.id for d in usable}
        if not all(d in ids for d in spec.devices):
            return None
        return [pool.by_id[d] for d in spec.devices]
    assert spec.workers is not None
    if len(usable) < spec.workers:
        return None
    request = JobRequest(
        id=str(job.id),
        min_workers=spec.workers,
        max_workers=spec.max_workers or spec.workers,
        priority=spec.priority,
    )
    placement = _best_of_kinds(request, pool.candidates(spec, usable), pool.by_id)
    if placement is None:
        return None
    job.error = None
    chosen = [pool.by_id[int(d)] for d in placement.device_ids]
    # Ranks in host order, so neighbours in the ring share a host where they can.
    chosen.sort(key=lambda d: (d.host_id, d.kind, d.index))
    session.info.setdefault("placements", {})[job.id] = {
        "status": placement.status.value,
        "predicted_samples_per_s": round(placement.predicted_samples_per_s, 1),
        "hosts": len(placement.hosts_used),
    }
    return chosen


def _best_of_kinds(
    request: JobRequest, cands: list[FreeDevice], by_id: dict[int, Free]
) -> Placement | None:
    """The best placement on devices of one kind (never CPU and CUDA ranks in one job)."""
    groups: dict[str, list[FreeDevice]] = defaultdict(list)
    for c in cands:
        groups[by_id[int(c.id)].kind].append(c)
    best: Placement | None = None
    for group in groups.values():
        if len(group) < request.min_workers:
            continue
        placement = place(request, group, time_limit_s=PLACEMENT_TIME_LIMIT_S)
        if placement.status is SolveStatus.INFEASIBLE or not placement.device_ids:
            continue
        if best is None or placement.objective > best.objective:
            best = placement
    return best


def check_placeable(session: Session, spec: JobSpec) -> None:
    """Refuse (422) a job that could never be placed: it needs more devices of one kind (its
    ranks share one backend) than the registered hosts have, busy or not."""
    if spec.workers is None:
        return  # explicit devices: their existence is checked by the caller
    most = session.execute(
        select(func.count(Device.id)).group_by(Device.kind).order_by(func.count(Device.id).desc())
    ).first()
    if most is not None and spec.workers <= most[0]:
        return  # the common case, one small aggregate; the details only to say what is short
    rows = session.execute(
        select(Device.kind, Host.name, func.count(Device.id))
        .join(Host)
        .group_by(Device.kind, Host.name)
        .order_by(Device.kind, Host.name)
    ).all()
    by_kind: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for kind, host, n in rows:
        by_kind[str(kind)].append((host, int(n)))
    totals = {kind: sum(n for _, n in hosts) for kind, hosts in by_kind.items()}
    best = max(totals.values(), default=0)
    if spec.workers <= best:
        return
    listed = "; ".join(
        f"{kind}: {', '.join(f'{n} on {h}' for h, n in by_kind[kind])}" for kind in sorted(by_kind)
    )
    plural = "s" if spec.workers != 1 else ""
    raise Invalid(
        f"the job needs {spec.workers} device{plural} of one kind but the registered hosts "
        f"have at most {best} ({listed or 'no host is registered'}): {spec.workers - best} "
        "short, so it could never be placed",
        field="workers",
    )


def request_placement(session: Session) -> None:
    """Ask for a placement round once this session commits (devices were added or freed, or a
    job was submitted): the request's session pokes the controller (``server.api.deps``)."""
    session.info["placement"] = True


@dataclass(frozen=True)
class Landscape:
    """Every device as ``explain`` needs it (id, the job holding it, whether it is free on a live
    host), read once, as plain rows: a placement round and a submission each read it once,
    not once per pending job (every device, per job, per round)."""

    rows: tuple[tuple[int, int | None, bool], ...]

    @classmethod
    def read(cls, session: Session, only: Collection[int] | None = None) -> Landscape:
        """Every device, or ``only`` these."""
        free = (Device.status == DeviceStatus.FREE.value) & (Host.status == HostStatus.ACTIVE.value)
        query = select(Device.id, Device.job_id, free).join(Host).order_by(Device.id)
        if only is not None:
            query = query.where(Device.id.in_(sorted(only)))
        rows = session.execute(query).all()
        return cls(tuple((int(i), j, bool(f)) for i, j, f in rows))

    def taken(self, job_id: int, device_ids: set[int]) -> Landscape:
        """After ``job_id`` was given ``device_ids`` in this round."""
        return Landscape(
            tuple((i, job_id, False) if i in device_ids else (i, j, f) for i, j, f in self.rows)
        )

    @cached_property
    def tally(self) -> Tally:
        """The whole inventory counted once: every pending job that names no devices is
        explained from it (a round explained 130 pending jobs over 2,000 devices each)."""
        return Tally.of(self.rows)


@dataclass(frozen=True)
class Tally:
    """Devices counted as a pending reason tells them: free, busy by holder (most first),
    offline."""

    free: int
    holders: tuple[tuple[int, int], ...]
    """(job, devices it holds) for busy devices, most first, then by job."""
    away: int

    @classmethod
    def read(cls, session: Session) -> Tally:
        """The counts of ``Landscape.read(session).tally``, taken by the database: a
        submission's first pending reason needs no device list (10,000 rows at fleet scale,
        read once per ``POST /jobs``)."""
        rows = session.execute(
            select(Device.job_id, Device.status, Host.status, func.count(Device.id))
            .join(Host)
            .group_by(Device.job_id, Device.status, Host.status)
        ).all()
        busy: dict[int, int] = defaultdict(int)
        free = away = 0
        for job_id, status, host_status, n in rows:
            if status == DeviceStatus.FREE.value and host_status == HostStatus.ACTIVE.value:
                free += n
            elif job_id is None:
                away += n
            else:
                busy[int(job_id)] += n
        return cls(free, _most_first(busy), away)

    @classmethod
    def of(cls, rows: tuple[tuple[int, int | None, bool], ...]) -> Tally:
        busy: dict[int, int] = defaultdict(int)
        free = away = 0
        for _, job_id, is_free in rows:
            if is_free:
                free += 1
            elif job_id is None:
                away += 1
            else:
                busy[job_id] += 1
        return cls(free, _most_first(busy), away)


def _most_first(busy: dict[int, int]) -> tuple[tuple[int, int], ...]:
    return tuple(sorted(busy.items(), key=lambda kv: (-kv[1], kv[0])))


REASON_HOLDERS = 3
"""The jobs holding the most of the wanted devices that a pending reason names (the rest are
summed): on a large fleet a reason naming every busy job would overflow its column."""


def explain(spec: JobSpec, landscape: Landscape, *, tried: bool) -> str:
    """Why a job is not placed on the devices now free: "needs 4 devices, 2 free, 2 busy with
    job 7". ``tried``: placement was attempted with them (else it has yet to be). Busy devices
    are told only when too few are free, by the jobs holding most of them."""
    if spec.devices is None:
        return _reason(spec, landscape.tally, 0, tried=tried)
    wanted = set(spec.devices)
    rows = tuple(r for r in landscape.rows if r[0] in wanted)
    return _reason(spec, Tally.of(rows), len(rows), tried=tried)


def explain_submitted(session: Session, spec: JobSpec) -> str:
    """``explain(spec, Landscape.read(session), tried=False)`` for a job just submitted, from
    counts the database takes (or, for a job naming its devices, just those)."""
    if spec.devices is None:
        return _reason(spec, Tally.read(session), 0, tried=False)
    rows = Landscape.read(session, only=spec.devices).rows
    return _reason(spec, Tally.of(rows), len(rows), tried=False)


def _reason(spec: JobSpec, tally: Tally, named_found: int, *, tried: bool) -> str:
    """``explain``'s words for ``tally``: the whole inventory, or the ``named_found`` devices
    of those a job names that exist."""
    if spec.devices is not None:
        wanted = set(spec.devices)
        named = sorted(wanted) if len(wanted) <= 8 else f"{len(wanted)} named"
        need = f"needs devices {named}"
        have = f"{tally.free} of them free"
        short = tally.free < named_found
    else:
        need = f"needs {spec.workers} device{'s' if spec.workers != 1 else ''}"
        have = f"{tally.free} free"
        short = tally.free < (spec.workers or 1)
    parts = [need, have]
    if short:
        holders = tally.holders
        parts += [f"{n} busy with job {job_id}" for job_id, n in holders[:REASON_HOLDERS]]
        if len(holders) > REASON_HOLDERS:
            rest = holders[REASON_HOLDERS:]
            parts.append(f"{sum(n for _, n in rest)} busy with {len(rest)} other jobs")
    if tally.away:
        parts.append(f"{tally.away} offline")
    if not short and spec.devices is None:
        parts.append("no placement fits them" if tried else "waiting for the controller")
    return ", ".join(parts)[:PENDING_REASON_LENGTH]


@dataclass(frozen=True)
class Hold:
    """Free devices kept for the first job in the queue that is short of them (its kind's
    free devices, or the free ones of those it names, all fewer than it needs): jobs after it
    start only on the others. Worked out again every placement pass, from what is free then."""

    job_id: int
    priority: int
    device_ids: frozenset[int]
    need: int

    @classmethod
    def of(cls, session: Session, job: Job, spec: JobSpec, free: list[Free]) -> Hold | None:
        """What ``job`` keeps, or None where holding would not bring its start closer: it is
        not short of free devices (no placement fits them for another reason), or too few of
        its devices exist on live hosts for it to start at all."""
        if spec.devices is not None:
            wanted = set(spec.devices)
            kept = [d for d in free if d.id in wanted]
            need = len(wanted)
        else:
            assert spec.workers is not None
            need = spec.workers
            live = {
                str(kind): int(n)
                for kind, n in session.execute(
                    select(Device.kind, func.count(Device.id))
                    .join(Host)
                    .where(Host.status == HostStatus.ACTIVE.value)
                    .group_by(Device.kind)
                )
            }
            by_kind: dict[str, list[Free]] = defaultdict(list)
            for d in free:
                by_kind[d.kind].append(d)
            # The kind it would start on soonest: most free, of those with enough devices.
            kinds = [k for k, n in live.items() if n >= need]
            if not kinds:
                return None
            kept = max((by_kind[k] for k in kinds), key=len)
        if len(kept) >= need:
            return None
        return cls(job.id, job.priority, frozenset(d.id for d in kept), need)

    def rest(self, free: list[Free]) -> list[Free]:
        return [d for d in free if d.id not in self.device_ids]

    def keeps(self, reason: str) -> str:
        kept = len(self.device_ids)
        them = (
            f"the {kept} free devices it can use are"
            if kept != 1
            else "the free device it can use is"
        )
        return f"first in the queue: {them} kept for it until {self.need} are; {reason}"

    def blocks(self, spec: JobSpec, free: int) -> str:
        kept = len(self.device_ids)
        need = (
            f"needs devices {sorted(spec.devices)}"
            if spec.devices is not None and len(spec.devices) <= 8
            else f"needs {spec.world_size} device{'s' if spec.world_size != 1 else ''}"
        )
        return (
            f"{need}, {free} free but {kept} of them kept for job {self.job_id} (priority "
            f"{self.priority}), first in the queue and waiting for {self.need}"
        )


def _enough(spec: JobSpec, free: list[Free]) -> bool:
    """Whether ``free`` has devices enough for the job to start, by count: all it names, or
    ``workers`` of one kind."""
    if spec.devices is not None:
        ids = {d.id for d in free}
        return all(d in ids for d in spec.devices)
    kinds: dict[str, int] = defaultdict(int)
    for d in free:
        kinds[d.kind] += 1
    return max(kinds.values(), default=0) >= (spec.workers or 1)


def place_pending(
    session: Session, now: datetime, *, hold: bool = True, history: SpeedHistory | None = None
) -> list[Job]:
    """Give devices to pending jobs, by priority then age. Returns jobs placed.

    ``hold``: the first job in that order that is short of free devices keeps those there are
    (``Hold``) and later jobs start only on the rest, so the devices a big job needs gather as
    running jobs end, instead of each going to the next small job that fits (which made a
    64-worker job at top priority wait behind a stream of small ones indefinitely). Without
    it, every job that fits starts."""
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
    pool = Pool(session, free, history)
    landscape: Landscape | None = None
    held: Hold | None = None
    for job in pending:
        spec = job.job_spec
        usable = held.rest(free) if held is not None else free
        chosen = choose_devices(session, job, spec, usable, pool)
        if chosen is None:
            if held is not None and _enough(spec, free) and not _enough(spec, usable):
                reason = held.blocks(spec, len(free))
            else:
                landscape = landscape or Landscape.read(session)
                reason = explain(spec, landscape, tried=True)
                if held is None and hold:
                    held = Hold.of(session, job, spec, free)
                    if held is not None and held.device_ids:
                        reason = held.keeps(reason)
            reason = reason[:PENDING_REASON_LENGTH]
            if job.pending_reason != reason:
                job.pending_reason = reason
            continue
        job.pending_reason = None
        taken = {d.id for d in chosen}
        free = [d for d in free if d.id not in taken]
        if landscape is not None:
            landscape = landscape.taken(job.id, taken)
        _take(session, job, chosen)
        for rank, dev in enumerate(chosen):
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
        job.status = JobStatus.STARTING
        job.master_port = None  # rank 0 binds a free port and publishes it (rendezvous)
        session.flush()
        plans.create(
            session,
            job,
            plans.equal_split(spec.global_batch, len(chosen)),
            PlanSource.INITIAL,
            "equal split until each worker's speed is measured",
            by="system",
        )
        detail = {
            "devices": [d.id for d in chosen],
            **session.info.get("placements", {}).get(job.id, {}),
        }
        record(session, "system", "job.placed", f"job:{job.id}", detail)
        placed.append(job)
    return placed
