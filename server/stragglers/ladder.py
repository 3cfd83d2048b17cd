"""The mitigation ladder: given the detector's view, decide whether and how to change the plan.

Rungs, from the cheapest to the most disruptive::

    none        keep the plan
    fine_tune   move a few samples from the slowest rank to the fastest one with room
    replan      exact min-max plan for the effective models (straggler's model x its ratio)
    exclude(r)  rank r leaves the all-reduce group (batch 0); the others take its samples
    readmit(r)  a rank the ladder excluded comes back, and the plan includes it again

Cost comparison. For each candidate a with predicted iteration time ``T_a`` (``candidates``) and
the current plan's ``T_0``, over an expected remaining horizon of H iterations::

    saving(a) = H * (T_0 - T_a) - switch(a)
    switch(plan change) = plan_change_iterations * T_0            (~1 iteration to switch)
    switch(exclude)     = plan change + regroup_ms + (regroup_ms + resync_ms)   (leave, and the
                          expected return later, when the rank will need its parameters again)
    switch(readmit)     = plan change + regroup_ms + resync_ms

A candidate is taken only when its saving exceeds ``hysteresis * H * T_0``; among those, the
largest saving wins, except that a lower rung within that same margin of the best is preferred
(smaller changes first). Readmission is compared with staying excluded the same way.

Horizon. Straggler episodes last from tens of seconds to hours (Alibaba's production figures),
a heavy-tailed distribution, for which the expected remaining life grows with the age: H is the
age of the event the candidate reacts to (iterations since onset), clamped to
``[horizon_min, horizon_max]``. With no event open (restoring the plan after a recovery) H is
``idle_horizon``. Every horizon is bounded by the iterations left in the job when known.

Stability. Nothing happens while operators froze the job; no plan change within
``cooldown_iterations`` of the last; the dead band skips everything (but readmission) when even a
full re-plan would gain less than ``dead_band`` of the iteration time; and each event gets at most
``max_changes_per_event`` plan changes (its first reaction included; a readmission is always
allowed, since a rank must not stay out for good). A transient (unconfirmed) event changes
nothing, unless actionable: the detector reports a rank as straggling once its event is DYNAMIC,
or while it is unconfirmed but severe (every sample 1.75x or more: see ``changepoint``).

Provisional changes. A change that reacts to an unconfirmed event is provisional: should that
event close before it is confirmed (a spike, a false alarm), the plan that restores the normal
speeds may be made at once instead of after the cool-down. Otherwise a one-sample spike would
leave a plan biased against a healthy rank in force for ``cooldown_iterations``.

Overrides win: pinned ranks keep their pin, operator-excluded ranks stay at 0 and are never
readmitted by the ladder, and a plan that already breaks an override is replaced at once.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from server.planner import PerfModel
from server.stragglers.candidates import (
    RankView,
    Situation,
    fine_tune,
    makespan,
    predicted_times,
    replan,
    respects,
)
from server.stragglers.detector import RankHealth
from server.stragglers.timing import imbalance


class Action(StrEnum):
    NONE = "none"
    FINE_TUNE = "fine_tune"
    REPLAN = "replan"
    EXCLUDE = "exclude"
    READMIT = "readmit"


RUNG = {Action.FINE_TUNE: 1, Action.REPLAN: 2, Action.READMIT: 2, Action.EXCLUDE: 3}


@dataclass(frozen=True)
class LadderConfig:
    dead_band: float = 0.05
    """Do nothing when a full re-plan would gain less than this fraction of the iteration time."""
    hysteresis: float = 0.03
    """An action must save at least this fraction of the horizon's predicted time."""
    cooldown_iterations: int = 10
    plan_change_iterations: float = 1.0
    """Switching plans costs about this many iterations of the current plan."""
    regroup_ms: float = 2000.0
    """Cost of changing the all-reduce group (leaving or joining). The default is sized for
    NCCL (a new communicator); the server passes gloo's ~10 ms for CPU jobs
    (``server.services.stragglers.ladder_config``)."""
    resync_ms: float = 500.0
    """Cost of re-synchronising a readmitted rank's parameters (and optimizer state); the
    server passes about two measured all-reduces once it has measured one."""
    exclude_min_ratio: float = 2.0
    """Only a rank at least this many times slower than its model may be excluded."""
    may_exclude: bool = True
    """Whether a rank may leave the all-reduce group at all: not in a sharded (fsdp) job, where
    every rank holds a shard and joins every layer's collectives; the ladder re-plans there."""
    fine_tune_fraction: float = 0.05
    """Fine-tuning moves at most this fraction of the global batch."""
    horizon_min: int = 10
    horizon_max: int = 1000
    idle_horizon: int = 1000
    max_changes_per_event: int = 3

    def __post_init__(self) -> None:
        for name in ("dead_band", "hysteresis", "regroup_ms", "resync_ms", "fine_tune_fraction"):
            if getattr(self, name) < 0:
                raise ValueError(f"LadderConfig.{name} must be >= 0")
        if self.plan_change_iterations < 0 or self.cooldown_iterations < 0:
            raise ValueError("LadderConfig cool-down and switching cost must be >= 0")
        if not 1 <= self.horizon_min <= self.horizon_max or self.idle_horizon < 1:
            raise ValueError("LadderConfig horizons must satisfy 1 <= horizon_min <= horizon_max")
        if self.max_changes_per_event < 1 or self.exclude_min_ratio < 1:
            raise ValueError("LadderConfig.max_changes_per_event and exclude_min_ratio >= 1")


@dataclass(frozen=True)
class Candidate:
    """One alternative the ladder weighed."""

    action: Action
    rank: int | None
    batch_sizes: Mapping[int, int]
    predicted_ms: float
    switch_ms: float
    horizon: int
    saving_ms: float
    """``horizon * (T_0 - predicted_ms) - switch_ms``: positive means worth it, before the
    hysteresis margin."""
    event: tuple[int, int] | None


@dataclass(frozen=True)
class Decision:
    """What the ladder decided at one iteration, and why."""

    action: Action
    reason: str
    new_batch_sizes: Mapping[int, int] | None
    """The plan to switch to at the next iteration boundary; None when the plan stays."""
    predicted_ms_before: float
    predicted_ms_after: float
    rank: int | None = None
    """The rank excluded or readmitted."""
    event: tuple[int, int] | None = None
    """``(rank, start_iteration)`` of the event this reacts to, when one."""
    horizon: int = 0
    imbalance: float = 0.0
    """Predicted ``(max - min) / mean`` of the current plan at the current speeds."""
    candidates: tuple[Candidate, ...] = ()

    @property
    def changes_plan(self) -> bool:
        return self.new_batch_sizes is not None


@dataclass(frozen=True)
class EventLedger:
    """Plan changes charged to one event; kept until a while after the event closed."""

    rank: int
    start: int
    changes: int = 0
    closed_at: int | None = None


@dataclass(frozen=True)
class LadderState:
    """The ladder's memory between decisions; plain data."""

    last_change: int | None = None
    excluded: tuple[int, ...] = ()
    """Ranks the ladder (not an operator) excluded."""
    ledger: tuple[EventLedger, ...] = ()
    provisional: tuple[int, int] | None = None
    """``(rank, start)`` of the unconfirmed event the last change reacted to, until that event
    is confirmed or the change is undone (module docstring)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "last_change": self.last_change,
            "excluded": list(self.excluded),
            "ledger": [vars(e).copy() for e in self.ledger],
            "provisional": list(self.provisional) if self.provisional else None,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LadderState:
        p = data.get("provisional")
        return cls(
            last_change=data.get("last_change"),
            excluded=tuple(int(r) for r in data.get("excluded", ())),
            ledger=tuple(EventLedger(**e) for e in data.get("ledger", ())),
            provisional=(int(p[0]), int(p[1])) if p else None,
        )


def rank_views(
    models: Mapping[int, PerfModel],
    batches: Mapping[int, int],
    health: Mapping[int, RankHealth],
    max_batch: Mapping[int, int | None] | None = None,
    min_batch: Mapping[int, int] | None = None,
    *,
    all_reduce_ratio: float | None = None,
    excluded: Collection[int] = (),
) -> tuple[RankView, ...]:
    """``RankView`` of every rank in ``batches`` from the detector's ``health``.

    A straggling rank runs at its measured ratio; every other rank at its model (ratio 1):
    keeping the models right is the planner's refit, not the straggler ladder's job.

    ``all_reduce_ratio`` is the current group's all-reduce time over its normal one, when the
    caller measured it; it becomes the ``sync_ratio`` of every straggling rank in the group
    (``excluded`` are not), clamped to ``[1, ratio]``. Without it, or for ranks out of the
    group, the ladder assumes a straggler slows the all-reduce by its compute ratio.
    """
    views = []
    for rank in sorted(batches):
        h = health.get(rank)
        straggling = h is not None and h.straggling
        ratio = h.ratio if h is not None and straggling else 1.0
        sync_ratio = None
        if straggling and all_reduce_ratio is not None and rank not in excluded:
            sync_ratio = min(ratio, max(1.0, all_reduce_ratio))
        views.append(
            RankView(
                rank=rank,
                model=models[rank],
                batch_size=batches[rank],
                ratio=ratio,
                straggling=straggling,
                event_start=h.event.start_iteration if h and h.event and straggling else None,
                provisional=h is not None and h.actionable,  # straggling, not confirmed yet
                max_batch=(max_batch or {}).get(rank),
                min_batch=(min_batch or {}).get(rank, 0),
                sync_ratio=sync_ratio,
            )
        )
    return tuple(views)


def _ledger(situation: Situation, state: LadderState, config: LadderConfig) -> list[EventLedger]:
    """Open a ledger entry per straggling event; mark closed ones; forget settled ones."""
    now = situation.iteration
    live = {(r.rank, r.event_start) for r in situation.ranks if r.event_start is not None}
    out: list[EventLedger] = []
    for e in state.ledger:
        if (e.rank, e.start) in live:
            out.append(replace(e, closed_at=None))
        elif e.closed_at is None:
            out.append(replace(e, closed_at=now))
        elif now - e.closed_at <= 3 * config.cooldown_iterations + 1 or e.rank in state.excluded:
            out.append(e)
    known = {(e.rank, e.start) for e in out}
    out += [EventLedger(rank, start) for rank, start in sorted(live - known)]
    return out


def _horizon(situation: Situation, event: tuple[int, int] | None, config: LadderConfig) -> int:
    if event is None:
        h = config.idle_horizon
    else:
        age = situation.iteration - event[1] + 1
        h = min(config.horizon_max, max(config.horizon_min, age))
    if situation.remaining_iterations is not None:
        h = min(h, max(1, situation.remaining_iterations))
    return h


def decide(
    situation: Situation, state: LadderState, config: LadderConfig | None = None
) -> tuple[Decision, LadderState]:
    """The ladder's decision at the end of ``situation.iteration`` and its next state.

    Pure: the same inputs give the same decision. The caller applies ``new_batch_sizes`` (and the
    group change of an exclusion or readmission) at the next iteration boundary.
    """
    config = config or LadderConfig()
    state, excluded = _settle_exclusions(situation, state, config)
    current = situation.batches
    before = makespan(situation, current, excluded)
    imb = imbalance(predicted_times(situation, current).values())

    def hold(reason: str, cands: tuple[Candidate, ...] = ()) -> tuple[Decision, LadderState]:
        return (
            Decision(Action.NONE, reason, None, before, before, imbalance=imb, candidates=cands),
            state,
        )

    if situation.overrides.frozen:
        return hold("frozen by an operator")
    if not respects(situation, current, excluded):
        fixed = replan(situation, excluded)
        if fixed is None:
            return hold("the current plan breaks an override, and no plan can keep them all")
        decision = Decision(
            Action.REPLAN,
            "the current plan breaks an operator's override",
            fixed,
            before,
            makespan(situation, fixed, excluded),
            imbalance=imb,
        )
        return decision, replace(state, last_change=situation.iteration)
    state, ready = _cooldown(situation, state, config)
    if ready is not None:
        return hold(f"cool-down until iteration {ready}")
    candidates = _candidates(situation, state, config, excluded, before)
    chosen = _choose(candidates, before, config)
    if isinstance(chosen, str):
        return hold(chosen, tuple(candidates))
    return _apply(situation, state, chosen, before, imb, tuple(candidates))


def _settle_exclusions(
    situation: Situation, state: LadderState, config: LadderConfig
) -> tuple[LadderState, set[int]]:
    """The state with the ladder's exclusions that still hold and its ledger brought up to
    date, and every rank out of the group (the operators' and the ladder's)."""
    ov = situation.overrides
    # A pin above 0 overrides a ladder exclusion; operator exclusions are the operators' own.
    ladder_out = tuple(r for r in state.excluded if ov.pins.get(r, 0) == 0 and r not in ov.excluded)
    ledger = _ledger(situation, replace(state, excluded=ladder_out), config)
    state = replace(state, excluded=ladder_out, ledger=tuple(ledger))
    return state, set(ov.excluded) | set(ladder_out)


def _cooldown(
    situation: Situation, state: LadderState, config: LadderConfig
) -> tuple[LadderState, int | None]:
    """The state (a confirmed provisional change now stands as any other) and the iteration the
    cool-down ends at, or None when a change may be made now (no cool-down, or a provisional
    change whose event closed unconfirmed, which is undone at once)."""
    false_alarm = False
    if state.provisional is not None:
        rank, start = state.provisional
        view = next((r for r in situation.ranks if r.rank == rank), None)
        if view is None or view.event_start != start:
            false_alarm = True  # the event closed unconfirmed: undo at once
        elif not view.provisional:  # confirmed: the change stands, as any other
            state = replace(state, provisional=None)
    if state.last_change is not None and not false_alarm:
        ready = state.last_change + config.cooldown_iterations
        if situation.iteration < ready:
            return state, ready
    return state, None


def _choose(candidates: list[Candidate], before: float, config: LadderConfig) -> Candidate | str:
    """The candidate worth taking (module docstring: hysteresis, lower rungs first), or why
    none is."""
    margin_of = {id(c): config.hysteresis * c.horizon * before for c in candidates}
    worth = [c for c in candidates if c.saving_ms > margin_of[id(c)]]
    if not worth:
        full = next((c for c in candidates if c.action is Action.REPLAN), None)
        gain = (before - full.predicted_ms) / before if full and before > 0 else 0.0
        if gain < config.dead_band and not any(c.action is Action.READMIT for c in candidates):
            return f"dead band: a re-plan would gain {gain:.1%}"
        return "no action saves more than it costs"
    best = max(worth, key=lambda c: c.saving_ms)
    return min(
        (c for c in worth if c.saving_ms >= best.saving_ms - margin_of[id(best)]),
        key=lambda c: (RUNG[c.action], -c.saving_ms),
    )


def _candidates(
    situation: Situation,
    state: LadderState,
    config: LadderConfig,
    excluded: set[int],
    before: float,
) -> list[Candidate]:
    """Every alternative worth pricing, in rung order: re-plan, fine-tune, exclusions, then
    readmissions."""
    ledger = {(e.rank, e.start): e for e in state.ledger}
    open_events = sorted(
        ((r.ratio, r.rank, r.event_start) for r in situation.ranks if r.event_start is not None),
        reverse=True,
    )
    worst = (open_events[0][1], open_events[0][2]) if open_events else None
    event = worst if worst is not None else _last_closed_event(state)

    def spent(key: tuple[int, int] | None) -> bool:
        entry = ledger.get(key) if key is not None else None
        return entry is not None and entry.changes >= config.max_changes_per_event

    pricing = _Pricing(situation, config, before)
    change_ms = pricing.change_ms
    out: list[Candidate | None] = []
    live = event if event is not None and event == worst else None
    if not spent(event):
        step = max(situation.granularity, int(config.fine_tune_fraction * situation.global_batch))
        out += [
            pricing.price(
                Action.REPLAN, None, replan(situation, excluded), change_ms, event, live, excluded
            ),
            pricing.price(
                Action.FINE_TUNE,
                None,
                fine_tune(situation, excluded, step),
                change_ms,
                event,
                live,
                excluded,
            ),
        ]
        for ratio, rank, start in open_events if config.may_exclude else ():
            if ratio < config.exclude_min_ratio or rank in excluded or spent((rank, start)):
                continue
            if rank in situation.overrides.pins or len(situation.ranks) - len(excluded) < 2:
                continue
            switch = change_ms + 2 * config.regroup_ms + config.resync_ms
            out_ = excluded | {rank}
            plan = replan(situation, out_)
            out.append(
                pricing.price(
                    Action.EXCLUDE, rank, plan, switch, (rank, start), (rank, start), out_
                )
            )
    out += _readmissions(situation, state, excluded, pricing)
    return [c for c in out if c is not None]


def _last_closed_event(state: LadderState) -> tuple[int, int] | None:
    recent = [e for e in state.ledger if e.closed_at is not None]
    if not recent:
        return None
    last = max(recent, key=lambda e: (e.closed_at or 0, e.rank))
    return (last.rank, last.start)


def _readmissions(
    situation: Situation, state: LadderState, excluded: set[int], pricing: _Pricing
) -> list[Candidate | None]:
    """Bringing back each rank the ladder excluded."""
    config = pricing.config
    readmit_cost = pricing.change_ms + config.regroup_ms + config.resync_ms
    out = []
    for rank in state.excluded:
        view = next(r for r in situation.ranks if r.rank == rank)
        starts = [e.start for e in state.ledger if e.rank == rank]
        if view.event_start is not None:
            starts.append(view.event_start)
        key = (rank, max(starts)) if starts else None
        plan = replan(situation, excluded - {rank})
        # Back in the group it must take samples, or readmitting it changes nothing.
        if plan is not None and plan[rank] > 0:
            live_key = (rank, view.event_start) if view.event_start is not None else None
            out.append(
                pricing.price(
                    Action.READMIT, rank, plan, readmit_cost, key, live_key, excluded - {rank}
                )
            )
    return out


@dataclass(frozen=True)
class _Pricing:
    """Prices a candidate plan against the current one (module docstring: cost comparison)."""

    situation: Situation
    config: LadderConfig
    before: float

    @property
    def change_ms(self) -> float:
        return self.config.plan_change_iterations * self.before

    def price(
        self,
        action: Action,
        rank: int | None,
        plan: Mapping[int, int] | None,
        switch: float,
        key: tuple[int, int] | None,
        horizon_key: tuple[int, int] | None,
        group_out: set[int],
    ) -> Candidate | None:
        """The candidate, or None when there is no plan or it is the current one."""
        if plan is None or dict(plan) == self.situation.batches:
            return None
        after = makespan(self.situation, plan, group_out)
        h = _horizon(self.situation, horizon_key, self.config)
        saving = h * (self.before - after) - switch
        return Candidate(action, rank, dict(plan), after, switch, h, saving, key)


def _apply(
    situation: Situation,
    state: LadderState,
    chosen: Candidate,
    before: float,
    imb: float,
    candidates: tuple[Candidate, ...],
) -> tuple[Decision, LadderState]:
    excluded = list(state.excluded)
    if chosen.action is Action.EXCLUDE:
        assert chosen.rank is not None
        excluded.append(chosen.rank)
    elif chosen.action is Action.READMIT:
        excluded.remove(chosen.rank)  # type: ignore[arg-type]
    ledger = tuple(
        replace(e, changes=e.changes + 1) if (e.rank, e.start) == chosen.event else e
        for e in state.ledger
    )
    gain = before - chosen.predicted_ms
    what = chosen.action.value + (f"({chosen.rank})" if chosen.rank is not None else "")
    reason = (
        f"{what}: {before:.1f} -> {chosen.predicted_ms:.1f} ms per iteration over "
        f"{chosen.horizon} iterations saves {gain * chosen.horizon:.0f} ms for "
        f"{chosen.switch_ms:.0f} ms of switching"
    )
    decision = Decision(
        action=chosen.action,
        reason=reason,
        new_batch_sizes=chosen.batch_sizes,
        predicted_ms_before=before,
        predicted_ms_after=chosen.predicted_ms,
        rank=chosen.rank,
        event=chosen.event,
        horizon=chosen.horizon,
        imbalance=imb,
        candidates=candidates,
    )
    unconfirmed = {(r.rank, r.event_start) for r in situation.ranks if r.provisional}
    new_state = LadderState(
        last_change=situation.iteration,
        excluded=tuple(sorted(excluded)),
        ledger=ledger,
        provisional=chosen.event if chosen.event in unconfirmed else None,
    )
    return decision, new_state
