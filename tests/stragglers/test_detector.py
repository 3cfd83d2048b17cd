"""The detector on synthetic series: delay, recovery, false positives, classes, plain state."""

from __future__ import annotations

import json
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.planner import PerfModel
from server.stragglers import (
    Change,
    ComputeTiming,
    Detector,
    DetectorConfig,
    RankSlowdown,
    StragglerKind,
    detect,
    iteration_stats,
)

from .synthetic import MODELS, series

BATCHES = (64, 40, 128, 64)
FAST = settings(
    max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


def fleet(n: int) -> tuple[tuple[PerfModel, ...], tuple[int, ...]]:
    return tuple(MODELS[i % 4] for i in range(n)), tuple(BATCHES[i % 4] for i in range(n))


def replay(window: list[ComputeTiming], models: dict[int, PerfModel]) -> list:
    detector = Detector()
    updates = []
    for it in sorted({t.iteration for t in window}):
        updates += detector.observe([t for t in window if t.iteration == it], models)
    return updates


@FAST
@given(
    n=st.integers(2, 6),
    rank=st.integers(0, 5),
    onset=st.integers(0, 120),
    length=st.integers(30, 100),
    factor=st.floats(1.5, 10.0),
    noise=st.floats(0.0, 0.1),
    kind=st.sampled_from(["uniform", "gaussian"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_sustained_slowdown_is_confirmed_within_5_and_its_end_within_5(
    n: int, rank: int, onset: int, length: int, factor: float, noise: float, kind: str, seed: int
) -> None:
    rank %= n
    models, batches = fleet(n)
    end = onset + length
    slow = [RankSlowdown(rank, onset, end, factor)]
    window = series(models, batches, end + 20, slow, noise=noise, kind=kind, seed=seed)
    updates = replay(window, dict(enumerate(models)))
    dynamic = [u for u in updates if u.event.kind is not StragglerKind.STATIC]
    assert {u.event.rank for u in dynamic} == {rank}, dynamic
    assert len({u.event.key for u in dynamic}) == 1  # one event, no flapping
    confirmed = next(u for u in dynamic if u.event.kind is StragglerKind.DYNAMIC)
    assert confirmed.iteration - onset <= 5
    closed = [u for u in dynamic if u.change is Change.CLOSED]
    assert len(closed) == 1
    assert 0 <= closed[0].iteration - end <= 5
    event = closed[0].event
    assert abs(event.start_iteration - onset) <= 5 or event.start_iteration <= onset
    assert abs(event.end_iteration - end) <= 3  # type: ignore[operator]
    assert abs(math.log(event.severity / factor)) < math.log(1.2)


@FAST
@given(
    n=st.integers(2, 6),
    rank=st.integers(0, 5),
    onset=st.integers(20, 120),
    factor=st.floats(2.5, 10.0),
    noise=st.floats(0.0, 0.1),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_severe_slowdown_is_confirmed_sooner(
    n: int, rank: int, onset: int, factor: float, noise: float, seed: int
) -> None:
    rank %= n
    models, batches = fleet(n)
    slow = [RankSlowdown(rank, onset, onset + 40, factor)]
    window = series(models, batches, onset + 40, slow, noise=noise, seed=seed)
    updates = replay(window, dict(enumerate(models)))
    confirmed = next(u for u in updates if u.event.kind is StragglerKind.DYNAMIC)
    assert confirmed.event.start_iteration == onset
    fast = DetectorConfig().fast_sustain_iterations
    assert confirmed.iteration - onset == fast - 1


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    n=st.integers(2, 6),
    noise=st.floats(0.0, 0.1),
    kind=st.sampled_from(["uniform", "gaussian"]),
    bias=st.floats(0.9, 1.1),
    seed=st.integers(0, 2**32 - 1),
)
def test_noise_up_to_10_percent_opens_no_event(
    n: int, noise: float, kind: str, bias: float, seed: int
) -> None:
    models, batches = fleet(n)
    window = series(models, batches, 400, noise=noise, kind=kind, seed=seed)
    # The models the detector gets may be off by up to 10% as well.
    told = {
        r: PerfModel(m.per_sample_ms * bias, m.intercept_ms * bias, m.floor_ms * bias)
        for r, m in enumerate(models)
    }
    assert [e for e in detect(window, told) if e.kind is not StragglerKind.STATIC] == []


def test_a_short_spike_is_a_closed_transient_event_never_dynamic() -> None:
    models, batches = fleet(4)
    spikes = [RankSlowdown(1, 100, 101, 3.0), RankSlowdown(2, 200, 202, 5.0)]
    window = series(models, batches, 300, spikes, noise=0.05, seed=1)
    events = detect(window, dict(enumerate(models)))
    assert [(e.rank, e.kind, e.start_iteration) for e in events] == [
        (1, StragglerKind.TRANSIENT, 100),
        (2, StragglerKind.TRANSIENT, 200),
    ]
    assert all(e.end_iteration is not None and e.duration <= 2 for e in events)


def test_a_rank_slow_by_its_model_is_static_not_dynamic() -> None:
    models = (PerfModel(2.0, 20.0), PerfModel(2.0, 20.0), PerfModel(8.0, 60.0))
    window = series(models, (64, 64, 64), 100, noise=0.05, seed=2)
    events = detect(window, dict(enumerate(models)))
    assert [(e.rank, e.kind, e.end_iteration) for e in events] == [(2, StragglerKind.STATIC, None)]
    assert events[0].severity > 3


def test_incremental_state_round_trips_through_json() -> None:
    models, batches = fleet(3)
    window = series(models, batches, 200, [RankSlowdown(0, 90, 150, 2.0)], noise=0.08, seed=3)
    ms = dict(enumerate(models))
    whole = Detector()
    expected = whole.observe(window, ms)
    first = Detector()
    got = first.observe([t for t in window if t.iteration < 120], ms)
    restored = Detector.from_dict(json.loads(json.dumps(first.to_dict())))
    got += restored.observe([t for t in window if t.iteration >= 120], ms)
    assert got == expected
    (event,) = [e for e in detect(window, ms) if e.kind is StragglerKind.DYNAMIC]
    assert event.end_iteration == 150


def test_without_models_each_rank_is_its_own_reference() -> None:
    models, batches = fleet(4)
    window = series(models, batches, 200, [RankSlowdown(3, 80, 200, 2.0)], noise=0.05, seed=4)
    events = detect(window)
    assert [(e.rank, e.kind, e.end_iteration) for e in events] == [(3, StragglerKind.DYNAMIC, None)]
    assert Detector().health() == {}


def test_refits_during_an_event_do_not_hide_it_and_late_timings_are_ignored() -> None:
    models, batches = fleet(2)
    window = series(models, batches, 150, [RankSlowdown(0, 50, 150, 3.0)], noise=0.05, seed=5)
    detector = Detector()
    base = dict(enumerate(models))
    refit = {0: PerfModel(3 * 2.83, 3 * 38.0), 1: models[1]}  # a refit absorbing the slowdown
    for it in range(150):
        rows = [t for t in window if t.iteration == it]
        detector.observe(rows, base if it < 60 else refit)
        detector.observe(rows, base)  # duplicates: ignored
    health = detector.health()
    assert health[0].straggling and 2.7 < health[0].ratio < 3.3
    assert not health[1].straggling


def test_iteration_stats_leave_out_ranks_without_samples() -> None:
    rows = [
        ComputeTiming(0, 7, 10, 100.0),
        ComputeTiming(1, 7, 10, 150.0),
        ComputeTiming(2, 7, 0, 0.0),
    ]
    (stats,) = iteration_stats(rows, {0: PerfModel(10.0)})
    assert stats.ranks == 2 and stats.slowest_rank == 1
    assert stats.imbalance == 50.0 / 125.0
    assert stats.ratios == {0: 1.0}


def test_config_refuses_nonsense() -> None:
    import pytest

    with pytest.raises(ValueError, match="min_factor"):
        DetectorConfig(min_factor=1.0)


@FAST
@given(
    n=st.integers(2, 6),
    rank=st.integers(0, 5),
    onset=st.integers(20, 80),
    factor=st.one_of(st.floats(1.3, 1.5), st.floats(2.2, 12.0)),
    noise=st.floats(0.0, 0.1),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_severe_slowdown_is_actionable_once_detected_and_still_unconfirmed(
    n: int, rank: int, onset: int, factor: float, noise: float, seed: int
) -> None:
    """Every sample 1.75x or more: the ladder may act (``straggling``) as soon as the event is
    open (by the second sample at 2.2x, the first at 3x), while it is still TRANSIENT; a milder
    one waits for confirmation."""
    rank %= n
    models, batches = fleet(n)
    window = series(
        models,
        batches,
        onset + 10,
        [RankSlowdown(rank, onset, onset + 10, factor)],
        noise=noise,
        seed=seed,
    )
    detector = Detector()
    told = dict(enumerate(models))
    first = None
    for it in range(onset + 2):
        detector.observe([t for t in window if t.iteration == it], told)
        if first is None and detector.health()[rank].straggling:
            first = it
    health = detector.health()[rank]
    if factor >= 2.2:
        assert health.event is not None and health.event.kind is StragglerKind.TRANSIENT
        assert health.straggling and health.actionable
        assert first is not None and first - onset <= (0 if factor >= 3 else 1)
    else:  # open or not yet: either way not acted on before confirmation
        assert not health.straggling and not health.actionable and first is None
    assert not any(h.straggling for r, h in detector.health().items() if r != rank)
