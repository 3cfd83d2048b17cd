"""Model fitting: recovers known parameters despite noise and spikes, follows regime changes, and
says so when the data cannot identify a model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.planner import InvalidInput, PerfModel
from server.planner.fit import Observation, explore_batches, fit_arrays, fit_model


def synthetic(
    model: PerfModel,
    sizes: list[int],
    n: int,
    *,
    seed: int,
    noise: float = 0.03,
    spikes: float = 0.1,
    start: int = 0,
) -> list[Observation]:
    """n iterations at random sizes: multiplicative noise, and a share of 2-4x contention spikes."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        b = int(rng.choice(sizes))
        t = model.predict(b) * (1 + noise * rng.standard_normal())
        if rng.random() < spikes:
            t *= rng.uniform(2, 4)
        out.append(Observation(b, t, start + i))
    return out


def test_recovers_resnet_like_line_through_noise_and_spikes() -> None:
    truth = PerfModel(2.83, 38.0)
    fit = fit_model(synthetic(truth, [16, 32, 64, 128], 400, seed=1), half_life_iterations=None)
    assert fit.identifiable and fit.model is not None
    assert fit.model.per_sample_ms == pytest.approx(2.83, rel=0.03)
    assert fit.model.intercept_ms == pytest.approx(38.0, abs=4.0)
    assert fit.model.floor_ms == 0.0
    assert 25 <= fit.trimmed <= 80  # about 40 spikes, plus a few tail points
    assert fit.used + fit.trimmed == fit.observations == 400
    assert fit.distinct_batch_sizes == 4
    assert fit.r2 is not None and fit.r2 > 0.98
    assert fit.relative_rmse is not None and fit.relative_rmse < 0.05


def test_plain_least_squares_would_be_fooled_by_the_spikes() -> None:
    """The guard for the test above: the spikes really do move a non-robust fit."""
    obs = synthetic(PerfModel(2.83, 38.0), [16, 32, 64, 128], 400, seed=1)
    x = np.array([o.batch_size for o in obs], dtype=float)
    y = np.array([o.compute_ms for o in obs])
    slope, intercept = np.polyfit(x, y, 1)
    assert abs(slope - 2.83) > 0.2 or abs(intercept - 38.0) > 15


def test_finds_the_floor_of_a_transformer_like_curve() -> None:
    truth = PerfModel(1.0625, 48.0, 92.0)  # V100 Transformer: flat ~92 ms, knee near 41
    obs = synthetic(truth, [8, 16, 32, 48, 64, 96, 128], 400, seed=2, noise=0.02)
    fit = fit_model(obs)
    assert fit.model is not None
    assert fit.model.floor_ms == pytest.approx(92.0, rel=0.03)
    assert fit.model.per_sample_ms == pytest.approx(1.0625, rel=0.05)
    assert fit.model.knee == pytest.approx(truth.knee, abs=6)
    assert any("flat" in note for note in fit.notes)


def test_published_v100_figures() -> None:
    # Gavel's published V100 step times (ms) for a ResNet at four batch sizes.
    resnet = fit_model(
        [Observation(b, t) for b, t in [(16, 87.7), (32, 128.4), (64, 227.5), (128, 400.5)]]
    )
    assert resnet.model is not None
    assert resnet.model.floor_ms == 0.0  # one high point at 16 is no flat region
    assert resnet.model.per_sample_ms == pytest.approx(2.83, rel=0.02)
    transformer = fit_model(
        [Observation(b, t) for b, t in [(16, 90), (32, 94), (64, 116), (128, 184)]]
    )
    assert transformer.model == PerfModel(1.0625, 48.0, 92.0)


def test_no_floor_is_invented_on_a_line() -> None:
    fit = fit_model(synthetic(PerfModel(3.0, 20.0), [4, 8, 16, 32, 64, 128], 300, seed=3))
    assert fit.model is not None and fit.model.floor_ms == 0.0


@settings(max_examples=60, deadline=None)
@given(
    st.floats(0.05, 20.0),
    st.floats(0.0, 200.0),
    st.lists(st.integers(1, 512), min_size=2, max_size=8, unique=True),
)
def test_exact_data_on_a_line_is_recovered_exactly(
    per_sample: float, intercept: float, sizes: list[int]
) -> None:
    truth = PerfModel(per_sample, intercept)
    fit = fit_model([Observation(b, truth.predict(b), i) for i, b in enumerate(sizes * 3)])
    assert fit.model is not None
    assert fit.model.floor_ms == 0.0
    assert fit.trimmed == 0
    assert fit.model.per_sample_ms == pytest.approx(per_sample, rel=1e-6)
    assert fit.model.intercept_ms == pytest.approx(intercept, rel=1e-6, abs=1e-6)


def test_recency_weighting_follows_a_changed_regime() -> None:
    before = synthetic(PerfModel(2.0, 10.0), [16, 32, 64], 300, seed=4, spikes=0.0)
    after = synthetic(PerfModel(4.0, 20.0), [16, 32, 64], 60, seed=5, spikes=0.0, start=300)
    recent = fit_model(before + after, half_life_iterations=10)
    assert recent.model is not None
    assert recent.model.per_sample_ms == pytest.approx(4.0, rel=0.05)
    # Without recency the old regime, five times as many observations, wins.
    flat = fit_model(before + after, half_life_iterations=None)
    assert flat.model is not None
    assert flat.model.per_sample_ms == pytest.approx(2.0, rel=0.05)


def test_one_batch_size_is_not_identifiable_and_suggests_exploration() -> None:
    obs = [Observation(32, 100.0 + i % 3, i) for i in range(20)]
    fit = fit_model(obs, max_batch=36)
    assert not fit.identifiable
    assert fit.model is None
    assert "only batch size 32" in fit.reason
    assert fit.distinct_batch_sizes == 1
    assert fit.explore and all(1 <= b <= 36 and b != 32 for b in fit.explore)
    assert fit.guess is not None and fit.guess.intercept_ms == 0.0


def test_batch_zero_and_emptiness() -> None:
    fit = fit_model([Observation(0, 0.0, i) for i in range(5)])
    assert not fit.identifiable and fit.observations == 0
    assert "no observations" in fit.reason
    mixed = [Observation(0, 0.0, 0), Observation(8, 30.0, 1), Observation(16, 50.0, 2)]
    assert fit_model(mixed).model == PerfModel(2.5, 10.0)


def test_negative_slope_is_clamped_with_a_note() -> None:
    obs = [Observation(b, 100.0 - 0.1 * b, i) for i, b in enumerate([8, 16, 32, 64] * 4)]
    fit = fit_model(obs)
    assert fit.model is not None and fit.model.per_sample_ms == 0.0
    assert any("slope" in note and "clamped" in note for note in fit.notes)


def test_negative_intercept_is_clamped_with_a_note() -> None:
    obs = [Observation(b, 3.0 * b - 20.0, i) for i, b in enumerate([16, 32, 64] * 4)]
    fit = fit_model(obs)
    assert fit.model is not None and fit.model.intercept_ms == 0.0
    assert fit.model.per_sample_ms > 2.5
    assert any("intercept" in note for note in fit.notes)


def test_narrow_range_is_flagged() -> None:
    obs = [Observation(b, 10.0 + 2.0 * b, i) for i, b in enumerate([100, 101, 102] * 4)]
    fit = fit_model(obs, max_batch=200)
    assert fit.identifiable
    assert fit.explore and any("poorly determined" in note for note in fit.notes)


def test_bad_observations_are_refused() -> None:
    with pytest.raises(InvalidInput):
        fit_model([Observation(8, float("nan"))])
    with pytest.raises(InvalidInput):
        fit_model([Observation(-1, 3.0)])
    with pytest.raises(InvalidInput):
        fit_model([Observation(8, 3.0)], half_life_iterations=0)


def test_explore_batches_respects_granularity_and_cap() -> None:
    assert explore_batches(64) == (48, 80)
    assert explore_batches(64, granularity=16) == (48, 80)
    assert explore_batches(64, max_batch=64) == (32, 48)
    assert explore_batches(1) == (2,)


@settings(max_examples=300, deadline=None)
@given(
    data=st.lists(
        st.tuples(
            st.integers(1, 64),
            st.floats(0.0, 1e4, allow_nan=False),
            st.sampled_from([1.0, 1.0, 3.0, 10.0]),
        ),
        min_size=1,
        max_size=60,
    ),
    half_life=st.sampled_from([None, 0.5, 2.0, 50.0]),
)
def test_any_valid_observations_give_a_fit_or_a_reason_never_an_error(
    data: list[tuple[int, float, float]], half_life: float | None
) -> None:
    """Regime changes (a straggler's factor) and degenerate timings included: the control loop
    fits whatever telemetry says, so a fit must never raise on valid input."""
    obs = [Observation(b, ms * f, i) for i, (b, ms, f) in enumerate(data)]
    fit = fit_model(obs, half_life_iterations=half_life)
    assert fit.identifiable == (fit.model is not None)
    assert fit.used + fit.trimmed <= fit.observations
    if not fit.identifiable:
        assert fit.reason
    else:
        assert fit.trimmed <= fit.observations // 2, "outliers are a minority by definition"


@settings(max_examples=200, deadline=None)
@given(
    data=st.lists(
        st.tuples(
            st.integers(0, 64),
            st.floats(0.0, 1e4, allow_nan=False),
            st.integers(0, 400),
        ),
        max_size=80,
    ),
    half_life=st.sampled_from([None, 2.0, 50.0]),
    max_batch=st.sampled_from([None, 64]),
)
def test_a_fit_of_columns_is_the_fit_of_the_same_observations(
    data: list[tuple[int, float, int]], half_life: float | None, max_batch: int | None
) -> None:
    """``fit_arrays`` (the control loop's kept window, as arrays) fits to the last bit what
    ``fit_model`` fits of the same observations in the same order, batch 0 rows included."""
    obs = [Observation(b, ms, it) for b, ms, it in data]
    columns = [np.array(c) for c in zip(*data, strict=True)] if data else [np.array([])] * 3
    want = fit_model(obs, half_life_iterations=half_life, max_batch=max_batch)
    got = fit_arrays(*columns, half_life_iterations=half_life, max_batch=max_batch)
    assert got == want


def test_bad_columns_are_refused_as_bad_observations_are() -> None:
    with pytest.raises(InvalidInput, match="bad observation"):
        fit_arrays(np.array([8, 8]), np.array([3.0, float("nan")]), np.array([0, 1]))
    with pytest.raises(InvalidInput, match="bad observation"):
        fit_arrays(np.array([-1]), np.array([3.0]), np.array([0]))
    with pytest.raises(InvalidInput, match="one length"):
        fit_arrays(np.array([8, 16]), np.array([3.0]), np.array([0, 1]))
    with pytest.raises(InvalidInput, match="positive"):
        fit_arrays(np.array([8]), np.array([3.0]), np.array([0]), half_life_iterations=0)
