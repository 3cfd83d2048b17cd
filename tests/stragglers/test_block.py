"""A wide job's quiet ranks judged as arrays (``block.QuietBlock``) against a sample at a time:
the same events and the same state, to the last bit, whatever the series does."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.planner import PerfModel
from server.stragglers import Change, Detector, DetectorConfig
from server.stragglers.changepoint import baseline

Rows = list[tuple[int, list[tuple[int, int, float, int | None]]]]


@dataclass(frozen=True)
class Series:
    """What a drawn series does (see ``calls``)."""

    ranks: int
    iterations: int
    noise: float
    slowdowns: tuple[tuple[int, int, int, float], ...]
    """(rank, first iteration, length, factor)"""
    epoch: int
    """Every ``epoch``-th iteration is an epoch's partial batch."""
    no_models: float
    """Share of calls without models at all; a rank's model is also left out now and then."""
    drift: float
    """How far a call's models may be off the true ones (a refit)."""
    seed: int


def calls(s: Series) -> list[tuple[Rows, dict[int, PerfModel] | None]]:
    """The series as the control loop feeds it: a few iterations a call, ranks missing now and
    then, zero batches, duplicates, an iteration sent again late, planned batches known or not."""
    rng = random.Random(s.seed)
    true = [
        PerfModel(rng.uniform(0.3, 3.0), rng.uniform(0.0, 40.0), rng.choice([0.0, 0.0, 90.0]))
        for _ in range(s.ranks)
    ]
    out: list[tuple[Rows, dict[int, PerfModel] | None]] = []
    it = 0
    while it < s.iterations:
        rows: Rows = []
        for i in range(it, min(s.iterations, it + rng.randrange(1, 12))):
            samples: list[tuple[int, int, float, int | None]] = []
            for r in range(s.ranks):
                if rng.random() < 0.02:
                    continue  # not reported (yet)
                planned = 64 if rng.random() > 0.05 else None
                b = rng.randrange(0, 9) if i % s.epoch == s.epoch - 1 else 64
                b = 0 if rng.random() < 0.01 else b
                ms = true[r].predict(b) * max(0.05, 1 + rng.gauss(0, s.noise)) if b else 0.0
                for rank, first, length, factor in s.slowdowns:
                    if rank == r and first <= i < first + length:
                        ms *= factor
                samples.append((r, b, ms, planned))
                if rng.random() < 0.005:
                    samples.append((r, b, ms * 2, planned))  # a duplicate row
            rows.append((i, samples))
        it = rows[-1][0] + 1
        if rng.random() < 0.1 and it > 12:
            rows.insert(0, (it - 12, rows[0][1]))  # an iteration already passed, again
        models = None
        if rng.random() >= s.no_models:
            models = {
                r: PerfModel(
                    m.per_sample_ms * (1 + rng.uniform(0, s.drift)), m.intercept_ms, m.floor_ms
                )
                for r, m in enumerate(true)
                if rng.random() > 0.05
            }
        out.append((rows, models))
    return out


series_st = st.builds(
    Series,
    ranks=st.integers(4, 24),
    iterations=st.integers(60, 260),
    noise=st.sampled_from([0.0, 0.01, 0.05, 0.2]),
    slowdowns=st.lists(
        st.tuples(
            st.integers(0, 23),
            st.integers(0, 240),
            st.integers(1, 80),
            st.sampled_from([0.5, 1.3, 2.0, 3.0, 10.0]),
        ),
        max_size=4,
    ).map(tuple),
    epoch=st.sampled_from([7, 50, 1000]),
    no_models=st.sampled_from([0.0, 0.2, 1.0]),
    drift=st.sampled_from([0.0, 0.02]),
    seed=st.integers(0, 2**16),
)

configs = st.sampled_from(
    [
        DetectorConfig(),
        DetectorConfig(baseline_window=9, min_samples=5),  # an odd window, quickly full
        DetectorConfig(baseline_window=12, min_samples=8, k_sigmas=3.0, h=0.3),
    ]
)


@settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(series_st, configs)
def test_arrays_and_samples_one_at_a_time_agree_to_the_bit(
    s: Series, config: DetectorConfig
) -> None:
    one_at_a_time = Detector(config, wide_ranks=None)
    as_arrays = Detector(config, wide_ranks=2)
    for k, (rows, models) in enumerate(calls(s)):
        expected = one_at_a_time.observe_iterations(rows, models)
        assert as_arrays.observe_iterations(rows, models) == expected
        if k % 5 == 0:
            assert as_arrays.health() == one_at_a_time.health()
            assert_block_baselines_are_the_scalar_ones(as_arrays)
        assert as_arrays.open_events() == one_at_a_time.open_events()
        assert as_arrays.any_open() == one_at_a_time.any_open()
    assert as_arrays.to_dict() == one_at_a_time.to_dict()


def assert_block_baselines_are_the_scalar_ones(detector: Detector) -> None:
    """The block's own normal level and drift, which decide whether a sample is quiet (and
    are never stored), are ``changepoint``'s for every rank in it."""
    block, config = detector._block, detector.config
    if block is None or not block.rows:
        return
    detector.state  # noqa: B018 - writes the block back
    rows = np.array(sorted(block.rows.values()))
    mu, k = block._baseline(rows)
    for row, level, drift in zip(rows.tolist(), mu.tolist(), k.tolist(), strict=True):
        want_mu, sigma = baseline(block.states[row], config)
        assert (level, drift) == (want_mu, max(config.delta / 2, config.k_sigmas * sigma))


def quiet_job(ranks: int, iterations: int) -> list[tuple[Rows, dict[int, PerfModel]]]:
    rng = random.Random(7)
    models = {r: PerfModel(1.0 + r % 3, 10.0) for r in range(ranks)}
    return [
        (
            [
                (i, [(r, 64, models[r].predict(64) * rng.gauss(1, 0.02), 64) for r in range(ranks)])
                for i in range(start, start + 5)
            ],
            models,
        )
        for start in range(0, iterations, 5)
    ]


def test_a_wide_quiet_job_is_judged_as_arrays_and_a_narrow_one_is_not() -> None:
    """The agreement above is about something: once their windows are full, every rank of a
    wide quiet job is in the block; a job narrower than ``wide_ranks`` never has one."""
    wide, narrow = Detector(wide_ranks=32), Detector(wide_ranks=32)
    for rows, models in quiet_job(40, 100):
        wide.observe_iterations(rows, models)
    for rows, models in quiet_job(31, 100):
        narrow.observe_iterations(rows, models)
    assert wide._block is not None and len(wide._block) == 40
    assert narrow._block is None


def test_a_rank_that_slows_leaves_the_block_and_comes_back_once_quiet() -> None:
    ranks = 40
    detector = Detector(wide_ranks=32)
    models = {r: PerfModel(1.0, 10.0) for r in range(ranks)}
    opened = closed = None
    for i in range(300):
        slow = 3.0 if 150 <= i < 170 else 1.0
        noise = [1 + 0.01 * ((i * 7 + r) % 5) for r in range(ranks)]
        rows = [(r, 64, 74.0 * (slow if r == 5 else 1.0) * noise[r], 64) for r in range(ranks)]
        for u in detector.observe_iterations([(i, rows)], models):
            if u.change is Change.OPENED:
                opened = u.iteration
            if u.change is Change.CLOSED:
                closed = u.iteration
        block = detector._block
        if i == 140:
            assert block is not None and 5 in block.rows
        if i == 151:
            assert block is not None and 5 not in block.rows  # a sample at a time while slow
    assert opened is not None and 150 <= opened <= 152
    assert closed is not None and 170 <= closed <= 173
    assert detector._block is not None and len(detector._block) == ranks
