"""Straggler watch: live telemetry -> the pure detector -> stored events, and for ``adaptive``
jobs the mitigation ladder -> plans.

Per live job the watch keeps a ``Detector`` and a ``LadderState`` (plain data) in memory and
feeds them the iterations reported since the last round. On a restart they are rebuilt from the
last ``REPLAY`` iterations, so nothing needs its own table. Events go to ``straggler_events``
(opened, updated, closed); the dashboard shows them on the job's timeline.

The detector measures each rank against its *normal* model: the fit of the rebalancer, taken
while the rank has no open event (a fit during a slowdown would absorb it). The ladder's
exclusions are partial all-reduce (``Plan.excluded``); an operator's exclusion is "no samples"
and stays in the group. Operators' overrides (freeze, pins, exclusions) bind the ladder.
"""

from __future__ import annotations

import logging
import statistics
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt
from sqlalchemy import bindparam, event, func, select
from sqlalchemy.orm import Session

from contract.enums import PlanSource, PolicyName
from contract.spec import JobSpec
from server.models import Device, IterationTelemetry, Job, Plan, Worker
from server.models import StragglerEvent as EventRow
from server.planner import PerfModel
from server.services import plans, rebalancer
from server.services.audit import record
from server.services.rebalancer import FitWindow, NewColumns, NewRow, Progress
from server.stragglers import (
    Change,
    Decision,
    Detector,
    EventUpdate,
    LadderConfig,
    LadderState,
    Overrides,
    RankHealth,
    Situation,
    StragglerKind,
    decide,
    rank_views,
)

log = logging.getLogger("evenflow.stragglers")

REFRESH_EVERY = 25
"""Normal models are refitted every this many iterations, and only once the watch has caught up
with the telemetry (while it works through a backlog the fits would be stale anyway)."""
REFRESH_STEADY = 100
"""...but only every this many (half a fit window) while the job is steady: the same plan as at
the last refit, which saw a recency half-life of it, no event open or changed since, a model
for every rank. A refit then sees more of the same batch sizes, so it moves the models by
little while refitting every rank (the largest cost of a settled job's sweep); a new plan or an
event brings ``REFRESH_EVERY`` back."""
MAX_TIMINGS_PER_ROUND = 4096
REPLAY = rebalancer.FIRST_READ_ITERATIONS
"""Iterations replayed into a fresh detector (after a restart or for a new job)."""


class Pending:
    """A watch's kept timings, as columns (``NewColumns``): rank, iteration, batch, compute ms
    and plan version of each row with samples not fed to the detector yet."""

    __slots__ = ("batch", "compute", "iteration", "rank", "version")

    def __init__(self) -> None:
        self.rank = np.empty(0, dtype=np.int64)
        self.iteration = np.empty(0, dtype=np.int64)
        self.batch = np.empty(0, dtype=np.int64)
        self.compute = np.empty(0, dtype=np.float64)
        self.version = np.empty(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.rank)

    def add(self, cols: NewColumns, rows: npt.NDArray[np.bool_]) -> None:
        if not rows.any():
            return
        self.rank = np.concatenate((self.rank, cols.rank[rows]))
        self.iteration = np.concatenate((self.iteration, cols.iteration[rows]))
        self.batch = np.concatenate((self.batch, cols.batch[rows]))
        self.compute = np.concatenate((self.compute, cols.compute[rows]))
        self.version = np.concatenate((self.version, cols.version[rows]))

    def keep(self, rows: npt.NDArray[np.bool_]) -> None:
        if rows.all():
            return
        self.rank, self.iteration = self.rank[rows], self.iteration[rows]
        self.batch, self.compute, self.version = (
            self.batch[rows],
            self.compute[rows],
            self.version[rows],
        )

    def drop_through(self, iteration: int) -> None:
        """Forget the rows of iterations up to ``iteration``."""
        self.keep(self.iteration > iteration)


@dataclass
class Watch:
    """What the watch remembers about one job between rounds."""

    detector: Detector = field(default_factory=Detector)
    ladder: LadderState = field(default_factory=LadderState)
    fed_through: int = -1
    normal: dict[int, PerfModel] = field(default_factory=dict)
    rows: dict[tuple[int, int, str], int] = field(default_factory=dict)
    """Event key -> row id in straggler_events (committed, or written in the transaction under
    way: ``unsaved`` says which)."""
    unsaved: dict[tuple[int, int, str], EventUpdate] = field(default_factory=dict)
    """Event key -> its latest update written in a transaction not committed yet
    (:func:`_store`). Its commit clears them; its rollback keeps them, and drops the rows it
    had added from ``rows``, so the job's next ``detect`` writes them again
    (:func:`_track_commit`): the detector remembers what it reported and never reports it
    twice, so an update rolled back (a later step of the sweep failed) was otherwise lost
    until the event changed again, and one that never changes again for good."""
    added: set[tuple[int, int, str]] = field(default_factory=set)
    """The keys of ``unsaved`` whose rows that transaction added (gone if it rolls back)."""
    refreshed_through: int = -1
    """The iteration the normal models were last refreshed at (they are refitted every
    ``REFRESH_EVERY`` iterations, not every round: a fit per rank is the round's main cost)."""
    refreshed_plan: int | None = None
    """The plan version in force at the last refresh of the normal models, if that refresh saw
    at least ``HALF_LIFE`` iterations of it (a fit mostly of that plan's timings)."""
    stirred: bool = True
    """An event opened, changed or closed since the last refresh of the normal models."""
    quiet_since: dict[int, int] = field(default_factory=dict)
    """rank -> the iteration its last event ended: its fits mix slow and normal timings until a
    whole fit window has passed after that."""
    onsets: dict[int, int] = field(default_factory=dict)
    """rank -> the onset of its event that was stored open when this watch began, until the
    watch first feeds its detector (``resume``)."""
    pending: Pending = field(default_factory=Pending)
    """The rows with samples of iterations not fed to the detector yet (``add``): an iteration
    is fed once every rank has reported it."""
    newest: int = -1
    """The newest iteration of any row added."""
    normal_version: int = 0
    """Counts the changes to ``normal``: part of what the ladder last decided on."""
    rested: tuple[tuple[object, ...], int] | None = None
    """``(inputs, iteration)`` of the ladder's last decision when it held with nothing of its
    own under way (``_ladder_rests``); None when it acted, or has something to follow up."""
    plan_sizes: dict[int, list[int]] = field(default_factory=dict)
    """Plan version -> its batch sizes, for the versions the last timings read ran under
    (plans never change once made: a sweep reads only versions it has not seen)."""
    gloo: bool | None = None
    """Whether every device of the job's workers is a CPU: what ``ladder_config`` needs to know
    about the devices, read once per attempt (which keeps its devices; a restart is a new
    attempt, and the control loop starts a new watch: ``LoopState.follow``)."""

    def add(self, rows: Sequence[NewRow], columns: NewColumns | None = None) -> None:
        """Keep the new rows (``NewRows``, read once per sweep by the control loop;
        ``columns``: the same as columns) with samples of iterations not fed yet; a fresh watch
        starts ``REPLAY`` iterations back."""
        if not rows:
            return
        cols = columns if columns is not None else NewColumns(rows)
        self.newest = max(self.newest, int(cols.iteration.max()))
        after = self.after()
        self.pending.add(cols, (cols.batch > 0) & (cols.iteration > after))
        if self.fed_through < 0:  # the replay's start moves with the newest iteration
            self.pending.drop_through(after)

    def after(self) -> int:
        """The last iteration already fed to the detector (on a fresh watch: ``REPLAY`` back)."""
        return self.fed_through if self.fed_through >= 0 else max(-1, self.newest - REPLAY)


Timings = list[tuple[int, list[tuple[int, int, float, int | None]]]]
"""``(iteration, [(rank, batch, compute ms, planned batch), ...])``, as
``Detector.observe_iterations`` takes them."""


def _take(session: Session, job: Job, watch: Watch, through: int) -> Timings:
    """The kept timings of iterations up to ``through`` (``Watch.add``), by iteration then rank,
    at most ``MAX_TIMINGS_PER_ROUND`` of them and only whole iterations: under a flood the watch
    catches up over rounds instead of holding the interpreter for one long round. Each carries
    the rank's batch in its plan, so the detector judges an epoch's final partial batch at its
    size."""
    p = watch.pending
    due = p.iteration <= through
    if not due.any():
        watch.plan_sizes = {}
        return []
    fresh = np.flatnonzero(due & (p.iteration > watch.after()))
    order = fresh[np.lexsort((p.rank[fresh], p.iteration[fresh]))]
    its = p.iteration[order]
    ends = [*(np.flatnonzero(its[1:] != its[:-1]) + 1).tolist(), len(order)]
    # whole iterations, the first even if wider than the cap
    whole = max(1, bisect_right(ends, MAX_TIMINGS_PER_ROUND)) if len(order) else 0
    ends = ends[:whole]
    taken = order[: ends[-1]] if ends else order
    last = int(its[ends[-1] - 1]) if ends else through
    ranks, versions = p.rank[taken], p.version[taken]
    batches, computes = p.batch[taken].tolist(), p.compute[taken].tolist()
    p.keep(~(due & (p.iteration <= last)))  # older ones were fed already: dropped
    if not len(taken):
        watch.plan_sizes = {}
        return []
    wanted = set(np.unique(versions).tolist())
    known = watch.plan_sizes
    planned = {v: known[v] for v in wanted if v in known}
    planned |= _planned(session, job, wanted - set(known))
    watch.plan_sizes = planned
    sizes = np.full(len(taken), -1, dtype=np.int64)
    for v, of_ranks in planned.items():
        rows = versions == v
        table = np.array(of_ranks, dtype=np.int64)
        r = ranks[rows]
        inside = (r >= 0) & (r < len(table))
        sizes[rows] = np.where(inside, table[np.where(inside, r, 0)], -1) if len(table) else -1
    sized: list[Any] = sizes.tolist()
    if (sizes < 0).any():  # a version or rank its plan does not size: None
        sized = [None if s < 0 else s for s in sized]
    samples: list[tuple[int, int, float, int | None]] = list(
        zip(ranks.tolist(), batches, computes, sized, strict=True)
    )
    starts = [0, *ends[:-1]]
    return [(int(its[a]), samples[a:b]) for a, b in zip(starts, ends, strict=True)]


def _planned(session: Session, job: Job, versions: set[int]) -> dict[int, list[int]]:
    """Batch sizes of these plan versions of the job."""
    if not versions:
        return {}
    found = session.execute(
        select(Plan.version, Plan.batch_sizes).where(
            Plan.job_id == job.id, Plan.version.in_(sorted(versions))
        )
    )
    return {int(v): list(sizes) for v, sizes in found}


def _at(sizes: list[int] | None, rank: int) -> int | None:
    return sizes[rank] if sizes is not None and 0 <= rank < len(sizes) else None


def _refresh_normal(
    session: Session,
    job: Job,
    watch: Watch,
    through: int,
    window: FitWindow | None,
    world: int,
) -> None:
    """Take the rebalancer's fits as the normal models of ranks that have been quiet (no open
    event, none ended within a fit window): a fit spanning a slowdown would absorb it. From the
    control loop's kept ``window`` when given (else read whole)."""
    straggling = {e.rank for e in watch.detector.open_events()} | watch.onsets.keys()
    for rank in straggling:
        watch.quiet_since[rank] = through
        if rank in watch.onsets and rank not in watch.normal and window is not None:
            before = rebalancer.fit_before(job, window, rank, watch.onsets[rank])
            if before is not None and before.identifiable and before.model is not None:
                watch.normal[rank] = before.model
                watch.normal_version += 1
    for rank, fit in enumerate(rebalancer.fits(session, job, kept=window, world=world)):
        if rank in straggling or fit is None or not fit.identifiable or fit.model is None:
            continue
        if (
            rank in watch.normal
            and through - watch.quiet_since.get(rank, -rebalancer.FIT_WINDOW)
            < rebalancer.FIT_WINDOW
        ):
            continue
        if watch.normal.get(rank) != fit.model:
            watch.normal[rank] = fit.model
            watch.normal_version += 1


_WATCHES = "evenflow.straggler_watches"
"""``session.info`` key: the watches whose events the session's transaction wrote."""


def _track_commit(session: Session, watch: Watch) -> None:
    """Settle ``watch.unsaved`` when ``session``'s transaction ends (see ``Watch.unsaved``)."""
    watches: dict[int, Watch] | None = session.info.get(_WATCHES)
    if watches is None:
        watches = session.info[_WATCHES] = {}
        event.listen(session, "after_commit", _committed)
        event.listen(session, "after_rollback", _rolled_back)
    watches[id(watch)] = watch


def _committed(session: Session) -> None:
    for w in session.info.pop(_WATCHES, {}).values():
        w.unsaved.clear()
        w.added.clear()


def _rolled_back(session: Session) -> None:
    for w in session.info.pop(_WATCHES, {}).values():
        for key in w.added:
            w.rows.pop(key, None)
        w.added.clear()


def _store(session: Session, job: Job, watch: Watch, updates: list[EventUpdate]) -> None:
    if updates:
        _track_commit(session, watch)
    for u in updates:
        e = u.event
        key = (e.rank, e.start_iteration, e.family.value)
        watch.unsaved[key] = u
        row_id = watch.rows.get(key)
        row = session.get(EventRow, row_id) if row_id is not None else None
        detail = {
            "detected_iteration": e.detected_iteration,
            "confirmed_iteration": e.confirmed_iteration,
            "peak": round(e.peak, 3),
        }
        if u.change is Change.CLOSED:
            # When the detector saw the recovery (the end itself is estimated back in time).
            detail["closed_iteration"] = u.iteration
        if row is None:
            row = EventRow(
                job_id=job.id,
                rank=e.rank,
                kind=e.kind.value,
                severity=e.severity,
                start_iteration=e.start_iteration,
                end_iteration=e.end_iteration,
                action=e.action or "none",
                detail=detail,
            )
            session.add(row)
            session.flush()
            watch.rows[key] = row.id
            watch.added.add(key)
            log.info(
                "job %d: rank %d straggling x%.2f from iteration %d",
                job.id,
                e.rank,
                e.severity,
                e.start_iteration,
            )
        else:
            row.kind, row.severity, row.end_iteration, row.detail = (
                e.kind.value,
                e.severity,
                e.end_iteration,
                detail,
            )
            if u.change is Change.CLOSED:
                log.info(
                    "job %d: rank %d back to normal at iteration %s",
                    job.id,
                    e.rank,
                    e.end_iteration,
                )


def _note_action(session: Session, watch: Watch, decision: Decision) -> None:
    if decision.event is None:
        return
    rank, start = decision.event
    row_id = watch.rows.get((rank, start, StragglerKind.DYNAMIC.value))
    row = session.get(EventRow, row_id) if row_id is not None else None
    if row is not None:
        what = decision.action.value + (f"({decision.rank})" if decision.rank is not None else "")
        row.action = what if row.action in ("", "none") else f"{row.action}, {what}"


def _all_reduce_ms(session: Session, job: Job, through: int, window: int = 20) -> float:
    """The all-reduce's own cost: per iteration the smallest sync time among the ranks in the
    group (the last to arrive waits for nobody), median over the ``window`` iterations up to
    ``through``."""
    T = IterationTelemetry
    rows = session.execute(
        select(T.iteration, func.min(T.sync_ms))
        .where(
            T.job_id == job.id,
            T.iteration > through - window,
            T.iteration <= through,
            T.probe.is_(False),
            T.batch_size > 0,
        )
        .group_by(T.iteration)
    ).all()
    return float(statistics.median(float(ms) for _, ms in rows)) if rows else 0.0


SYNC_NOW_WINDOW = 5
"""Iterations (since the onset of the oldest open event) whose all-reduce is the 'now' of
``_all_reduce_times``: the onset's own iteration is enough, since the ladder may act on it (an
actionable first sample)."""


def _all_reduce_times(
    session: Session, job: Job, health: dict[int, RankHealth], iteration: int
) -> tuple[float, float | None]:
    """(normal all-reduce ms, current over normal or None). Normal: the 20 iterations before the
    oldest open event the ladder acts on (dynamic, or actionable: ``RankHealth.straggling``; the
    last 20 when none is open); now: the last few iterations from that onset on (one at
    least). The ladder uses the ratio instead of assuming that a straggler slows the collective
    as much as its compute (``server.stragglers.candidates``)."""
    starts = [h.event.start_iteration for h in health.values() if h.straggling and h.event]
    if not starts:
        return _all_reduce_ms(session, job, iteration), None
    onset = min(starts)
    normal = _all_reduce_ms(session, job, onset - 1)
    since = iteration - onset + 1  # at least 1: the onset's own iteration
    if normal <= 0:
        return normal, None
    now = _all_reduce_ms(session, job, iteration, window=min(SYNC_NOW_WINDOW, since))
    return normal, now / normal


GLOO_REGROUP_MS = 10.0
"""Making a gloo subgroup, with a margin: a few milliseconds the first time a set of ranks
meets, next to nothing when switching to a known one."""
RESYNC_PER_ALL_REDUCE = 2.0
"""Re-synchronising a readmitted rank sends parameters and optimizer state (momentum: twice the
parameters) from one rank: about twice the bytes a ring all-reduce of the gradients puts on each
link, so about twice its time."""
MIN_RESYNC_MS = 3.0


def ladder_config(
    session: Session, job: Job, all_reduce_ms: float, watch: Watch | None = None
) -> LadderConfig:
    """The ladder's switching costs for this job, from what it runs on and what it measured:
    regrouping costs ``GLOO_REGROUP_MS`` when every device is a CPU (gloo) and the default's
    NCCL-sized figure otherwise (creating a communicator); re-synchronising costs
    ``RESYNC_PER_ALL_REDUCE`` all-reduces, once the all-reduce has been measured. With a
    ``watch``, what the devices are is remembered there while the workers keep their devices."""
    config = LadderConfig()
    regroup = GLOO_REGROUP_MS if _on_gloo(session, job, watch) else config.regroup_ms
    resync = (
        max(MIN_RESYNC_MS, RESYNC_PER_ALL_REDUCE * all_reduce_ms)
        if all_reduce_ms > 0
        else config.resync_ms
    )
    return replace(config, regroup_ms=regroup, resync_ms=resync)


_JOB_DEVICE_KINDS = (
    select(Device.kind)
    .join(Worker, Worker.device_id == Device.id)
    .where(Worker.job_id == bindparam("job_id"))
)


def _on_gloo(session: Session, job: Job, watch: Watch | None) -> bool:
    """Whether every device of the job's workers is a CPU (none: not gloo). One query of the
    devices' kinds alone, once per attempt with a ``watch``: a ``session.get`` per device, or
    the job's workers loaded (log tails too) to list them, would weigh on a large job's sweep."""
    if watch is not None and watch.gloo is not None:
        return watch.gloo
    kinds = [str(k) for k in session.scalars(_JOB_DEVICE_KINDS, {"job_id": job.id})]
    gloo = bool(kinds) and all(k == "cpu" for k in kinds)
    if watch is not None:
        watch.gloo = gloo
    return gloo


def _mitigate(
    session: Session, job: Job, spec: JobSpec, watch: Watch, iteration: int, progress: Progress
) -> int | None:
    """Ask the ladder; store its plan if it makes one. Returns the new plan version."""
    world = progress.world
    if len(watch.normal) < world:
        return None  # models not identified yet: the rebalancer is still exploring
    current = rebalancer.in_force(session, job, progress)
    out = plans.out_of_group(job, current)
    if not out.issuperset(watch.ladder.excluded):
        # An operator's override brought back a rank the ladder had taken out (or it left the
        # job for good): the ladder follows the plan in force rather than re-plan "back".
        kept = tuple(r for r in watch.ladder.excluded if r in out)
        watch.ladder = replace(watch.ladder, excluded=kept)
    pins, excluded = rebalancer.controls(job)
    batches = dict(enumerate(current.batch_sizes))
    cap = spec.max_batch_per_worker
    health = watch.detector.health()
    sync_ms, sync_ratio = _all_reduce_times(session, job, health, iteration)
    views = rank_views(
        watch.normal,
        batches,
        health,
        dict.fromkeys(batches, cap),
        all_reduce_ratio=sync_ratio,
        excluded=set(current.excluded or []),  # out of the all-reduce group now
    )
    situation = Situation(
        iteration=iteration,
        global_batch=spec.global_batch,
        ranks=views,
        granularity=spec.policy.granularity,
        # ranks that left the job for good (``departures``) stay out, as an operator's do
        overrides=Overrides(frozen=job.frozen, pins=pins, excluded=excluded | job.departed),
        remaining_iterations=(spec.iterations - iteration - 1) if spec.iterations else None,
        sync_ms=sync_ms,
    )
    config = ladder_config(session, job, sync_ms, watch)
    if spec.engine == "fsdp" or not spec.policy.exclude:  # (a shard on every rank) re-plan
        config = replace(config, may_exclude=False)
    decision, watch.ladder = decide(situation, watch.ladder, config)
    watch.rested = None
    if decision.new_batch_sizes is None:
        if _idle(watch.ladder, iteration, config):
            watch.rested = (_ladder_inputs(job, watch), iteration)
        return None
    sizes = [decision.new_batch_sizes[r] for r in range(world)]
    group_out = sorted(set(watch.ladder.excluded) - set(excluded))  # plans.create adds departed
    plan = plans.create(
        session,
        job,
        sizes,
        PlanSource.AUTOMATIC,
        f"straggler ladder: {decision.reason}",
        by="stragglers",
        predicted_ms=decision.predicted_ms_after,
        excluded=group_out,
    )
    _note_action(session, watch, decision)
    record(
        session,
        "stragglers",
        f"plan.{decision.action.value}",
        f"job:{job.id}",
        {"version": plan.version, "reason": decision.reason, "rank": decision.rank},
    )
    return plan.version


def _steady(job: Job, watch: Watch, progress: Progress) -> bool:
    """Nothing new for the normal models to learn but more of the same (``REFRESH_STEADY``)."""
    return (
        watch.refreshed_plan is not None
        and watch.refreshed_plan == job.plan_version
        and not watch.stirred
        and len(watch.normal) >= progress.world  # counted by the tracker, not job.workers
        and not watch.detector.open_events()
    )


def _ladder_inputs(job: Job, watch: Watch) -> tuple[object, ...]:
    """What the ladder decides on, but for the detector's view (no open event while it rests)
    and the iteration: the plan in force, the normal models and the operators' overrides."""
    pins, excluded = rebalancer.controls(job)
    return (
        job.plan_version,
        watch.normal_version,
        len(watch.normal),
        job.frozen,
        tuple(sorted(pins.items())),
        excluded,
        job.departed,
    )


def _idle(state: LadderState, iteration: int, config: LadderConfig) -> bool:
    """The ladder has nothing of its own under way: no exclusion to readmit, no event in its
    ledger, no provisional change to confirm or undo, no cool-down running."""
    return (
        not state.excluded
        and not state.ledger
        and state.provisional is None
        and (
            state.last_change is None or iteration >= state.last_change + config.cooldown_iterations
        )
    )


def _ladder_rests(job: Job, watch: Watch, iteration: int) -> bool:
    """Whether the ladder can be left out this round: it held last time with nothing under way,
    no event is open, and neither the plan, the normal models nor the overrides changed since;
    asked again at least every ``REFRESH_EVERY`` iterations all the same (the all-reduce time
    and the baseline levels it also prices with drift slowly). Pricing every candidate plan of
    a settled job every round would be most of its round; detection still sees every
    iteration."""
    rested = watch.rested
    return (
        rested is not None
        and iteration - rested[1] < REFRESH_EVERY
        and rested[0] == _ladder_inputs(job, watch)
        and not watch.detector.open_events()
    )


@dataclass(frozen=True)
class Detected:
    """What a sweep's detection fed the detector (``detect``), for the rest of the watch's
    sweep (``follow_up``)."""

    complete: int
    """The last iteration fed: every rank has reported it."""
    updates: list[EventUpdate]
    """The events it opened, changed or closed (stored already)."""


def resume(session: Session, job: Job) -> Watch:
    """A new watch of ``job`` that knows the job's events stored open: those of the watch a
    controller kept before this one (it failed, or was stopped, and this one took over).

    Started blank, a taken-over watch stored a slowdown still under way as a second event, and
    neither ever closed: its detector, first fed a window that held the slowdown, had no model
    of the rank's normal speed and judged the rank against its own slow times. Now the stored
    event's row is the one the detector's updates go to (an event is its rank and onset), and
    before the first feed each such rank's normal model is fitted on its iterations before the
    onset (``_refresh_normal``), the others' on the window, as the old watch had them."""
    watch = Watch()
    rows = session.execute(
        select(EventRow.id, EventRow.rank, EventRow.start_iteration).where(
            EventRow.job_id == job.id, EventRow.end_iteration.is_(None)
        )
    ).all()
    for row_id, rank, start in rows:
        if rank is None:
            continue
        watch.rows[(rank, start, StragglerKind.DYNAMIC.value)] = row_id
        watch.onsets[rank] = min(start, watch.onsets.get(rank, start))
    return watch


def detect(
    session: Session,
    job: Job,
    watch: Watch,
    progress: Progress,
    window: FitWindow | None = None,
) -> Detected | None:
    """Feed the detector the iterations every rank has reported since (``Watch.add`` kept them;
    later rows wait in ``watch.pending``) and store the events it opens, changes or closes.
    The first part of a job's watch in a sweep: it reads nothing a rebalance could change (the
    rows were posted under plans made before), so the control loop runs it before the
    rebalancer's decision, and an event is stored in the sweep that has the slow iterations
    whatever else the sweep does (a young job's exploring plan included), not a sweep later.
    None when nothing new was fed."""
    if watch.unsaved and id(watch) not in session.info.get(_WATCHES, {}):  # one rolled back
        _store(session, job, watch, list(watch.unsaved.values()))
    if progress.complete_through is None:
        return None
    timings = _take(session, job, watch, progress.complete_through)
    if not timings:
        return None
    complete = timings[-1][0]
    if watch.onsets:  # a taken-over watch: its normal models first (``resume``)
        _refresh_normal(session, job, watch, complete, window, progress.world)
        watch.onsets = {}
    updates = watch.detector.observe_iterations(timings, watch.normal or None)
    watch.fed_through = complete
    _store(session, job, watch, updates)
    watch.stirred = watch.stirred or bool(updates)
    return Detected(complete, updates)


def follow_up(
    session: Session,
    job: Job,
    watch: Watch,
    progress: Progress,
    detected: Detected,
    *,
    mitigate: bool,
    window: FitWindow | None = None,
) -> int | None:
    """The rest of a job's watch once ``detect`` fed it: refresh the normal models on their
    cadence and, with ``mitigate`` (an ``adaptive`` job whose models the rebalancer has
    identified), ask the ladder. ``window``: the job's fit window as the control loop keeps
    it, for the normal models. Returns the version of a plan the ladder made."""
    spec = job.job_spec
    complete, updates = detected.complete, detected.updates
    # caught up: ``_take`` feeds at most ``MAX_TIMINGS_PER_ROUND`` timings a sweep
    caught_up = progress.complete_through is None or complete >= progress.complete_through
    since = complete - watch.refreshed_through
    if (
        caught_up
        and since >= REFRESH_EVERY
        and (since >= REFRESH_STEADY or not _steady(job, watch, progress))
    ):
        _refresh_normal(session, job, watch, complete, window, progress.world)
        watch.refreshed_through = complete
        seen = progress.effective_from is not None and (
            complete - progress.effective_from >= rebalancer.HALF_LIFE
        )
        watch.refreshed_plan = job.plan_version if seen else None
        watch.stirred = False
    if mitigate and spec.policy.name is PolicyName.ADAPTIVE:
        if not updates and _ladder_rests(job, watch, complete):
            return None
        return _mitigate(session, job, spec, watch, complete, progress)
    return None
