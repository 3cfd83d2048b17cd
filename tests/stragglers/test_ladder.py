"""The mitigation ladder: invariants, overrides, dead band, cool-down, and scripted scenarios."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from server.planner import PerfModel
from server.stragglers import (
    Action,
    LadderConfig,
    LadderState,
    Overrides,
    RankHealth,
    RankSlowdown,
    RankView,
    Scenario,
    SimConfig,
    Situation,
    StragglerEvent,
    StragglerKind,
    decide,
    rank_views,
    simulate,
)

MODELS = (PerfModel(2.83, 38.0), PerfModel(4.6, 45.0), PerfModel(1.4, 20.0), PerfModel(2.83, 38.0))
CAPS = (128, 128, 256, 128)
PLAN = {0: 53, 1: 31, 2: 119, 3: 53}  # min-max for MODELS at B = 256 within CAPS


def situation(
    ratios=(1.0, 1.0, 1.0, 1.0), *, overrides=Overrides(), iteration=100, plan=PLAN, granularity=1
) -> Situation:
    views = tuple(
        RankView(
            r,
            MODELS[r],
            plan[r],
            ratio=f,
            straggling=f > 1.2,
            event_start=90 if f > 1.2 else None,
            max_batch=CAPS[r],
        )
        for r, f in enumerate(ratios)
    )
    return Situation(iteration, 256, views, granularity, overrides, sync_ms=60.0)


def check(s: Situation, batches, excluded) -> None:
    assert sum(batches.values()) == s.global_batch
    for r in s.ranks:
        b = batches[r.rank]
        assert b % s.granularity == 0 and 0 <= b <= (r.max_batch or b)
        if r.rank in excluded:
            assert b == 0
        elif r.straggling and r.rank not in s.overrides.pins:
            assert b >= s.granularity  # still measured, so its recovery can be seen
        if r.rank in s.overrides.pins:
            assert b == s.overrides.pins[r.rank]


def test_a_3x_straggler_is_replanned_with_costs_spelled_out() -> None:
    decision, state = decide(situation((1.0, 3.0, 1.0, 1.0)), LadderState())
    assert decision.action in (Action.REPLAN, Action.FINE_TUNE, Action.EXCLUDE)
    assert decision.predicted_ms_after < decision.predicted_ms_before
    assert decision.new_batch_sizes is not None and decision.event == (1, 90)
    assert {c.action for c in decision.candidates} >= {Action.REPLAN, Action.EXCLUDE}
    assert state.last_change == 100


def test_cool_down_blocks_the_next_change() -> None:
    _, state = decide(situation((1.0, 3.0, 1.0, 1.0)), LadderState())
    again, _ = decide(situation((1.0, 6.0, 1.0, 1.0), iteration=105), state)
    assert again.action is Action.NONE and "cool-down" in again.reason


def _spike(
    iteration: int, ratio: float, *, provisional: bool, plan: Mapping[int, int] = PLAN
) -> Situation:
    """Rank 1 at ``ratio`` on an event that opened at iteration 100 (none when ratio is 1),
    under ``plan``."""
    views = tuple(
        replace(r, ratio=ratio, straggling=True, event_start=100, provisional=provisional)
        if r.rank == 1 and ratio > 1
        else replace(r, ratio=1.0, straggling=False, event_start=None)
        for r in situation(plan=plan).ranks
    )
    return Situation(iteration, 256, views, 1, Overrides(), sync_ms=60.0)


def test_a_false_alarm_on_an_unconfirmed_event_is_undone_without_the_cool_down() -> None:
    acted, state = decide(_spike(100, 8.0, provisional=True), LadderState())
    assert acted.new_batch_sizes is not None and acted.new_batch_sizes[1] < PLAN[1]
    assert state.provisional == (1, 100)
    moved = acted.new_batch_sizes
    # One iteration later the event has closed (a spike): the plan goes back at once.
    back, state = decide(_spike(101, 1.0, provisional=False, plan=moved), state)
    assert back.new_batch_sizes is not None and back.new_batch_sizes[1] > moved[1]
    assert state.provisional is None and state.last_change == 101


def test_a_confirmed_change_keeps_its_cool_down() -> None:
    acted, state = decide(_spike(100, 8.0, provisional=False), LadderState())
    assert acted.new_batch_sizes is not None and state.provisional is None
    held, _ = decide(_spike(101, 1.0, provisional=False, plan=acted.new_batch_sizes), state)
    assert held.action is Action.NONE and "cool-down" in held.reason


def test_a_provisional_change_whose_event_is_confirmed_keeps_its_cool_down() -> None:
    acted, state = decide(_spike(100, 8.0, provisional=True), LadderState())
    assert acted.new_batch_sizes is not None
    sizes = acted.new_batch_sizes
    held, state = decide(_spike(103, 8.0, provisional=False, plan=sizes), state)
    assert held.action is Action.NONE and state.provisional is None
    # ... and when the (now confirmed) event ends, the restore waits for the cool-down.
    held, _ = decide(_spike(105, 1.0, provisional=False, plan=sizes), state)
    assert held.action is Action.NONE and "cool-down" in held.reason


def test_ladder_state_round_trips_a_provisional_change() -> None:
    _, state = decide(_spike(100, 8.0, provisional=True), LadderState())
    assert LadderState.from_dict(state.to_dict()) == state


def test_dead_band_holds_for_small_imbalance() -> None:
    decision, _ = decide(situation((1.0, 1.0, 1.0, 1.0)), LadderState())
    assert decision.action is Action.NONE and "dead band" in decision.reason
    slightly = tuple(
        RankView(**{**vars(r), "ratio": 1.04}) if r.rank == 1 else r for r in situation().ranks
    )
    decision, _ = decide(Situation(100, 256, slightly, sync_ms=60.0), LadderState())
    assert decision.action is Action.NONE and "dead band" in decision.reason


def test_frozen_means_no_action() -> None:
    decision, state = decide(
        situation((1.0, 10.0, 1.0, 1.0), overrides=Overrides(frozen=True)), LadderState()
    )
    assert decision.action is Action.NONE and decision.new_batch_sizes is None
    assert state.last_change is None


def test_exclusion_is_priced_and_never_taken_when_regrouping_costs_too_much() -> None:
    s = situation((1.0, 1.0, 1.0, 10.0))
    expensive = LadderConfig(regroup_ms=1e9)
    decision, _ = decide(s, LadderState(), expensive)
    assert decision.action is not Action.EXCLUDE
    cheap = LadderConfig(regroup_ms=0.0, resync_ms=0.0)
    decision, state = decide(s, LadderState(), cheap)
    assert decision.action is Action.EXCLUDE and decision.rank == 3
    assert decision.new_batch_sizes is not None and decision.new_batch_sizes[3] == 0
    assert state.excluded == (3,)
    # a sharded job's ranks all hold a shard: the same straggler is re-planned around instead
    sharded = LadderConfig(regroup_ms=0.0, resync_ms=0.0, may_exclude=False)
    decision, state = decide(s, LadderState(), sharded)
    assert decision.action in (Action.REPLAN, Action.FINE_TUNE) and state.excluded == ()
    assert Action.EXCLUDE not in {c.action for c in decision.candidates}
    assert decision.new_batch_sizes is not None and decision.new_batch_sizes[3] < PLAN[3]


def test_exclusion_is_not_taken_when_the_all_reduce_is_measured_not_to_slow() -> None:
    cheap = LadderConfig(regroup_ms=0.0, resync_ms=0.0)
    # Rank 2 at 6x: the one sample a straggler keeps in the group (``candidates.floor``) still
    # finishes before the others, so only the all-reduce can make leaving the group pay.
    assumed = situation((1.0, 1.0, 6.0, 1.0))
    decision, _ = decide(assumed, LadderState(), cheap)
    assert decision.action is Action.EXCLUDE  # assumed: the ring runs 6x slower with rank 2
    views = tuple(replace(r, sync_ratio=1.0) if r.straggling else r for r in assumed.ranks)
    decision, state = decide(replace(assumed, ranks=views), LadderState(), cheap)
    assert decision.action is not Action.EXCLUDE and state.excluded == ()
    assert decision.new_batch_sizes is not None and 0 < decision.new_batch_sizes[2] < PLAN[2]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    ratios=st.lists(st.sampled_from([1.0, 1.0, 1.5, 3.0, 10.0]), min_size=4, max_size=4),
    measured=st.floats(0.5, 20.0),
    out=st.one_of(st.none(), st.integers(0, 3)),
)
def test_a_measured_all_reduce_slowdown_is_capped_by_the_compute_ratio(
    ratios: list[float], measured: float, out: int | None
) -> None:
    health = {
        r: RankHealth(r, f, 1.0, 0.01, _event(r) if f > 1.2 else None, "model")
        for r, f in enumerate(ratios)
    }
    excluded = {out} if out is not None else set()
    views = rank_views(
        dict(enumerate(MODELS)),
        PLAN,
        health,
        all_reduce_ratio=measured,
        excluded=excluded,
    )
    for v in views:
        if v.straggling and v.rank not in excluded:
            assert v.sync_ratio is not None and 1.0 <= v.sync_ratio <= v.ratio
        else:
            assert v.sync_ratio is None


def _event(rank: int) -> StragglerEvent:
    return StragglerEvent(rank, StragglerKind.DYNAMIC, 90, None, 3.0, 90, 93)


def test_operator_exclusion_and_pins_win() -> None:
    ov = Overrides(pins={0: 64}, excluded=frozenset({2}))
    plan = {0: 64, 1: 60, 2: 0, 3: 256 - 64 - 60}
    s = situation((1.0, 3.0, 1.0, 1.0), overrides=ov, plan=plan)
    decision, state = decide(s, LadderState(excluded=(2,)))
    assert decision.new_batch_sizes is not None
    check(s, decision.new_batch_sizes, {2})
    assert decision.action is not Action.READMIT  # the operators' exclusion is theirs to lift
    assert state.excluded == ()  # and no longer the ladder's


def test_a_plan_breaking_an_override_is_replaced_at_once() -> None:
    ov = Overrides(pins={1: 20})
    decision, _ = decide(situation(overrides=ov), LadderState(last_change=99))
    assert decision.action is Action.REPLAN and "override" in decision.reason
    assert decision.new_batch_sizes is not None and decision.new_batch_sizes[1] == 20


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    ratios=st.lists(st.sampled_from([1.0, 1.0, 1.5, 3.0, 10.0]), min_size=4, max_size=4),
    pin=st.one_of(st.none(), st.integers(0, 3)),
    out=st.one_of(st.none(), st.integers(0, 3)),
    g=st.sampled_from([1, 2, 4]),
    regroup=st.sampled_from([0.0, 2000.0]),
)
def test_every_decision_keeps_the_invariants(ratios, pin, out, g, regroup) -> None:
    plan = dict(PLAN)
    pins = {pin: plan[pin]} if pin is not None and pin != out else {}
    excluded = frozenset({out}) if out is not None else frozenset()
    if out is not None:
        plan[(out + 1) % 4] += plan[out]
        plan[out] = 0
        if (out + 1) % 4 in pins:
            pins = {}
    s = situation(
        tuple(ratios), overrides=Overrides(pins=pins, excluded=excluded), plan=plan, granularity=g
    )
    decision, state = decide(s, LadderState(), LadderConfig(regroup_ms=regroup))
    if decision.new_batch_sizes is not None:
        check(s, decision.new_batch_sizes, excluded | set(state.excluded))


def _scenario(name: str, slowdowns: tuple[RankSlowdown, ...], iterations: int = 600) -> Scenario:
    return Scenario(
        name, MODELS, 256, iterations, slowdowns, noise=0.05, max_batch=CAPS, sync_ms=60.0
    )


def test_scripted_scenarios_react_once_per_event_and_do_not_flap() -> None:
    periodic = []
    for start in (100, 300):
        periodic += [
            RankSlowdown(0, start, start + 60, 2.0),
            RankSlowdown(2, start + 100, start + 160, 2.0),
        ]
    scenarios = [
        _scenario("3x-window", (RankSlowdown(1, 150, 400, 3.0),)),
        _scenario("periodic", tuple(periodic), 500),
        _scenario("10x-to-end", (RankSlowdown(3, 200, 600, 10.0),)),
    ]
    for sc in scenarios:
        result = simulate(sc, "adaptive")
        confirmed = [e for e in result.events if e.confirmed_iteration is not None]
        assert len(confirmed) == len(sc.slowdowns), (sc.name, result.events)
        assert all(d is not None and d <= 5 for d in result.detection_delays)
        assert len(result.changes_per_event) == len(sc.slowdowns)
        assert all(1 <= c <= 3 for c in result.changes_per_event), result.changes_per_event
        assert result.ratio < 1.15, (sc.name, result.ratio)
        assert result.total_ms >= result.oracle_ms
        assert simulate(sc, "static").total_ms > result.total_ms


def test_one_sample_spikes_are_acted_on_then_undone_without_waiting_out_the_cool_down() -> None:
    """An 8x spike of one iteration is actionable, so the ladder reacts at once; the rank is back
    in the plan as soon as it is seen at normal speed (before the cool-down would allow), the
    events stay TRANSIENT, and each costs two plan changes."""
    spikes = (150, 300)
    sc = _scenario("spikes", tuple(RankSlowdown(1, t, t + 1, 8.0) for t in spikes))
    config = SimConfig()
    result = simulate(sc, "adaptive", config)
    assert [e.start_iteration for e in result.events] == list(spikes), result.events
    assert all(e.kind is StragglerKind.TRANSIENT for e in result.events), result.events
    assert result.changes_per_event == (2, 2)
    changes = [k for k, d in result.decisions if d.changes_plan]
    back = [k for k, d in result.decisions if d.new_batch_sizes == PLAN]
    for t in spikes:
        assert t in changes  # acted on the first sample
        restored = min(k for k in back if k > t)
        assert restored <= t + config.probe_every < t + config.ladder.cooldown_iterations


def test_noise_alone_changes_no_plan() -> None:
    sc = Scenario(
        "quiet",
        MODELS,
        256,
        400,
        (),
        noise=0.1,
        noise_kind="gaussian",
        seed=7,
        max_batch=CAPS,
        sync_ms=60.0,
    )
    result = simulate(sc, "adaptive")
    assert result.plan_changes == 0 and result.events == ()
