"""Fitting a ``PerfModel`` to measured (batch size, compute ms) pairs, robustly and honestly.

Weights. An observation from ``a`` iterations ago weighs ``w = 2 ** (-a / half_life)``, so the fit
follows a worker whose speed changed (contention, thermal throttling) after a few half-lives.

Line. ``t = c + s b`` is fitted by iteratively reweighted least squares with Huber's loss: each
round, residuals r are scaled by a robust sigma (1.4826 times their weighted median absolute
deviation) and an observation keeps weight ``w * min(1, k sigma / |r|)`` with ``k = 1.345``. The
start is the line through the weighted median time of each distinct batch size, which a minority
of spikes cannot move. Afterwards, observations with ``|r| > 3.5 sigma`` are trimmed (only with
ten or more observations, and never more than half of them) and the chosen form is refitted by
weighted least squares on the rest.
Sigma is floored at 1% of the median time: real timings jitter at least that much, and a perfect
fit must not make every tiny deviation an outlier.

Identifiability. Slope and intercept need at least two distinct batch sizes; with fewer the
result says so (``identifiable=False``), suggests batch sizes to explore, and offers a labelled
``guess`` through the origin, never a silent model.

Floor. ``t = max(f, c + s b)`` is tried with the knee after each distinct batch size that leaves
two or more below and above it: f is the weighted median of the times at or below the knee, the
line is fitted robustly above it. The knee with the smallest robust sigma is kept only if that
sigma is under half the plain line's (spikes cannot fake this, systematic misfit does), the floor
stands more than two sigmas above its line's value at the smallest batch size, and the times under
the floor are flat (their own slope below a quarter of s). Otherwise f = 0: when in doubt, none.

Clamps. A negative slope becomes 0 (the mean time is the intercept); a negative intercept becomes
0 (the slope is refitted through the origin). Each clamp is reported in ``notes``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from server.planner.errors import InvalidInput
from server.planner.model import FloatArray, PerfModel

HUBER_K = 1.345
TRIM_SIGMAS = 3.5
MIN_TO_TRIM = 10
"""Fewer observations than this are never trimmed: their spread says too little about noise."""
SIGMA_FLOOR = 0.01
MAD_TO_SIGMA = 1.4826


class Observation(NamedTuple):
    """One iteration of one worker. (A named tuple: the control loop makes one per telemetry
    row, thousands a round, and a frozen dataclass took three times as long to build.)"""

    batch_size: int
    compute_ms: float
    iteration: int = 0
    """When it was measured; only differences matter (they set the recency weights)."""


@dataclass(frozen=True)
class ModelFit:
    """A fitted model with everything needed to decide whether to trust it."""

    identifiable: bool
    model: PerfModel | None
    """The fitted model; None when not identifiable."""
    reason: str
    """Why it is not identifiable, or a one-line summary of the fit."""
    observations: int
    """Observations with a batch size >= 1 (batch 0 carries no information: t(0) = 0)."""
    used: int
    trimmed: int
    distinct_batch_sizes: int
    r2: float | None = None
    """Weighted (recency) R^2 of the model on the observations used."""
    relative_rmse: float | None = None
    """Weighted root-mean-square error over the weighted mean time."""
    explore: tuple[int, ...] = ()
    """Batch sizes worth running next to make (or keep) the model identifiable."""
    notes: tuple[str, ...] = ()
    guess: PerfModel | None = None
    """When not identifiable: ``t = (mean ms / b) * b``, an explicit guess, for callers who choose
    to use one. Never set when ``model`` is."""


def _wmedian(values: FloatArray, weights: FloatArray) -> float:
    # The arrays' own methods, not numpy's functions: a fit takes a few dozen weighted
    # medians of small arrays, where the functions' dispatch to the methods is a real share.
    order = values.argsort(kind="stable")
    cum = weights[order].cumsum()
    return float(values[order[cum.searchsorted(0.5 * cum[-1])]])


def _wls(x: FloatArray, y: FloatArray, w: FloatArray) -> tuple[float, float]:
    """Weighted least-squares line ``y = c + s x``; returns (s, c)."""
    sw = float(w.sum())
    mx, my = float(w @ x) / sw, float(w @ y) / sw
    sxx = float(w @ ((x - mx) ** 2))
    if sxx <= 0:
        return 0.0, my
    s = float(w @ ((x - mx) * (y - my))) / sxx
    return s, my - s * mx


def _clamped_line(
    x: FloatArray, y: FloatArray, w: FloatArray, notes: list[str]
) -> tuple[float, float]:
    s, c = _wls(x, y, w)
    if s < 0:
        notes.append(f"slope came out negative ({s:.4g} ms/sample); clamped to 0")
        return 0.0, max(0.0, float(w @ y) / float(w.sum()))
    if c < 0:
        notes.append(f"intercept came out negative ({c:.4g} ms); clamped to 0, slope refitted")
        s = max(0.0, float(w @ (x * y)) / float(w @ (x * x)))
        return s, 0.0
    return s, c


def _sigma(residuals: FloatArray, weights: FloatArray, scale: float) -> float:
    """Robust sigma of residuals, floored at 1% of the typical time (timing jitter is no less)."""
    center = _wmedian(residuals, weights)
    mad = _wmedian(np.abs(residuals - center), weights)
    return max(MAD_TO_SIGMA * mad, SIGMA_FLOOR * scale, 1e-12)


def _robust_line(
    x: FloatArray, y: FloatArray, w: FloatArray, scale: float, notes: list[str]
) -> tuple[float, float]:
    """Huber IRLS line from the per-batch-size medians, with the clamps; returns (s, c)."""
    sizes = np.unique(x)
    medians = np.array([_wmedian(y[x == u], w[x == u]) for u in sizes])
    mass = np.array([float(w[x == u].sum()) for u in sizes])
    s, c = _wls(sizes, medians, mass)
    huber = np.ones_like(w)
    for _ in range(50):
        r = y - (c + s * x)
        sigma = _sigma(r, w, scale)
        huber = np.minimum(1.0, HUBER_K * sigma / np.maximum(np.abs(r), 1e-300))
        s_new, c_new = _wls(x, y, w * huber)
        done = abs(s_new - s) <= 1e-10 * (abs(s) + 1e-12) and abs(c_new - c) <= 1e-9 * scale
        s, c = s_new, c_new
        if done:
            break
    return _clamped_line(x, y, w * huber, notes)


def _fit_form(
    x: FloatArray,
    y: FloatArray,
    w: FloatArray,
    knee: float | None,
    scale: float,
    *,
    robust: bool,
    notes: list[str],
) -> PerfModel | None:
    """The plain line (``knee`` None) or a floor over batches ``<= knee`` and a line above.

    None when the form does not fit the data: a floor needs a rising line above the knee.
    """
    if knee is None:
        s, c = _robust_line(x, y, w, scale, notes) if robust else _clamped_line(x, y, w, notes)
        return PerfModel(s, c, 0.0)
    flat = x <= knee
    line_notes: list[str] = []
    if robust:
        s, c = _robust_line(x[~flat], y[~flat], w[~flat], scale, line_notes)
        f = _wmedian(y[flat], w[flat])
    else:
        s, c = _clamped_line(x[~flat], y[~flat], w[~flat], line_notes)
        f = float(w[flat] @ y[flat]) / float(w[flat].sum())
    if line_notes or s <= 0:
        return None
    return PerfModel(s, c, f)


def _predict(model: PerfModel, x: FloatArray) -> FloatArray:
    return np.maximum(model.floor_ms, model.intercept_ms + model.per_sample_ms * x)


def _choose_knee(
    x: FloatArray, y: FloatArray, w: FloatArray, line: PerfModel, scale: float
) -> float | None:
    """The knee of the best floor model if the data clearly shows a flat region, else None.

    Candidates and the plain line are compared by the robust sigma of their residuals, which
    spikes cannot inflate but systematic misfit does.
    """
    sizes = np.unique(x)
    best: tuple[float, float, PerfModel] | None = None
    for j in range(1, len(sizes) - 2):  # two or more sizes under the floor and above it
        model = _fit_form(x, y, w, float(sizes[j]), scale, robust=True, notes=[])
        if model is not None:
            sigma = _sigma(y - _predict(model, x), w, scale)
            if best is None or sigma < best[0]:
                best = (sigma, float(sizes[j]), model)
    if best is None:
        return None
    sigma, knee, model = best
    flat = x <= knee
    rise = model.floor_ms - (model.intercept_ms + model.per_sample_ms * float(sizes[0]))
    flat_slope = _robust_line(x[flat], y[flat], w[flat], scale, [])[0]
    if (
        sigma < 0.5 * _sigma(y - _predict(line, x), w, scale)
        and rise > 2 * sigma
        and flat_slope < 0.25 * model.per_sample_ms
    ):
        return knee
    return None


def explore_batches(
    batch: int, max_batch: int | None = None, granularity: int = 1
) -> tuple[int, ...]:
    """Two batch sizes about 25% either side of ``batch``, on the granularity, within the cap.

    When the cap leaves no room above, both suggestions lie below ``batch``.
    """
    g = granularity
    step = max(g, round(0.25 * batch / g) * g)
    low = max(g, (batch - step) // g * g)
    high = (batch + step) // g * g
    if max_batch is not None:
        high = min(high, max_batch // g * g)
    if high <= batch:
        high, low = low, max(g, low - step)
    return tuple(sorted({b for b in (low, high) if b != batch and b >= 1}))


def fit_model(
    observations: Iterable[Observation],
    *,
    half_life_iterations: float | None = 100.0,
    fit_floor: bool = True,
    max_batch: int | None = None,
    granularity: int = 1,
) -> ModelFit:
    """Fit ``t(b) = max(floor, intercept + per_sample * b)``; see the module docstring.

    Ages count from the latest observed iteration (only weight ratios matter, so any other
    origin gives the same fit); ``half_life_iterations=None`` weighs all observations alike.
    ``max_batch`` and ``granularity`` only shape the suggested exploration.
    """
    rows = _checked(observations, half_life_iterations)
    x = np.array([o.batch_size for o in rows], dtype=np.float64)
    y = np.array([o.compute_ms for o in rows], dtype=np.float64)
    its = np.array([o.iteration for o in rows], dtype=np.float64)
    return _fit(x, y, its, half_life_iterations, fit_floor, max_batch, granularity)


def fit_arrays(
    batch_sizes: npt.ArrayLike,
    compute_ms: npt.ArrayLike,
    iterations: npt.ArrayLike,
    *,
    half_life_iterations: float | None = 100.0,
    fit_floor: bool = True,
    max_batch: int | None = None,
    granularity: int = 1,
) -> ModelFit:
    """``fit_model`` of the observations ``zip(batch_sizes, compute_ms, iterations)`` given as
    columns: the same fit to the last bit, without an ``Observation`` per row (the control loop
    keeps each job's fit window as arrays, ``rebalancer.FitWindow``)."""
    x = np.asarray(batch_sizes, dtype=np.float64)
    y = np.asarray(compute_ms, dtype=np.float64)
    its = np.asarray(iterations, dtype=np.float64)
    if not x.shape == y.shape == its.shape or x.ndim != 1:
        raise InvalidInput(
            "observation columns must be 1-d and of one length", field="observations"
        )
    bad = (x < 0) | ~np.isfinite(y) | (y < 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        o = Observation(int(x[i]), float(y[i]), int(its[i]))
        raise InvalidInput(f"bad observation {o!r}", field="observations")
    _check_half_life(half_life_iterations)
    some = x >= 1
    if not some.all():
        x, y, its = x[some], y[some], its[some]
    return _fit(x, y, its, half_life_iterations, fit_floor, max_batch, granularity)


def _fit(
    x: FloatArray,
    y: FloatArray,
    its: FloatArray,
    half_life_iterations: float | None,
    fit_floor: bool,
    max_batch: int | None,
    granularity: int,
) -> ModelFit:
    """``fit_model`` of checked observations with a batch size of at least 1, as columns."""
    n = len(x)
    if not n:
        return ModelFit(False, None, "no observations with a batch size >= 1", 0, 0, 0, 0)
    w = _weights(its, half_life_iterations)
    scale = max(float(np.median(y)), 1e-9)
    sizes = np.unique(x)
    if len(sizes) < 2:
        return _not_identifiable(x, y, w, n, 0, max_batch, granularity)

    # Stage 1, robust: choose the form (line, or floor up to a knee) on all observations.
    notes: list[str] = []
    line = _fit_form(x, y, w, None, scale, robust=True, notes=[])
    assert line is not None
    knee = _choose_knee(x, y, w, line, scale) if fit_floor else None
    robust = line if knee is None else _fit_form(x, y, w, knee, scale, robust=True, notes=[])
    assert robust is not None
    # Stage 2: trim what that robust fit calls outliers, refit the same form by least squares.
    keep = _inliers(x, y, w, robust, scale)
    trimmed = int((~keep).sum())
    x, y, w = x[keep], y[keep], w[keep]
    if len(np.unique(x)) < 2:
        return _not_identifiable(x, y, w, n, trimmed, max_batch, granularity)
    model = _fit_form(x, y, w, knee, scale, robust=False, notes=notes)
    if model is None:  # the floor does not survive trimming: fall back to the line
        knee = None
        model = _fit_form(x, y, w, None, scale, robust=False, notes=notes)
        assert model is not None
    if knee is not None:
        notes.append(f"flat at {model.floor_ms:.4g} ms up to batch {knee:.0f}")
    r2, rmse, mean = _goodness(model, x, y, w)
    distinct = len(np.unique(x))
    explore: tuple[int, ...] = ()
    lo_b, hi_b = float(x.min()), float(x.max())
    if hi_b - lo_b < 0.1 * hi_b:
        notes.append(
            f"batch sizes span only {lo_b:.0f}..{hi_b:.0f}: the slope is poorly determined"
        )
        explore = explore_batches(round(hi_b), max_batch, granularity)
    return ModelFit(
        identifiable=True,
        model=model,
        reason=f"fitted on {len(x)} observations at {distinct} batch sizes, R^2 {r2:.3f}",
        observations=n,
        used=len(x),
        trimmed=trimmed,
        distinct_batch_sizes=distinct,
        r2=r2,
        relative_rmse=rmse / mean if mean > 0 else None,
        explore=explore,
        notes=tuple(notes),
    )


def _checked(
    observations: Iterable[Observation], half_life_iterations: float | None
) -> list[Observation]:
    """The observations with a batch size of at least 1; refuses bad input."""
    rows = list(observations)
    for o in rows:
        if o.batch_size < 0 or not math.isfinite(o.compute_ms) or o.compute_ms < 0:
            raise InvalidInput(f"bad observation {o!r}", field="observations")
    _check_half_life(half_life_iterations)
    return [o for o in rows if o.batch_size >= 1]


def _check_half_life(half_life_iterations: float | None) -> None:
    if half_life_iterations is not None and not half_life_iterations > 0:
        raise InvalidInput("half_life_iterations must be positive", field="half_life_iterations")


def _weights(its: FloatArray, half_life_iterations: float | None) -> FloatArray:
    """Recency weights of observations at iterations ``its`` (ages from the latest)."""
    age = its.max() - its
    if half_life_iterations is None:
        return np.ones_like(its)
    return 0.5 ** (age / half_life_iterations)  # type: ignore[no-any-return]


def _inliers(
    x: FloatArray, y: FloatArray, w: FloatArray, robust: PerfModel, scale: float
) -> npt.NDArray[np.bool_]:
    """Observations within ``TRIM_SIGMAS`` of the robust fit; all of them when that would call
    too many outliers."""
    residuals = y - _predict(robust, x)
    keep = np.abs(residuals) <= TRIM_SIGMAS * _sigma(residuals, w, scale)
    if len(x) < MIN_TO_TRIM or int(keep.sum()) < len(x) - len(x) // 2:
        # Outliers are a minority by definition: when the robust fit would call most points
        # outliers (recency weights following a new regime), it is the form that is off.
        keep[:] = True
    return keep


def _goodness(
    model: PerfModel, x: FloatArray, y: FloatArray, w: FloatArray
) -> tuple[float, float, float]:
    """Weighted R^2, RMSE and mean of ``y`` under ``model``."""
    pred = _predict(model, x)
    sse = float(w @ (y - pred) ** 2)
    mean = float(w @ y) / float(w.sum())
    sst = float(w @ (y - mean) ** 2)
    r2 = 1.0 - sse / sst if sst > 0 else (1.0 if sse == 0 else 0.0)
    return r2, math.sqrt(sse / float(w.sum())), mean


def _not_identifiable(
    x: FloatArray,
    y: FloatArray,
    w: FloatArray,
    observations: int,
    trimmed: int,
    max_batch: int | None,
    granularity: int,
) -> ModelFit:
    b0 = round(_wmedian(x, w))
    mean = float(w @ y) / float(w.sum())
    return ModelFit(
        identifiable=False,
        model=None,
        reason=(
            f"only batch size {b0} observed (after trimming {trimmed}): per-sample cost and "
            "intercept cannot be told apart; run other batch sizes"
        ),
        observations=observations,
        used=len(x),
        trimmed=trimmed,
        distinct_batch_sizes=len(np.unique(x)),
        explore=explore_batches(b0, max_batch, granularity),
        guess=PerfModel(mean / b0) if b0 > 0 else None,
    )
