"""The plans each rung of the mitigation ladder would switch to, and their predicted time.

Effective model. Rank i runs at ``ratio_i`` times its model's time (the detector's measured level
while it straggles, 1 otherwise), so its effective model is the model with every term scaled::

    t'_i(b) = ratio_i * model_i.predict(b)

This is the cheap refit the issue asks for: on the recent window, a straggler's measured
ratio times its model is the best estimate of its current speed, and it stays identifiable with
a single batch size. The predicted iteration time of batch sizes ``b`` with the all-reduce group
G (every rank not excluded) is ::

    T(b, G) = max_i t'_i(b_i) + sync_ms * max_{i in G} sync_ratio_i

A rank with 0 samples computes nothing, but while it stays in the group it still takes part in
the all-reduce. ``sync_ratio_i`` is how many times slower the collective runs because of rank i:
measured where the caller can (the group's all-reduce now over its normal time, attributed to
its straggling members, at most their compute ratio; see ``rank_views``), else assumed equal to
its compute ratio (its GPU runs the reduction kernels, its links carry the ring). What exclusion
buys over a plan that merely gives the straggler 0 samples is exactly that slowdown of the
collective, so it is measured rather than assumed whenever the all-reduce times are known: a
straggler slowed by contention for its compute does not always slow the ring. With
``sync_ms = 0`` the model is compute only.

Every candidate keeps the invariants: batch sizes sum exactly to B, stay within
``[min_batch, max_batch]`` on multiples of the granularity, operators' pins are kept, and
excluded ranks (by operators or by the ladder) get 0. ``respects`` checks exactly that.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from server.planner import Infeasible, PerfModel, PlanProblem, WorkerSpec, solve


@dataclass(frozen=True)
class Overrides:
    """Operators' overrides; they always win over the ladder."""

    frozen: bool = False
    """No automatic action at all (events are still reported)."""
    pins: Mapping[int, int] = field(default_factory=dict)
    """rank -> batch size it must keep."""
    excluded: frozenset[int] = frozenset()
    """Ranks kept out of the all-reduce group (batch 0) until an operator readmits them."""


@dataclass(frozen=True)
class RankView:
    """One rank as the ladder sees it."""

    rank: int
    model: PerfModel
    """Its normal-speed model (the one the detector measures ratios against)."""
    batch_size: int
    """Its batch size in the current plan."""
    ratio: float = 1.0
    """Measured / predicted time now (1 for a rank that is not straggling)."""
    straggling: bool = False
    """In a confirmed DYNAMIC event, or an actionable unconfirmed one (``provisional``)."""
    event_start: int | None = None
    """Onset of its open event, when straggling."""
    provisional: bool = False
    """Straggling on an event that is not confirmed yet (actionable: see ``changepoint``)."""
    max_batch: int | None = None
    min_batch: int = 0
    sync_ratio: float | None = None
    """How many times slower the all-reduce runs with this rank in the group, as measured;
    None: assumed to be ``ratio``."""


@dataclass(frozen=True)
class Situation:
    """Everything the ladder decides from, at the end of one iteration."""

    iteration: int
    global_batch: int
    ranks: tuple[RankView, ...]
    granularity: int = 1
    overrides: Overrides = Overrides()
    remaining_iterations: int | None = None
    """Iterations left in the job when known; bounds every horizon."""
    sync_ms: float = 0.0
    """Normal all-reduce time of one iteration (the group's, at normal speeds)."""

    def __post_init__(self) -> None:
        if not isinstance(self.ranks, tuple):
            object.__setattr__(self, "ranks", tuple(self.ranks))
        seen = [r.rank for r in self.ranks]
        if len(set(seen)) != len(seen):
            raise ValueError("Situation.ranks lists a rank twice")

    @property
    def batches(self) -> dict[int, int]:
        return {r.rank: r.batch_size for r in self.ranks}


def effective(view: RankView) -> PerfModel:
    """The rank's model scaled by its measured ratio."""
    m, f = view.model, view.ratio
    return PerfModel(m.per_sample_ms * f, m.intercept_ms * f, m.floor_ms * f)


def predicted_times(situation: Situation, batches: Mapping[int, int]) -> dict[int, float]:
    return {r.rank: effective(r).predict(batches[r.rank]) for r in situation.ranks}


def makespan(
    situation: Situation, batches: Mapping[int, int], excluded: Collection[int] = ()
) -> float:
    """Predicted iteration time ``T(b, G)`` at the ranks' current speeds (module docstring)."""
    compute = max(predicted_times(situation, batches).values())
    group = [
        r.ratio if r.sync_ratio is None else r.sync_ratio
        for r in situation.ranks
        if r.rank not in excluded
    ]
    return compute + situation.sync_ms * max(group, default=1.0)


def respects(situation: Situation, batches: Mapping[int, int], excluded: Collection[int]) -> bool:
    """Whether ``batches`` keeps every invariant (sum, bounds, granularity, pins, exclusions)."""
    if set(batches) != {r.rank for r in situation.ranks}:
        return False
    if sum(batches.values()) != situation.global_batch:
        return False
    pins = situation.overrides.pins
    for r in situation.ranks:
        b = batches[r.rank]
        if b < 0 or b % situation.granularity:
            return False
        if r.rank in excluded:
            if b != 0:
                return False
            continue
        if r.rank in pins and b != pins[r.rank]:
            return False
        if b < r.min_batch or (r.max_batch is not None and b > r.max_batch):
            return False
    return True


def floor(situation: Situation, view: RankView) -> int:
    """The least batch a rank in the group may be given: its ``min_batch``, and one granule for
    a straggling rank. A straggler planned down to 0 samples would never be measured again, so
    its recovery could not be seen; taking it off the critical path altogether is exclusion,
    which leaves the group and probes its speed off it."""
    return max(view.min_batch, situation.granularity if view.straggling else 0)


def replan(situation: Situation, excluded: Collection[int]) -> dict[int, int] | None:
    """The exact min-max plan for the effective models; None when infeasible."""
    pins = situation.overrides.pins
    workers = []
    for r in situation.ranks:
        out = r.rank in excluded
        workers.append(
            WorkerSpec(
                str(r.rank),
                effective(r),
                min_batch=0 if out else floor(situation, r),
                max_batch=r.max_batch,
                pinned_batch=0 if out else pins.get(r.rank),
            )
        )
    try:
        plan = solve(PlanProblem(situation.global_batch, tuple(workers), situation.granularity))
    except Infeasible:
        return None
    return {int(k): v for k, v in plan.batch_sizes.items()}


def _cap(view: RankView) -> float:
    return math.inf if view.max_batch is None else view.max_batch


def fine_tune(
    situation: Situation, excluded: Collection[int], max_samples: int
) -> dict[int, int] | None:
    """Move up to ``max_samples`` samples, a granule at a time, from the slowest rank to the
    fastest rank with room, while that lowers the predicted iteration time.

    Pinned and excluded ranks neither give nor take. None when no move helps.
    """
    g = situation.granularity
    fixed = set(excluded) | set(situation.overrides.pins)
    views = {r.rank: r for r in situation.ranks}
    models = {r.rank: effective(r) for r in situation.ranks}
    batches = dict(situation.batches)
    moved = 0
    while moved + g <= max_samples:
        times = {k: models[k].predict(b) for k, b in batches.items()}
        free = [k for k in batches if k not in fixed]
        givers = [k for k in free if batches[k] - g >= floor(situation, views[k])]
        if not givers:
            break
        slow = max(givers, key=lambda k: (times[k], -k))
        if times[slow] < max(times.values()):
            break  # the slowest rank is pinned: moving others cannot help
        takers = [k for k in free if k != slow and batches[k] + g <= _cap(views[k])]
        if not takers:
            break
        fast = min(takers, key=lambda k: (models[k].predict(batches[k] + g), k))
        if models[fast].predict(batches[fast] + g) >= times[slow]:
            break  # the receiver would become the new slowest: no gain
        batches[slow] -= g
        batches[fast] += g
        moved += g
    return batches if moved else None
