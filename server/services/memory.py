"""Per-rank memory caps of a job: the most samples one forward/backward pass may hold.

A rank's cap comes from three things, the tightest winning:

- its **memory model** ``mem(b) = base + per_sample * b`` (``server.planner.memory``), fitted
  from the peak memory its telemetry reports per iteration. An iteration's peak belongs to its
  largest pass: ``min(batch, cap in force)`` under the plan that iteration ran;
- its **device's memory**: the emulated ``memory_mb`` of an emulated job's rank, else the
  ``memory_mb`` its host registered for a CUDA device, less the job's ``memory_headroom``;
- the smallest pass that **ran out of memory** on it (telemetry's ``oom_batch``): the cap stays
  below it whatever the model says.

A rank with no memory telemetry and no out-of-memory report has no cap (CPU devices measure no
peak memory). Reading only; the rebalancer plans with the caps and stores them with the plan.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from contract.enums import DeviceKind
from server.models import Device, IterationTelemetry, Job, Plan, StragglerEvent, Worker
from server.planner.memory import MemoryFit, MemoryObservation, fit_memory

OOM_EVENT = "oom"
"""The event kind of an out-of-memory report (shown with the straggler events)."""

WINDOW = 200
"""Iterations of history a memory fit looks at (memory does not drift; this bounds the read)."""


@dataclass(frozen=True)
class RankMemory:
    rank: int
    device_mb: int | None
    """The memory a cap is derived from (None: unknown, no cap from the model)."""
    fit: MemoryFit | None
    """None when the rank has reported no peak memory."""
    oom_batch: int | None
    """Smallest pass size that ran out of memory on this rank."""
    cap: int | None
    """Most samples per pass; None: no cap."""
    headroom: float

    def predict(self, batch: int) -> float | None:
        """Predicted peak MB of a pass of ``batch`` (capped at the rank's cap), if known."""
        model = self.fit.usable if self.fit else None
        if model is None:
            return None
        return model.predict(batch if self.cap is None else min(batch, self.cap))


def device_memory(session: Session, job: Job) -> list[int | None]:
    """Each rank's device memory in MB: emulated, or a CUDA device's registered memory."""
    spec = job.job_spec
    world = len(job.workers)
    rows = session.execute(
        select(Worker.rank, Device.kind, Device.memory_mb)
        .join(Device, Device.id == Worker.device_id)
        .where(Worker.job_id == job.id)
    ).all()
    registered = {
        int(rank): int(mb) for rank, kind, mb in rows if kind == DeviceKind.CUDA and mb > 0
    }
    out: list[int | None] = []
    for rank in range(world):
        emulated = spec.emulation[rank].memory_mb if spec.emulation else None
        out.append(emulated if emulated is not None else registered.get(rank))
    return out


def caps_by_version(session: Session, job_id: int) -> dict[int, list[int | None]]:
    """The memory caps each of the job's plans carried, by version (plans with caps only)."""
    rows = session.execute(
        select(Plan.version, Plan.memory_caps).where(
            Plan.job_id == job_id, Plan.memory_caps.is_not(None)
        )
    ).all()
    return {int(v): list(c) for v, c in rows if c}


MemoryRow = tuple[int, int, int, float | None, bool, int | None, int | None]
"""``(rank, plan version, batch, peak MB, probe, pass size, oom batch)`` of a telemetry row."""


@dataclass
class KeptMemory:
    """The rows of a job's recent window that measured a peak or ran out of memory, kept up to
    date by the control loop from the rows it reads each sweep (``rebalancer.FitWindow``), so
    a decision's caps need no read of the window. Most jobs keep none (CPU ranks measure no
    peak): their caps come from out-of-memory events alone, with no read of the devices."""

    rows: list[tuple[int, MemoryRow]] = field(default_factory=list)
    """``(iteration, row)``, oldest first (but for rows that turned up late)."""
    newest: int | None = None

    def add(self, rows: list[tuple[int, MemoryRow]], newest: int | None) -> None:
        self.newest = newest
        if newest is None:
            return
        cutoff = newest - WINDOW
        self.rows += [r for r in rows if r[0] > cutoff]
        old = 0
        while old < len(self.rows) and self.rows[old][0] <= cutoff:
            old += 1
        del self.rows[:old]

    def window(self) -> list[MemoryRow]:
        """The kept rows within ``WINDOW`` iterations of the newest."""
        if self.newest is None:
            return []
        cutoff = self.newest - WINDOW
        return [row for iteration, row in self.rows if iteration > cutoff]


def recent(
    session: Session,
    job: Job,
    kept: KeptMemory | None = None,
    plan_caps: dict[int, list[int | None]] | None = None,
) -> tuple[dict[int, list[MemoryObservation]], dict[int, int]]:
    """Per rank, from the recent window: (pass size, peak MB) of its iterations that measured
    their peak; and the smallest pass size that ran out of memory, from the ``oom`` events
    (kept after old telemetry is rolled up) and the recent telemetry (reports not yet turned
    into events by the control loop). One read of the window for both: a decision reads them
    every time, and most jobs report neither (CPU ranks measure no peak). With ``kept`` (and
    its plans' caps, ``plan_caps``) the window is the control loop's, not read."""
    T, E = IterationTelemetry, StragglerEvent
    rows: list[MemoryRow] = []
    if kept is not None:
        rows = kept.window()
        caps = plan_caps or {}
    else:
        last = session.scalar(select(func.max(T.iteration)).where(T.job_id == job.id))
        if last is not None:
            rows = [
                tuple(r)  # type: ignore[misc]
                for r in session.execute(
                    select(
                        T.rank,
                        T.plan_version,
                        T.batch_size,
                        T.peak_memory_mb,
                        T.probe,
                        T.pass_size,
                        T.oom_batch,
                    ).where(
                        T.job_id == job.id,
                        T.iteration > last - WINDOW,
                        ((T.batch_size > 0) & T.peak_memory_mb.is_not(None))
                        | T.oom_batch.is_not(None),
                    )
                )
            ]
        caps = caps_by_version(session, job.id) if rows else {}
    seen: dict[int, list[MemoryObservation]] = defaultdict(list)
    failed: dict[int, int] = {}
    for rank, version, batch, peak, probe, pass_size, oom in rows:
        if oom is not None:
            failed[int(rank)] = min(failed.get(int(rank), int(oom)), int(oom))
        if batch <= 0 or peak is None:
            continue
        plan_caps_v = caps.get(int(version))
        cap = plan_caps_v[rank] if plan_caps_v and rank < len(plan_caps_v) and not probe else None
        if pass_size is not None:  # the rank says which pass the peak belongs to
            size = int(pass_size)
        else:
            size = int(batch) if not cap else min(int(batch), int(cap))
        seen[int(rank)].append(MemoryObservation(size, float(peak)))
    for event in session.scalars(select(E).where(E.job_id == job.id, E.kind == OOM_EVENT)):
        ran = event.detail.get("batch")
        if event.rank is not None and isinstance(ran, int):
            failed[event.rank] = min(failed.get(event.rank, ran), ran)
    return seen, failed


def ranks(session: Session, job: Job) -> list[RankMemory]:
    """Every rank's memory picture and cap (see the module docstring)."""
    seen, failed = recent(session, job)
    return _ranks(session, job, seen, failed)


def _ranks(
    session: Session,
    job: Job,
    seen: dict[int, list[MemoryObservation]],
    failed: dict[int, int],
) -> list[RankMemory]:
    headroom = job.job_spec.policy.memory_headroom
    devices = device_memory(session, job)
    out = []
    for rank, device_mb in enumerate(devices):
        fit = fit_memory(seen[rank]) if seen.get(rank) else None
        model = fit.usable if fit else None
        cap = model.cap(device_mb, headroom) if model is not None and device_mb else None
        if cap is not None and device_mb:  # a pass measured within the headroom fits, whatever
            usable = (1 - headroom) * device_mb  # the model says
            fitted = [o.batch_size for o in seen[rank] if o.peak_mb <= usable]
            cap = max([cap, *fitted])
        oom = failed.get(rank)
        if oom is not None:
            cap = oom - 1 if cap is None else min(cap, oom - 1)
        out.append(RankMemory(rank, device_mb, fit, oom, cap, headroom))
    return out


def caps(
    session: Session,
    job: Job,
    kept: KeptMemory | None = None,
    plan_caps: dict[int, list[int | None]] | None = None,
) -> tuple[int | None, ...]:
    """Every rank's cap; with ``kept``, from the control loop's window (``recent``). A job
    none of whose ranks measured a peak has caps from out-of-memory reports alone, and needs
    no read of its devices."""
    seen, failed = recent(session, job, kept, plan_caps)
    if seen or kept is None:
        return tuple(r.cap for r in _ranks(session, job, seen, failed))
    return tuple(failed[r] - 1 if r in failed else None for r in range(len(job.workers)))
