"""The rebalancing loop: telemetry -> per-worker model fits -> a new plan when it pays.

The decision itself is pure (``server.planner.rebalance.decide``); this module gathers its
inputs from the database, applies the cadence and stores what it decides, with the reason.

Cadence. A plan takes effect at the first iteration any rank reports with its version. Once
every rank has reported ``K`` iterations under it (``explore_iterations`` while some worker is
not identified yet, ``rebalance_every`` after), the job is due for another decision. The first
decision, away from the initial split (made before anything was measured), comes sooner: after
``FIRST_LOOK`` iterations, or ``explore_iterations`` if fewer; one guess per worker is all the
first exploration plan needs, and every iteration on the blind split costs up to the slowest
worker's share of the imbalance (on ``bench/stragglers.py``'s workers, 1.7x the optimum).
Frozen jobs and the ``equal`` policy are never re-planned automatically.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from sqlalchemy import Row, bindparam, func, select
from sqlalchemy.orm import Session

from contract.enums import PlanSource, PolicyName
from server.models import IterationTelemetry, Job, Plan, Worker
from server.planner import ModelFit, Observation, fit_model
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


@dataclass
class Tracker:
    """A job's progress, kept up to date from the telemetry rows added since the last look
    (by id), so a control-loop round costs what is new, not the job's whole history.

    On PostgreSQL ids are handed out before commit, so a row can become visible after rows with
    larger ids: the last ``reread`` ids are read again (max and min are idempotent)."""

    last_id: int = 0
    reread: int = 0
    max_iteration: dict[int, int] = field(default_factory=dict)
    """rank -> newest iteration reported outside probes."""
    first_of_version: dict[int, int] = field(default_factory=dict)
    """plan version -> first iteration any rank reported with it."""
    ooms: list[tuple[int, int, int]] = field(default_factory=list)
    """(rank, iteration, pass size) of out-of-memory reports not handled yet."""
    oom_seen: set[tuple[int, int]] = field(default_factory=set)
    excluded: tuple[int | None, frozenset[int]] = (None, frozenset())
    """``(plan version, its ranks out of the all-reduce group)``: plans never change once
    made, so a round reads them only when the job has a new one."""
    world: int | None = None
    """The job's number of ranks, counted once: an attempt keeps its ranks (one that leaves
    stays listed, ``departed``), and a restart starts a new tracker. Loading the workers to
    count them was a tenth of a steady sweep (256 entities per round for a 256-rank job)."""

    def update(self, session: Session, job: Job) -> Progress:
        T = IterationTelemetry
        if session.get_bind().dialect.name == "postgresql":
            self.reread = 5000
        new = select(T.id, T.rank, T.iteration, T.plan_version, T.probe, T.oom_batch).where(
            T.job_id == job.id, T.id > self.last_id - self.reread
        )
        if self.last_id == 0:  # a fresh tracker: history older than the window is rolled up
            self.first_of_version.update(retention.first_iteration_of_versions(session, job.id))
        rows = session.connection().execute(new).all()  # Core rows: no ORM loading per row
        for row_id, rank, iteration, version, probe, oom in rows:
            self.last_id = max(self.last_id, int(row_id))
            if oom is not None and (rank, iteration) not in self.oom_seen:
                self.oom_seen.add((rank, iteration))  # re-read rows are not reported twice
                self.ooms.append((int(rank), int(iteration), int(oom)))
            if not probe:
                self.max_iteration[rank] = max(self.max_iteration.get(rank, -1), int(iteration))
            first = self.first_of_version.get(version)
            if first is None or iteration < first:
                self.first_of_version[version] = int(iteration)
        return self.progress(session, job)

    def progress(self, session: Session, job: Job) -> Progress:
        """Ranks out of the all-reduce group under the plan in force (they only probe now and
        then) do not hold ``complete_through`` back."""
        if job.plan_version and self.excluded[0] != job.plan_version:
            out = session.scalar(_EXCLUDED, {"job_id": job.id, "version": job.plan_version})
            self.excluded = (job.plan_version, frozenset(int(r) for r in out or []))
        excluded = self.excluded[1] if job.plan_version else frozenset()
        if self.world is None:
            self.world = session.scalar(_WORLD, {"job_id": job.id}) or 0
        active = [r for r in range(self.world) if r not in excluded]
        seen = self.max_iteration
        complete = (
            min(seen[r] for r in active) if active and all(r in seen for r in active) else None
        )
        effective = self.first_of_version.get(job.plan_version) if job.plan_version else None
        return Progress(effective, complete)


_WORLD = select(func.count(Worker.id)).where(Worker.job_id == bindparam("job_id"))
_EXCLUDED = select(Plan.excluded).where(
    Plan.job_id == bindparam("job_id"), Plan.version == bindparam("version")
)


def fits(
    session: Session, job: Job, *, window: int = FIT_WINDOW, kept: FitWindow | None = None
) -> list[ModelFit | None]:
    """A fitted model per rank from the recent window (None for a rank never seen with samples).
    ``kept``: the job's window as the last decision left it, brought up to date with the rows
    added since (the control loop's); without it the window is read whole."""
    by_rank = (
        kept.read(session, job, window) if kept is not None else observed(session, job, window)
    )
    spec = job.job_spec
    return [
        fit_model(
            by_rank[r],
            half_life_iterations=HALF_LIFE,
            max_batch=spec.max_batch_per_worker,
            granularity=spec.policy.granularity,
        )
        if by_rank.get(r)
        else None
        for r in range(len(job.workers))
    ]


def observed(session: Session, job: Job, window: int = FIT_WINDOW) -> dict[int, list[Observation]]:
    """Per rank, the observations of the job's recent window (``window`` iterations back from
    the newest reported), read whole."""
    T = IterationTelemetry
    last = session.scalar(select(func.max(T.iteration)).where(T.job_id == job.id))
    by_rank: dict[int, list[Observation]] = defaultdict(list)
    if last is not None:
        rows = (
            session.connection()
            .execute(_ROWS.where(T.job_id == job.id, T.iteration > last - window))
            .all()
        )
        for _, rank, obs in _converted(session, job, rows):
            by_rank[rank].append(obs)
    return by_rank


_ROWS = select(
    IterationTelemetry.id,
    IterationTelemetry.rank,
    IterationTelemetry.iteration,
    IterationTelemetry.batch_size,
    IterationTelemetry.compute_ms,
    IterationTelemetry.plan_version,
    IterationTelemetry.probe,
    IterationTelemetry.pass_size,
)
"""What an observation is made of (Core rows: no ORM loading per row)."""
_Row = Row[int, int, int, int, float, int, bool, int | None]


def _converted(
    session: Session, job: Job, rows: Sequence[_Row]
) -> Iterator[tuple[int, int, Observation]]:
    """(row id, rank, observation as the single-pass model sees it) of rows with samples."""
    caps = memory.caps_by_version(session, job.id) if rows else {}
    for row_id, rank, iteration, batch, compute, version, probe, pass_size in rows:
        if batch <= 0:
            continue
        cap = pass_size or (
            None if probe or not caps else _cap_in(caps.get(int(version)), int(rank))
        )
        if not cap or batch <= cap:  # ``_one_pass``'s own case, without the call per row
            yield int(row_id), int(rank), Observation(int(batch), float(compute), int(iteration))
        else:
            yield int(row_id), int(rank), _one_pass(int(batch), float(compute), int(iteration), cap)


@dataclass
class FitWindow:
    """The observations of a job's recent window (``FIT_WINDOW`` iterations back from the
    newest reported), kept between its decisions so that each reads only the rows added since
    the last. An exploring job decides every ``explore_iterations`` (10) iterations, a
    ``minmax`` one every ``rebalance_every`` (20), and each decision read its whole window
    again: 200 iterations x ranks rows, the controller's largest cost in the fleet bench (38%
    of its samples).

    On PostgreSQL ids are handed out before commit, so a row can become visible after rows
    with larger ids: the last ``reread`` ids are read again, as ``Tracker`` does, and a row
    read twice is taken once (``seen``)."""

    last_id: int = 0
    newest: int | None = None
    """The newest iteration of any row read (the window ends there)."""
    rows: dict[int, tuple[int, Observation]] = field(default_factory=dict)
    """Row id -> (rank, its observation), in id order."""
    seen: set[int] = field(default_factory=set)
    """Ids of the rows read within the ``reread`` margin: a row read again is not taken again
    (rows without samples and rows already out of the window are not in ``rows``)."""

    def read(self, session: Session, job: Job, window: int) -> dict[int, list[Observation]]:
        """``observed(session, job, window)``, from the rows added since the last read."""
        T = IterationTelemetry
        reread = 5000 if session.get_bind().dialect.name == "postgresql" else 0
        if self.last_id == 0:  # the first read: the window, not the job's whole history
            last = session.scalar(select(func.max(T.iteration)).where(T.job_id == job.id))
            if last is None:
                return {}
            query = _ROWS.where(T.job_id == job.id, T.iteration > last - window)
        else:
            query = _ROWS.where(T.job_id == job.id, T.id > self.last_id - reread)
        fresh = [r for r in session.connection().execute(query).all() if r[0] not in self.seen]
        if fresh:
            late = min(r[0] for r in fresh) < self.last_id
            self.last_id = max(self.last_id, max(int(r[0]) for r in fresh))
            self.seen.update(int(r[0]) for r in fresh)
            self.seen = {i for i in self.seen if i > self.last_id - reread}
            newest = max(int(r[2]) for r in fresh)
            self.newest = newest if self.newest is None else max(self.newest, newest)
            self.rows.update((i, (rank, obs)) for i, rank, obs in _converted(session, job, fresh))
            cutoff = self.newest - window
            ordered = sorted(self.rows.items()) if late else self.rows.items()
            self.rows = {i: ro for i, ro in ordered if ro[1].iteration > cutoff}
        by_rank: dict[int, list[Observation]] = defaultdict(list)
        for rank, obs in self.rows.values():
            by_rank[rank].append(obs)
        return by_rank


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
) -> RebalanceDecision:
    """What the rebalancer would do now (nothing is stored). ``pins``/``excluded`` replace the
    job's standing controls, for previews of an override (which then says which ranks stay
    out of the all-reduce group); without them, ranks out of the group under the plan in
    force stay out (``plans.out_of_group``). ``kept``: the job's fit window as the control
    loop keeps it (``fits``)."""
    spec = job.job_spec
    current = plans.current(session, job.id)
    standing_pins, standing_excluded = controls(job)
    if excluded is None:
        standing_excluded |= plans.out_of_group(job, current)
    policy = SOLVER[spec.policy.name]
    return decide(
        RebalanceInput(
            global_batch=spec.global_batch,
            current=tuple(current.batch_sizes),
            fits=tuple(fits(session, job, kept=kept)),
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
                memory.caps(session, job), standing_pins if pins is None else pins
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
