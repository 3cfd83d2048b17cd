"""Whether and how to change a running job's plan, from its workers' fitted models. Pure.

Each round the rebalancer service gathers the job's fits (``ModelFit`` per rank), the plan in
force and the operator's controls, and asks ``decide`` for a new plan or a reason not to make one:

- Models. An identifiable fit is used as it is. A worker seen at only one batch size has no
  slope/intercept yet; its labelled through-origin ``guess`` stands in, and the round is an
  *exploration*. A worker never seen with samples borrows the median guess of the others.
- Exploration. Planning on guesses already moves most workers to a new batch size, which is
  what identifies them. A worker whose planned size equals the only size it was seen at is
  nudged by about 20% (a multiple of the granularity, within its bounds), the difference taken
  from or given to the other workers with room, so the sum stays exactly B. When only stuck
  workers have room (all of one GPU model), they take each other's difference, in pairs.
- Gain. Outside exploration a plan is issued only if it predicts at least ``min_gain`` less
  iteration time than the plan in force *under the same models*, or when forced ("rebalance
  now", an operator's pin or exclusion), or when the plan in force was made on guesses. Operators' pins and exclusions are constraints of the
  problem, so no plan ever breaks them.
- Memory. Each rank's memory cap (most samples per pass, or None) bounds its passes: a share
  above it runs as accumulated passes, which the time model counts (``predict_accumulated``).
  When the caps change so that a share in force no longer fits one pass under its new cap, a new
  plan is issued whatever the gain: the workers learn their caps only from a plan.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from server.planner.fit import ModelFit
from server.planner.model import PerfModel, predict_accumulated
from server.planner.policies import solve
from server.planner.problem import PlanProblem, WorkerSpec

EXPLORE_STEP = 0.2


@dataclass(frozen=True)
class RebalanceInput:
    global_batch: int
    current: tuple[int, ...]
    """The batch size of every rank in the plan in force."""
    fits: tuple[ModelFit | None, ...]
    """Per rank; None when the rank has no observation with samples."""
    policy: str = "minmax"
    granularity: int = 1
    max_batch: int | None = None
    pins: Mapping[int, int] = field(default_factory=dict)
    """rank -> batch size fixed by an operator."""
    excluded: frozenset[int] = frozenset()
    """Ranks an operator took out of compute: they get 0 samples."""
    min_gain: float = 0.03
    force: bool = False
    current_from_guesses: bool = False
    """The plan in force was made while exploring: replace it once the models are identified,
    whatever the gain (it was never meant to stay)."""
    memory_caps: tuple[int | None, ...] = ()
    """Per rank, the most samples one pass may hold (None: no cap); empty: no caps at all."""
    current_caps: tuple[int | None, ...] = ()
    """The caps the plan in force carries."""


@dataclass(frozen=True)
class RebalanceDecision:
    batch_sizes: tuple[int, ...] | None
    """The new plan, or None to keep the one in force."""
    reason: str
    predicted_ms: float | None
    """Predicted iteration time (compute makespan) of the new plan, or of the kept one."""
    current_predicted_ms: float | None
    exploring: bool
    models: tuple[PerfModel, ...]
    """The model used for each rank (fitted, or a labelled guess while exploring)."""
    memory_caps: tuple[int | None, ...] = ()
    """The caps the plan was made under (to store with it)."""


def _models(fits: Sequence[ModelFit | None]) -> tuple[tuple[PerfModel, ...], list[int]]:
    """A model per rank, and the ranks that are not identified yet."""
    guesses = [m for f in fits if f is not None for m in (f.model or f.guess,) if m is not None]
    fallback = (
        PerfModel(statistics.median(g.per_sample_ms for g in guesses))
        if guesses
        else PerfModel(1.0)
    )
    models: list[PerfModel] = []
    unidentified: list[int] = []
    for rank, fit in enumerate(fits):
        if fit is not None and fit.identifiable and fit.model is not None:
            models.append(fit.model)
            continue
        unidentified.append(rank)
        models.append(fit.guess if fit is not None and fit.guess is not None else fallback)
    return tuple(models), unidentified


def makespan(
    models: Sequence[PerfModel], sizes: Sequence[int], caps: Sequence[int | None] = ()
) -> float:
    """Predicted iteration compute time: the slowest rank, extra passes above a cap counted."""
    capped = list(caps) or [None] * len(sizes)
    return max(
        (predict_accumulated(m, b, c) for m, b, c in zip(models, sizes, capped, strict=True)),
        default=0.0,
    )


def caps_outgrown(inp: RebalanceInput) -> bool:
    """A share in force exceeds its rank's new cap where the plan in force set no such cap."""
    old = list(inp.current_caps) or [None] * len(inp.current)
    return any(
        new is not None and b > new and (was is None or was > new)
        for b, new, was in zip(inp.current, inp.memory_caps, old, strict=True)
    )


def _bounds(inp: RebalanceInput, rank: int) -> tuple[int, int]:
    if rank in inp.excluded:
        return 0, 0
    if rank in inp.pins:
        return inp.pins[rank], inp.pins[rank]
    cap = inp.max_batch if inp.max_batch is not None else inp.global_batch
    return 0, cap // inp.granularity * inp.granularity


def _nudge_bounds(inp: RebalanceInput, rank: int) -> tuple[int, int]:
    """A nudge's bounds: the rank's own, and its memory cap (exploring never adds a pass)."""
    lo, hi = _bounds(inp, rank)
    cap = inp.memory_caps[rank] if rank < len(inp.memory_caps) else None
    if cap is not None and lo < cap < hi:
        hi = cap // inp.granularity * inp.granularity
    return lo, max(lo, hi)


def _nudge(inp: RebalanceInput, sizes: list[int], stuck: list[int]) -> list[int]:
    """Move each stuck rank ~20% off its only observed size, keeping the sum and all bounds.

    The difference is taken from (or given to) the ranks that are not stuck, largest first.
    What they cannot take goes to the next stuck ranks still at their size, which moves them
    off it too. A job whose ranks are all alike (one GPU model: the plan on guesses gives every
    rank the same size, so every rank is stuck) explores in pairs, one rank up and the next
    down; with nothing but stuck ranks to take from, none could move, and the job explored,
    and re-fitted every rank, at every cadence for ever without identifying a model."""
    g = inp.granularity
    out = list(sizes)
    held = set(stuck)
    free = [r for r in range(len(out)) if r not in held]  # in rank order: ties go to the lowest
    later = 0  # stuck ranks before stuck[later] have moved, or had no room to take anything
    for i, rank in enumerate(stuck):
        if out[rank] != sizes[rank]:
            continue  # moved off its size already, taking another's difference
        lo, hi = _nudge_bounds(inp, rank)
        if lo == hi:
            continue
        step = max(g, round(EXPLORE_STEP * max(out[rank], g) / g) * g)
        # Grow if there is room, else shrink; take the difference from the others with room.
        delta = step if out[rank] + step <= hi else -min(step, out[rank] - lo)
        if delta == 0:
            continue
        remaining = _spread(inp, out, sorted(free, key=lambda r: -out[r]), delta)
        if remaining:
            later = max(later, i + 1)
            while remaining and later < len(stuck):
                other = stuck[later]
                later += 1
                if out[other] == sizes[other]:
                    remaining = _spread(inp, out, (other,), remaining)
        out[rank] += delta - remaining
    return out


def _spread(inp: RebalanceInput, out: list[int], others: Sequence[int], delta: int) -> int:
    """Take ``delta`` samples from ``others`` in order (give, when negative), within their
    nudge bounds; returns what they could not take."""
    g = inp.granularity
    remaining = delta
    for other in others:
        olo, ohi = _nudge_bounds(inp, other)
        room = out[other] - olo if remaining > 0 else ohi - out[other]
        take = min(abs(remaining), room // g * g)
        if take <= 0:
            continue
        out[other] -= take if remaining > 0 else -take
        remaining -= take if remaining > 0 else -take
        if remaining == 0:
            break
    return remaining


def decide(inp: RebalanceInput) -> RebalanceDecision:
    """The plan to switch to, or why the plan in force stays (see the module docstring)."""
    models, unidentified = _models(inp.fits)
    caps = inp.memory_caps or (None,) * len(models)
    current_ms = makespan(models, inp.current, caps)
    outgrown = bool(inp.memory_caps) and caps_outgrown(inp)
    problem = PlanProblem(
        global_batch=inp.global_batch,
        granularity=inp.granularity,
        workers=tuple(
            WorkerSpec(
                id=str(rank),
                model=model,
                min_batch=_bounds(inp, rank)[0],
                max_batch=_bounds(inp, rank)[1],
                pinned_batch=_bounds(inp, rank)[0]
                if rank in inp.pins or rank in inp.excluded
                else None,
                micro_batch=caps[rank],
            )
            for rank, model in enumerate(models)
        ),
    )
    plan = solve(problem, inp.policy)
    sizes = plan.batch_list
    exploring = bool(unidentified)
    if exploring:
        stuck = [r for r in unidentified if sizes[r] == inp.current[r]]
        sizes = _nudge(inp, sizes, stuck)
    new_ms = makespan(models, sizes, caps)
    stored = inp.memory_caps
    if tuple(sizes) == tuple(inp.current) and not outgrown:
        return RebalanceDecision(
            None,
            "the plan in force is already the best for the measured models",
            current_ms,
            current_ms,
            exploring,
            models,
            stored,
        )
    if exploring:
        ranks = ", ".join(str(r) for r in unidentified)
        reason = f"exploring: rank(s) {ranks} seen at one batch size; planned on guesses, nudged to identify"
        return RebalanceDecision(tuple(sizes), reason, new_ms, current_ms, True, models, stored)
    gain = (current_ms - new_ms) / current_ms if current_ms > 0 else 0.0
    if not (inp.force or inp.current_from_guesses or outgrown) and gain < inp.min_gain:
        return RebalanceDecision(
            None,
            f"predicted gain {gain:.1%} is below the {inp.min_gain:.1%} threshold",
            current_ms,
            current_ms,
            False,
            models,
            stored,
        )
    reason = (
        f"{inp.policy}: predicted {new_ms:.1f} ms per iteration, "
        f"{gain:.1%} less than {current_ms:.1f} ms under the measured models"
    )
    if outgrown:
        reason += "; memory caps changed: " + ", ".join(
            f"rank {r} at most {c} per pass" for r, c in enumerate(caps) if c is not None
        )
    return RebalanceDecision(tuple(sizes), reason, new_ms, current_ms, False, models, stored)
