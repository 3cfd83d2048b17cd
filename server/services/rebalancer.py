"""The rebalancing loop: telemetry -> per-worker model fits -> a new plan when it pays.

The decision itself is pure (``server.planner.rebalance.decide``); this module gathers its
inputs from the database, applies the cadence and stores what it decides, with the reason.

Cadence. A plan takes effect at the first iteration any rank reports with its version. Once
every rank has reported ``K`` iterations under it (``explore_iterations`` while some worker is
not identified yet, ``rebalance_every`` after), the job is due for another decision. The first
decision, away from the initial split (made before anything was measured), comes sooner: after
``FIRST_LOOK`` iterations, or ``explore_iterations`` if fewer; one guess per worker is all the
first exploration plan needs, and every iteration on the blind split costs up to the slowest
worker's share of the imbalance.
Frozen jobs and the ``equal`` policy are never re-planned automatically.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import countOf, itemgetter
from typing import Any

import numpy as np
import numpy.typing as npt
from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import Session

from contract.enums import PlanSource, PolicyName
from server.db import driver_rows
from server.models import IterationTelemetry, Job, Plan, Worker
from server.planner import ModelFit, Observation, fit_model
from server.planner.fit import fit_arrays
from server.planner.rebalance import RebalanceDecision, RebalanceInput, decide
from server.services import memory, plans, retention

SOLVER = {
    PolicyName.EQUAL: "equal",
    PolicyName.PROPORTIONAL: "proportional",
    PolicyName.MINMAX: "minmax",
    PolicyName.STATIC: "minmax",
    PolicyName.ADAPTIVE: "minmax",
}
"""The planner policy each job policy solves with."""

SETTLED_AFTER_WARMUP = frozenset({PolicyName.STATIC, PolicyName.ADAPTIVE})
"""Policies the rebalancer plans for only until the models are identified: ``static`` keeps
that plan, ``adaptive`` hands over to the straggler ladder (``server.services.stragglers``)."""

FIRST_LOOK = 3
"""Iterations of the initial split every rank reports before the first decision: the median of
three is a per-sample guess that one slow first iteration (warm-up, lazy initialisation) cannot
move."""

FIT_WINDOW = 200
"""Iterations of history a fit looks at."""
HALF_LIFE = 50.0
"""Recency half-life of a fit, in iterations."""


@dataclass(frozen=True)
class Progress:
    """Where a job's workers are, from its telemetry."""

    effective_from: int | None
    """First iteration reported under the plan in force (None: no rank has used it yet)."""
    complete_through: int | None
    """Last iteration every rank has reported."""
    world: int
    """The job's number of ranks, as its tracker counted them (``Tracker.world``)."""
    plan: Plan | None
    """The plan in force as the tracker last read it (``Tracker.plan``; plans never change
    once made); None: the job has none yet."""


REREAD_IDS = 5000
"""On PostgreSQL ids are handed out before commit, so a row can become visible after rows with
larger ids: readers by id look this many ids back again (``NewRows``). Every telemetry insert
holds a lock to its commit that keeps ids committing in order across processes and servers
(``telemetry._PG_ID_ORDER``); the margin stays for rows written without it (a server of an
earlier version beside this one during a rolling upgrade)."""

_NEW = select(
    IterationTelemetry.id,
    IterationTelemetry.rank,
    IterationTelemetry.iteration,
    IterationTelemetry.plan_version,
    IterationTelemetry.probe,
    IterationTelemetry.oom_batch,
    IterationTelemetry.batch_size,
    IterationTelemetry.compute_ms,
    IterationTelemetry.pass_size,
    IterationTelemetry.peak_memory_mb,
)
"""A new row as the control loop's readers take it (plain driver tuples: ``db.driver_rows``)."""
NewRow = tuple[int, int, int, int, bool, int | None, int, float, int | None, float | None]
_NEW_SINCE_ITERATION = _NEW.where(
    IterationTelemetry.job_id == bindparam("job_id"),
    IterationTelemetry.iteration > bindparam("after"),
)
_NEW_SINCE_ID = _NEW.where(
    IterationTelemetry.job_id == bindparam("job_id"), IterationTelemetry.id > bindparam("after")
)


FIRST_READ_ITERATIONS = 300
"""A job's first read (a controller starting, or taking over from another) covers its last this
many iterations: the fit window (``FIT_WINDOW``), the memory window (``memory.WINDOW``) and the
straggler watch's replay (``stragglers.REPLAY``), not the raw history a retention window keeps
(20,000 iterations a job, by default), so a takeover reads what it needs and no more."""


Ints = npt.NDArray[np.int64]
Floats = npt.NDArray[np.float64]


class NewColumns:
    """A sweep's new rows (``NewRows``) as columns, built once for the tracker, the fit window
    and the straggler watch, which take them as arrays: row by row in Python, the three would
    spend much of the controller's time on work that is the same for every row. The nullable
    columns (an out-of-memory report, a pass size, a peak) are mostly empty, and are looked at
    row by row only where they are not."""

    __slots__ = ("batch", "compute", "iteration", "probe", "rank", "rows", "version")

    def __init__(self, rows: Sequence[NewRow]) -> None:
        self.rows = rows
        self.rank: Ints = self._column(1, np.int64)
        self.iteration: Ints = self._column(2, np.int64)
        self.version: Ints = self._column(3, np.int64)
        self.probe: npt.NDArray[np.bool_] = self._column(4, np.bool_)
        self.batch: Ints = self._column(6, np.int64)
        self.compute: Floats = self._column(7, np.float64)

    def _column(self, i: int, dtype: Any) -> Any:
        # a column at a time from the rows, in C: faster than transposing them with zip(*rows)
        return np.fromiter(map(itemgetter(i), self.rows), dtype=dtype, count=len(self.rows))

    def __len__(self) -> int:
        return len(self.rows)

    def _empty(self, column: int) -> bool:
        return countOf(map(itemgetter(column), self.rows), None) == len(self.rows)

    def ooms(self) -> list[tuple[int, int, int]]:
        """``(rank, iteration, pass size)`` of the rows that report running out of memory."""
        if self._empty(5):
            return []
        return [(r[1], r[2], r[5]) for r in self.rows if r[5] is not None]

    def pass_sizes(self) -> Ints | None:
        """Each row's pass size, 0 where it has none; None when no row has one."""
        if self._empty(8):
            return None
        return np.fromiter((r[8] or 0 for r in self.rows), dtype=np.int64, count=len(self.rows))

    def memory_rows(self) -> list[tuple[int, memory.MemoryRow]]:
        """``(iteration, memory row)`` of the rows that measured a peak or ran out of memory
        (``memory.KeptMemory``)."""
        if self._empty(5) and self._empty(9):
            return []
        return [
            (r[2], (r[1], r[3], r[6], r[9], bool(r[4]), r[8], r[5]))
            for r in self.rows
            if r[5] is not None or (r[9] is not None and r[6] > 0)
        ]


@dataclass
class NewRows:
    """A job's telemetry rows added since the last look, by id. The control loop reads them
    once per sweep and hands them to the tracker, the fit window and the straggler watch, so
    the same rows are read once, not three times. The first read is the job's last
    ``FIRST_READ_ITERATIONS``.

    On PostgreSQL the last ``REREAD_IDS`` ids are read again (``REREAD_IDS``), and a row read
    again is not handed out again (``seen``)."""

    last_id: int = 0
    seen: set[int] = field(default_factory=set)
    """Ids handed out within the re-read margin."""
    after: int = -1
    """The iteration the first read started after: rows of older iterations that the re-read
    margin meets later were not handed out then and are not now."""

    def read(self, session: Session, job: Job) -> list[NewRow]:
        T = IterationTelemetry
        reread = REREAD_IDS if session.get_bind().dialect.name == "postgresql" else 0
        if self.last_id == 0:
            newest = session.scalar(select(func.max(T.iteration)).where(T.job_id == job.id))
            if newest is None:
                return []
            self.after = newest - FIRST_READ_ITERATIONS
            query, after = _NEW_SINCE_ITERATION, self.after
        else:
            query, after = _NEW_SINCE_ID, self.last_id - reread
        rows: list[NewRow] = driver_rows(session, query, {"job_id": job.id, "after": after})
        if reread:
            rows = [r for r in rows if r[0] not in self.seen and r[2] > self.after]
        if rows:
            self.last_id = max(self.last_id, max(r[0] for r in rows))
            if reread:
                floor = self.last_id - reread
                self.seen = {i for i in self.seen if i > floor}
                self.seen.update(r[0] for r in rows if r[0] > floor)
        return rows


def _last_by_key(keys: Ints, values: Ints) -> Iterator[tuple[int, int]]:
    """``(key, largest value)`` of each distinct key, keys ascending."""
    if not len(keys):
        return iter(())
    order = np.lexsort((values, keys))
    k, v = keys[order], values[order]
    last = np.flatnonzero(np.append(k[1:] != k[:-1], True))
    return zip(k[last].tolist(), v[last].tolist(), strict=True)


def _first_by_key(keys: Ints, values: Ints) -> Iterator[tuple[int, int]]:
    """``(key, smallest value)`` of each distinct key, keys ascending."""
    if not len(keys):
        return iter(())
    order = np.lexsort((values, keys))
    k, v = keys[order], values[order]
    first = np.flatnonzero(np.insert(k[1:] != k[:-1], 0, True))
    return zip(k[first].tolist(), v[first].tolist(), strict=True)


@dataclass
class Tracker:
    """A job's progress, kept up to date from the telemetry rows added since the last look
    (``NewRows``), so a control-loop round costs what is new, not the job's whole history."""

    started: bool = False
    """Whether the tracker has taken in rows (the first time it also learns when the job's plans
    took effect from its rolled-up history)."""
    max_iteration: dict[int, int] = field(default_factory=dict)
    """rank -> newest iteration reported outside probes."""
    first_of_version: dict[int, int] = field(default_factory=dict)
    """plan version -> first iteration any rank reported with it (rolled-up history included;
    a version in force since before a fresh tracker's first read, ``FIRST_READ_ITERATIONS``
    back, counts from there: a fresh control loop decides after ``FIRST_LOOK`` in any case)."""
    ooms: list[tuple[int, int, int]] = field(default_factory=list)
    """(rank, iteration, pass size) of out-of-memory reports not handled yet."""
    plan: Plan | None = None
    """The plan in force, read when the job has a new one (plans never change once made): a
    round needs its sizes and the ranks it keeps out of the all-reduce group, not read again
    (``plans.current``: two queries) every sweep."""
    world: int | None = None
    """The job's number of ranks, counted once: an attempt keeps its ranks (one that leaves
    stays listed, ``departed``), and a restart starts a new tracker, so a steady sweep does not
    load the workers to count them."""

    def absorb(
        self,
        session: Session,
        job: Job,
        rows: Sequence[NewRow],
        columns: NewColumns | None = None,
    ) -> Progress:
        """Take in rows not taken before (``NewRows``; ``columns``: the same as columns, when
        the caller has them); the job's progress."""
        if not self.started:  # history older than the raw window is rolled up
            self.first_of_version.update(retention.first_iteration_of_versions(session, job.id))
            self.started = True
        if rows:
            cols = columns if columns is not None else NewColumns(rows)
            # (job, rank, iteration) is unique, and NewRows hands a row out once
            self.ooms += cols.ooms()
            seen, firsts = self.max_iteration, self.first_of_version
            counted = ~cols.probe
            for rank, newest in _last_by_key(cols.rank[counted], cols.iteration[counted]):
                if seen.get(rank, -1) < newest:
                    seen[rank] = newest
            for version, oldest in _first_by_key(cols.version, cols.iteration):
                first = firsts.get(version)
                if first is None or oldest < first:
                    firsts[version] = oldest
        return self.progress(session, job)

    def progress(self, session: Session, job: Job) -> Progress:
        """Ranks out of the all-reduce group under the plan in force (they only probe now and
        then) do not hold ``complete_through`` back."""
        if not job.plan_version:
            self.plan = None
        elif self.plan is None or self.plan.version != job.plan_version:
            self.plan = session.scalars(
                _PLAN, {"job_id": job.id, "version": job.plan_version}
            ).one_or_none()
            if self.plan is not None:
                # kept across rounds, so out of this session: were it rolled back, the plan
                # would be expired in it, and detached it could not be read again
                session.expunge(self.plan)
        excluded = frozenset(int(r) for r in self.plan.excluded or []) if self.plan else frozenset()
        if self.world is None:
            self.world = session.scalar(_WORLD, {"job_id": job.id}) or 0
        active = [r for r in range(self.world) if r not in excluded]
        seen = self.max_iteration
        complete = (
            min(seen[r] for r in active) if active and all(r in seen for r in active) else None
        )
        effective = self.first_of_version.get(job.plan_version) if job.plan_version else None
        return Progress(effective, complete, self.world, self.plan)


_WORLD = select(func.count(Worker.id)).where(Worker.job_id == bindparam("job_id"))
_PLAN = select(Plan).where(Plan.job_id == bindparam("job_id"), Plan.version == bindparam("version"))


def fits(
    session: Session,
    job: Job,
    *,
    window: int = FIT_WINDOW,
    kept: FitWindow | None = None,
    world: int | None = None,
) -> list[ModelFit | None]:
    """A fitted model per rank from the recent window (None for a rank never seen with samples).
    ``kept``: the job's window as the control loop keeps it up to date (``FitWindow.add``);
    without it the window is read whole. ``world``: the job's number of ranks, if known
    (``Progress.world``), else its workers are loaded to count them."""
    spec = job.job_spec
    world = len(job.workers) if world is None else world
    key = (world, spec.max_batch_per_worker, spec.policy.granularity)
    if kept is not None and kept.fitted is not None and kept.fitted[0] == key:
        return list(kept.fitted[1])
    options: dict[str, Any] = {
        "half_life_iterations": HALF_LIFE,
        "max_batch": spec.max_batch_per_worker,
        "granularity": spec.policy.granularity,
    }
    if kept is not None:
        columns = kept.by_rank()
        made = [fit_arrays(*columns[r], **options) if r in columns else None for r in range(world)]
    else:
        by_rank = observed(session, job, window)
        made = [fit_model(by_rank[r], **options) if by_rank.get(r) else None for r in range(world)]
    if kept is not None:
        kept.fitted = (key, made)
    return list(made)


def fit_before(job: Job, kept: FitWindow, rank: int, iteration: int) -> ModelFit | None:
    """``rank``'s model fitted as ``fits`` fits it, on the kept window's iterations before
    ``iteration`` alone: its speed before a slowdown that began there. None without any."""
    columns = kept.by_rank().get(rank)
    if columns is None:
        return None
    batch, compute, iterations = columns
    before = iterations < iteration
    if not before.any():
        return None
    spec = job.job_spec
    return fit_arrays(
        batch[before],
        compute[before],
        iterations[before],
        half_life_iterations=HALF_LIFE,
        max_batch=spec.max_batch_per_worker,
        granularity=spec.policy.granularity,
    )


def observed(session: Session, job: Job, window: int = FIT_WINDOW) -> dict[int, list[Observation]]:
    """Per rank, the observations of the job's recent window (``window`` iterations back from
    the newest reported), read whole."""
    T = IterationTelemetry
    last = session.scalar(select(func.max(T.iteration)).where(T.job_id == job.id))
    by_rank: dict[int, list[Observation]] = defaultdict(list)
    if last is not None:
        rows = driver_rows(
            session, _NEW_SINCE_ITERATION, {"job_id": job.id, "after": last - window}
        )
        caps = memory.caps_by_version(session, job.id) if rows else {}
        for rank, obs in _converted(rows, caps):
            by_rank[rank].append(obs)
    return by_rank


def _converted(
    rows: Iterable[NewRow], caps: dict[int, list[int | None]]
) -> Iterator[tuple[int, Observation]]:
    """(rank, observation as the single-pass model sees it) of rows with samples; ``caps`` are
    the memory caps of the plans they ran under, by version. The driver's values as they are
    (ints and floats: ``db.driver_rows``), no conversion per value."""
    for _, rank, iteration, version, probe, _, batch, compute, pass_size, _ in rows:
        if batch <= 0:
            continue
        cap = pass_size or (None if probe or not caps else _cap_in(caps.get(version), rank))
        if not cap or batch <= cap:  # ``_one_pass``'s own case, without the call per row
            yield rank, Observation(batch, compute, iteration)
        else:
            yield rank, _one_pass(batch, compute, iteration, cap)


def _no_ints() -> Ints:
    return np.empty(0, dtype=np.int64)


def _no_floats() -> Floats:
    return np.empty(0, dtype=np.float64)


@dataclass
class FitWindow:
    """The observations of a job's recent window (``FIT_WINDOW`` iterations back from the
    newest reported), kept up to date from the rows the control loop reads each sweep
    (``NewRows``), for the rebalancer's decisions and the straggler watch's normal models.
    Kept, not read whole for each decision and each refresh of the normal models, so each row
    is read and converted once.

    Kept as columns, in the order the rows came (``NewColumns``, not an ``Observation`` per row,
    which costs far more); per rank, in iteration order (a row that turns up late, on
    PostgreSQL, takes its place after those of its iteration), as ``observed`` reads them."""

    newest: int | None = None
    """The newest iteration of any row taken (the window ends there)."""
    rank: Ints = field(default_factory=_no_ints)
    batch: Ints = field(default_factory=_no_ints)
    """Each observation's batch size as the single-pass model sees it (``_one_pass``)."""
    compute: Floats = field(default_factory=_no_floats)
    iteration: Ints = field(default_factory=_no_ints)
    caps: dict[int, list[int | None] | None] = field(default_factory=dict)
    """The memory caps of the plan versions met so far (None: none); plans never change."""
    memory: memory.KeptMemory = field(default_factory=memory.KeptMemory)
    """The window's rows that measured a peak or ran out of memory (``memory.caps``)."""
    fitted: tuple[tuple[int, int | None, int], list[ModelFit | None]] | None = None
    """``fits`` of the window as it is, with what they were made for (ranks, cap,
    granularity): a sweep that both decides (``propose``) and refreshes the straggler watch's
    normal models fits each rank once. Dropped when rows come in."""
    _grouped: dict[int, tuple[Ints, Floats, Ints]] | None = None
    """``by_rank`` of the window as it is (dropped when rows come in)."""

    def add(
        self,
        session: Session,
        job: Job,
        rows: Sequence[NewRow],
        window: int,
        columns: NewColumns | None = None,
    ) -> None:
        """Take in rows not taken before (``NewRows``; ``columns``: the same as columns) and
        let the oldest leave."""
        if not rows:
            return
        cols = columns if columns is not None else NewColumns(rows)
        self.fitted = self._grouped = None
        newest = int(cols.iteration.max())
        self.newest = newest if self.newest is None else max(self.newest, newest)
        cutoff = self.newest - window
        versions = set(np.unique(cols.version).tolist()) - set(self.caps)
        if versions:
            known = memory.caps_by_version(session, job.id)
            self.caps.update({v: known.get(v) for v in versions})
        fresh = (cols.iteration > cutoff) & (cols.batch > 0)
        batch, compute = _one_passes(cols, fresh, self.plan_caps())
        kept = self.iteration > cutoff
        if not kept.all():
            self.rank, self.batch = self.rank[kept], self.batch[kept]
            self.compute, self.iteration = self.compute[kept], self.iteration[kept]
        self.rank = np.concatenate((self.rank, cols.rank[fresh]))
        self.batch = np.concatenate((self.batch, batch))
        self.compute = np.concatenate((self.compute, compute))
        self.iteration = np.concatenate((self.iteration, cols.iteration[fresh]))
        self.memory.add(cols.memory_rows(), self.newest)

    def plan_caps(self) -> dict[int, list[int | None]]:
        """The memory caps of the plan versions met so far, by version (plans with caps)."""
        return {v: c for v, c in self.caps.items() if c}

    def by_rank(self) -> dict[int, tuple[Ints, Floats, Ints]]:
        """Per rank with observations, its ``(batch sizes, compute ms, iterations)`` in
        iteration order (of one iteration, in the order they came: a stable sort)."""
        if self._grouped is None:
            order = np.lexsort((self.iteration, self.rank))
            ranks = self.rank[order]
            cuts = np.flatnonzero(ranks[1:] != ranks[:-1]) + 1
            starts = [0, *cuts.tolist()]
            ends = [*cuts.tolist(), len(order)]
            batch, compute, iteration = (
                self.batch[order],
                self.compute[order],
                self.iteration[order],
            )
            self._grouped = {
                int(ranks[a]): (batch[a:b], compute[a:b], iteration[a:b])
                for a, b in zip(starts, ends, strict=True)
                if b > a
            }
        return self._grouped

    def observations(self) -> dict[int, list[Observation]]:
        """Per rank, the window's observations (ranks with some)."""
        return {
            rank: [
                Observation(b, c, i)
                for b, c, i in zip(x.tolist(), y.tolist(), its.tolist(), strict=True)
            ]
            for rank, (x, y, its) in self.by_rank().items()
        }


def _one_passes(
    cols: NewColumns, fresh: npt.NDArray[np.bool_], caps: dict[int, list[int | None]]
) -> tuple[Ints, Floats]:
    """``(batch, compute ms)`` of the ``fresh`` rows as the single-pass model sees them
    (``_one_pass``, with ``_converted``'s caps: the row's pass size, else its plan's cap for
    the rank unless it is a probe), as arrays."""
    batch, compute = cols.batch[fresh], cols.compute[fresh]
    sizes = cols.pass_sizes()
    cap = np.zeros(len(batch), dtype=np.int64) if sizes is None else sizes[fresh]
    if caps:
        planned = (cap == 0) & ~cols.probe[fresh]
        if planned.any():
            version, rank = cols.version[fresh], cols.rank[fresh]
            for v, of_ranks in caps.items():
                rows = planned & (version == v)
                if rows.any():
                    table = np.array([c or 0 for c in of_ranks], dtype=np.int64)
                    r = rank[rows]
                    inside = r < len(table)
                    cap[rows] = np.where(inside, table[np.where(inside, r, 0)], 0)
    split = (cap > 0) & (batch > cap)
    if not split.any():
        return batch, compute
    b, c = batch[split], cap[split]
    k = -(-b // c)
    batch, compute = batch.copy(), compute.copy()
    batch[split] = np.maximum(1, np.round(b / k)).astype(np.int64)
    compute[split] = compute[split] / k
    return batch, compute


def _cap_in(caps: list[int | None] | None, rank: int) -> int | None:
    return caps[rank] if caps and rank < len(caps) else None


def _one_pass(batch: int, compute_ms: float, iteration: int, cap: int | None) -> Observation:
    """An iteration that ran ``k`` accumulated passes took ``k c + s b``: as an observation of
    the single-pass model it is one pass of ``b / k`` samples in ``compute / k`` (exact on the
    linear part), so intercepts are not counted twice when the planner adds the passes."""
    if not cap or batch <= cap:
        return Observation(batch, compute_ms, iteration)
    k = -(-batch // cap)
    return Observation(max(1, round(batch / k)), compute_ms / k, iteration)


def in_force(session: Session, job: Job, progress: Progress | None = None) -> Plan:
    """The job's plan in force: the one ``progress`` carries when it is still that
    (``Tracker.plan``), else read (``plans.current``)."""
    known = progress.plan if progress is not None else None
    if known is not None and known.version == job.plan_version:
        return known
    return plans.current(session, job.id)


def controls(job: Job) -> tuple[dict[int, int], frozenset[int]]:
    c = job.controls or {}
    pins = {int(r): int(b) for r, b in (c.get("pins") or {}).items()}
    return pins, frozenset(int(r) for r in c.get("excluded") or [])


def propose(
    session: Session,
    job: Job,
    *,
    force: bool = False,
    current_from_guesses: bool = False,
    pins: dict[int, int] | None = None,
    excluded: frozenset[int] | None = None,
    kept: FitWindow | None = None,
    progress: Progress | None = None,
) -> RebalanceDecision:
    """What the rebalancer would do now (nothing is stored). ``pins``/``excluded`` replace the
    job's standing controls, for previews of an override (which then says which ranks stay
    out of the all-reduce group); without them, ranks out of the group under the plan in
    force stay out (``plans.out_of_group``). ``kept``: the job's fit window as the control
    loop keeps it (``fits``); ``progress``: the job's progress as its tracker knows it (the
    plan in force and the number of ranks, read already)."""
    spec = job.job_spec
    current = in_force(session, job, progress)
    world = progress.world if progress is not None else None
    standing_pins, standing_excluded = controls(job)
    if excluded is None:
        standing_excluded |= plans.out_of_group(job, current)
    policy = SOLVER[spec.policy.name]
    return decide(
        RebalanceInput(
            global_batch=spec.global_batch,
            current=tuple(current.batch_sizes),
            fits=tuple(fits(session, job, kept=kept, world=world)),
            policy=policy,
            granularity=spec.policy.granularity,
            max_batch=spec.max_batch_per_worker,
            pins=standing_pins if pins is None else pins,
            # ranks that left the job for good are out whatever the controls say
            excluded=(standing_excluded if excluded is None else excluded) | job.departed,
            min_gain=spec.policy.min_gain,
            force=force,
            current_from_guesses=current_from_guesses,
            memory_caps=_caps_or_empty(
                memory.caps(session, job)
                if kept is None
                else memory.caps(session, job, kept.memory, kept.plan_caps()),
                standing_pins if pins is None else pins,
            ),
            current_caps=tuple(current.memory_caps or ()),
        )
    )


def _caps_or_empty(caps: tuple[int | None, ...], pins: dict[int, int]) -> tuple[int | None, ...]:
    """The caps to plan with: none at all when no rank has one. A pinned rank whose memory
    fits not one sample keeps its pin (an operator's decision wins; the rank runs passes of
    one and fails the job only if even those do not fit)."""
    caps = tuple(1 if c == 0 and r in pins and pins[r] else c for r, c in enumerate(caps))
    return caps if any(c is not None for c in caps) else ()


def apply(
    session: Session,
    job: Job,
    decision: RebalanceDecision,
    source: PlanSource,
    *,
    by: str,
    reason: str | None = None,
) -> int | None:
    """Store the decision's plan, if it has one; returns the new version. Ranks out of the
    all-reduce group under the plan in force stay out (``propose`` gave them no samples)."""
    if decision.batch_sizes is None:
        return None
    sizes = list(decision.batch_sizes)
    out = plans.out_of_group(job, plans.current(session, job.id))
    plan = plans.create(
        session,
        job,
        sizes,
        source,
        reason or decision.reason,
        by=by,
        predicted_ms=decision.predicted_ms,
        excluded=[r for r in sorted(out) if r < len(sizes) and sizes[r] == 0],
        memory_caps=list(decision.memory_caps) or None,
    )
    return plan.version


@dataclass
class LastDecision:
    through: int
    """The last iteration every rank had reported when the decision was made."""
    exploring: bool


def due(job: Job, last: LastDecision | None, p: Progress) -> Progress | None:
    """The job's progress if it is due for a decision: every rank has run ``K`` iterations since
    the plan in force took effect and since the last decision (``FIRST_LOOK`` before the first
    decision, ``explore_iterations`` while models are still being identified, ``rebalance_every``
    after)."""
    spec = job.job_spec
    if job.frozen or spec.policy.name is PolicyName.EQUAL or job.plan_version is None:
        return None
    if p.effective_from is None or p.complete_through is None:
        return None
    exploring = last is None or last.exploring
    if not exploring and spec.policy.name in SETTLED_AFTER_WARMUP:
        return None
    cadence = max(1, spec.policy.explore_iterations if exploring else spec.policy.rebalance_every)
    if last is None:
        cadence = min(cadence, FIRST_LOOK)
    since = p.effective_from if last is None else max(p.effective_from, last.through + 1)
    return p if p.complete_through - since + 1 >= cadence else None
