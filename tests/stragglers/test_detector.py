"""The detector on synthetic series: delay, recovery, false positives, classes, plain state."""

from __future__ import annotations

import json
import math
import statistics

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.planner import PerfModel, PlanProblem, WorkerSpec, solve
from server.stragglers import (
    Change,
    ComputeTiming,
    Detector,
    DetectorConfig,
    RankSlowdown,
    StragglerEvent,
    StragglerKind,
    detect,
    iteration_stats,
)
from server.stragglers.changepoint import MAD_TO_SIGMA, baseline, median_deviation

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
    dynamic = updates
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
    assert detect(window, told) == []


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


@FAST
@given(
    n=st.integers(2, 6),
    slow_rank=st.integers(0, 5),
    factor=st.floats(1.0, 20.0),
    balanced=st.booleans(),
    told=st.sampled_from(["from the start", "never", "from iteration 40"]),
    noise=st.floats(0.0, 0.1),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_steadily_slow_by_design_rank_opens_no_event(
    n: int,
    slow_rank: int,
    factor: float,
    balanced: bool,
    told: str,
    noise: float,
    seed: int,
) -> None:
    """An older device, slower than its peers by any factor, whether the plan is equal or
    balanced for it: its model says so, and that is the planner's input, not an event."""
    models, batches = fleet(n)
    slow_rank %= n
    m = models[slow_rank]
    models = tuple(
        PerfModel(m.per_sample_ms * factor, m.intercept_ms * factor, m.floor_ms * factor)
        if r == slow_rank
        else model
        for r, model in enumerate(models)
    )
    if balanced:
        plan = solve(
            PlanProblem(sum(batches), tuple(WorkerSpec(str(r), x) for r, x in enumerate(models)))
        )
        batches = tuple(max(1, plan.batch_sizes[str(r)]) for r in range(n))
    window = series(models, batches, 200, noise=noise, seed=seed)
    assert _detect_told(window, dict(enumerate(models)), told) == []


def _detect_told(
    window: list[ComputeTiming], models: dict[int, PerfModel], told: str
) -> list[StragglerEvent]:
    """Events of a detector told the models from the start, never (its own reference), or only
    from iteration 40 on (as the server's watch is, once the rebalancer's fits are in)."""
    detector = Detector()
    events: dict[tuple[int, int, StragglerKind], StragglerEvent] = {}
    for it in sorted({t.iteration for t in window}):
        known = {
            "from the start": models,
            "never": None,
            "from iteration 40": models if it >= 40 else None,
        }[told]
        for u in detector.observe([t for t in window if t.iteration == it], known):
            events[u.event.key] = u.event
    return list(events.values())


@FAST
@given(
    n=st.integers(1, 6),
    epoch=st.integers(2, 20),
    tail_floor=st.floats(0.0, 1.0),
    told=st.sampled_from(["from the start", "never", "from iteration 40"]),
    noise=st.floats(0.0, 0.1),
    kind=st.sampled_from(["uniform", "gaussian"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_an_epochs_partial_batch_opens_no_event(
    n: int, epoch: int, tail_floor: float, told: str, noise: float, kind: str, seed: int
) -> None:
    """A rank whose times match its model, at its planned batch and at an epoch's final partial
    batch of any smaller size (0 to an eighth of it), opens no event: neither when a few samples
    take exactly what the model predicts for them (an intercept the ``self`` reference does not
    know), nor when they take up to the full batch's time (a fixed cost the model, fitted on
    full batches, leaves out)."""
    models, batches = fleet(n)
    window = series(
        models, batches, 300, noise=noise, kind=kind, seed=seed, epoch=epoch, tail_floor=tail_floor
    )
    assert _detect_told(window, dict(enumerate(models)), told) == []


@FAST
@given(
    n=st.integers(2, 6),
    rank=st.integers(0, 5),
    onset=st.integers(20, 120),
    length=st.integers(30, 100),
    factor=st.floats(1.5, 10.0),
    epoch=st.integers(2, 12),
    tail_floor=st.floats(0.0, 1.0),
    noise=st.floats(0.0, 0.1),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_slowdown_across_epoch_tails_is_caught_as_soon_and_closed_once(
    n: int,
    rank: int,
    onset: int,
    length: int,
    factor: float,
    epoch: int,
    tail_floor: float,
    noise: float,
    seed: int,
) -> None:
    """Partial batches during a slowdown neither delay its confirmation nor close it early."""
    rank %= n
    models, batches = fleet(n)
    end = onset + length
    slow = [RankSlowdown(rank, onset, end, factor)]
    window = series(
        models, batches, end + 20, slow, noise=noise, seed=seed, epoch=epoch, tail_floor=tail_floor
    )
    updates = replay(window, dict(enumerate(models)))
    assert {u.event.rank for u in updates} == {rank}, updates
    assert len({u.event.key for u in updates}) == 1  # one event, no flapping
    confirmed = next(u for u in updates if u.event.kind is StragglerKind.DYNAMIC)
    assert confirmed.iteration - onset <= 5 + 5 // (epoch - 1)  # tails are no evidence
    closed = [u for u in updates if u.change is Change.CLOSED]
    assert len(closed) == 1
    assert 0 <= closed[0].iteration - end <= 5 + 5 // (epoch - 1)


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


# ---------------------------------------------------------------- the baseline's sorted window


def _reference_baseline(base: list[float], config: DetectorConfig) -> tuple[float, float]:
    """``baseline`` as first written: the window sorted afresh, deviations built as a list."""
    if len(base) < config.min_samples:
        return 0.0, config.sigma_prior
    bound = math.log(config.max_bias)
    center = statistics.median(base)
    sigma = MAD_TO_SIGMA * statistics.median([abs(b - center) for b in base])
    return min(bound, max(-bound, center)), max(config.sigma_floor, sigma)


_VALUES = st.one_of(
    st.floats(-5.0, 5.0, allow_nan=False),
    st.sampled_from([-0.5, 0.0, 0.1, 0.1, 0.25, 1.0]),  # ties, and ties across the center
)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(
    data=st.lists(_VALUES, min_size=1, max_size=70),
    center=st.one_of(st.none(), st.floats(-6.0, 6.0, allow_nan=False)),
)
def test_median_deviation_is_the_median_of_the_deviations_to_the_last_bit(
    data: list[float], center: float | None
) -> None:
    ordered = sorted(data)
    c = statistics.median(data) if center is None else center
    assert median_deviation(ordered, c) == statistics.median([abs(v - c) for v in data])


@FAST
@given(
    rank=st.integers(0, 2),
    onset=st.integers(10, 120),
    length=st.integers(1, 60),
    factor=st.floats(1.2, 10.0),
    noise=st.floats(0.0, 0.15),
    with_models=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_kept_sorted_window_gives_the_baseline_of_a_fresh_sort(
    rank: int,
    onset: int,
    length: int,
    factor: float,
    noise: float,
    with_models: bool,
    seed: int,
) -> None:
    """Samples enter, leave at the window's end, are dropped when an event opens and come back
    when it closes: after every iteration each rank's baseline is what sorting gives."""
    models, batches = fleet(3)
    slow = [RankSlowdown(rank, onset, onset + length, factor)]
    window = series(models, batches, 220, slow, noise=noise, seed=seed, kind="gaussian")
    detector = Detector()
    config = detector.config
    for it in range(220):
        detector.observe(
            [t for t in window if t.iteration == it],
            dict(enumerate(models)) if with_models else None,
        )
        for state in detector.state.ranks:
            assert state.base_sorted == sorted(state.base)
            assert baseline(state, config) == _reference_baseline(state.base, config)


def test_state_stored_before_the_sorted_window_restores_the_same_detector() -> None:
    models, batches = fleet(3)
    window = series(models, batches, 200, [RankSlowdown(1, 90, 150, 2.0)], noise=0.08, seed=3)
    ms = dict(enumerate(models))
    expected = Detector().observe(window, ms)
    first = Detector()
    got = first.observe([t for t in window if t.iteration < 120], ms)
    old = first.to_dict()
    for r in old["ranks"]:
        del r["base_sorted"]  # as stored before the field existed
    got += Detector.from_dict(old).observe([t for t in window if t.iteration >= 120], ms)
    assert got == expected
