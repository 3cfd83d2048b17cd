"""Change-point detection on one rank's log-ratio series: two CUSUMs with a robust noise scale.

Signal. For every timing with batch b > 0 the rank's log-ratio is ``x = log(measured / ref(b))``,
where ``ref`` is its performance model (or, without one, its own median ms per sample: a labelled
fallback). A multiplicative slowdown by f adds ``log f`` to x whatever the batch size, so plan
changes do not disturb the signal, and multiplicative noise becomes additive.

Normal level and noise. While no event is open, the rank keeps its last ``baseline_window``
log-ratios. Once it has ``min_samples`` of them, the normal level ``mu`` is their median (the
model's bias; clamped to ``+-log(max_bias)``, so a model far off from the start does not become
"normal") and the noise scale is their MAD, ``sigma = 1.4826 * median(|x_j - mu|)``, which the
few slow samples before an event opens cannot inflate (they are removed from the baseline when it
opens). Before that, ``mu = 0`` (trust the model) and ``sigma = sigma_prior``.

Onset (Page's CUSUM). With the least slowdown of interest ``delta = log(min_factor)``::

    k = max(delta / 2, k_sigmas * sigma)          drift: what noise alone must not accumulate
    h = max(h, h_sigmas * sigma)                  threshold
    S_t = max(0, S_t-1 + x_t - mu - k)            an event opens when S_t > h

The onset estimate is the first iteration of the current positive run of S (the classical CUSUM
change-point estimate). A slowdown f adds ``log f - k`` per sample: with the defaults 10x and 3x
cross h = 0.6 in one sample, 1.5x in three. Noise of +-10% does not: uniform noise stays below k
(no positive increment at all); Gaussian noise with sigma 0.1 needs a run of 2-sigma excursions
worth six sigmas (Siegmund's approximation puts the in-control run length near 10^6 samples; none
fired in 4 * 10^5 simulated ones).

Class. The event opens as TRANSIENT and becomes DYNAMIC once it has lasted
``sustain_iterations`` iterations from its onset without recovering (see ``StragglerKind``) and
its newest sample is not on its way back (the recovery test below is not running: a rank measured
only now and then, by probes while excluded, is not confirmed on age alone), or
sooner, after ``fast_sustain_iterations``, when every sample since the onset is at least
``fast_factor`` times the normal level: every iteration such a slowdown goes unanswered costs the
job a large share of an iteration, more than a false alarm's plan costs over the ladder's
cool-down. A spike of up to ``fast_sustain_iterations - 1`` samples still closes as TRANSIENT:
by the time the severe rule could confirm it, a normal sample has come in.

Acting before confirmation. An event still TRANSIENT whose every sample is at least
``act_factor`` (1.75x) for ``act_iterations`` (1) is reported ``actionable``
(``RankHealth.actionable``): the ladder may act on it at once, provisionally. Every iteration such
a slowdown goes unanswered costs the job a large share of an iteration, while a false alarm (a
spike) costs a plan biased against a rank that recovered for the iterations it takes to see the
recovery (a 3x event closes after two normal samples, a 4x one after one) and two plan changes,
because the ladder undoes a provisional change as soon as its event closes unconfirmed, without
waiting out its cool-down. The classification is unchanged: such a spike still closes as
TRANSIENT (with the action taken recorded).

Recovery (a second CUSUM, towards normal). With ``level`` the median of the last
``level_window`` log-ratios of the event::

    m = mu + max((level - mu) / 2, k)             half-way between slow and normal
    D_t = max(0, D_t-1 + m - x_t)                 recovered when D_t > h ...

... and the samples since the start of the current positive run of D have a median below
``mu + delta`` (so a step down from 10x to 3x lowers the level instead of closing the event). The
end of the event is the first iteration of that run. A 1.5x event recovers in about four samples,
a 3x one in two, a 10x one in one.

Batch sizes the reference cannot predict. A worker's time is non-decreasing in its batch size,
so a batch smaller than one whose time is known takes at most that time; how much less, the
reference may not know. Two cases are judged by that bound alone:

- an epoch's final partial batch (``batch < planned``: the plan gave the rank more samples than
  were left). Its model was fitted on the plan's sizes, and a few samples take the fixed cost of
  a kernel launch or a collective's set-up, which a line extrapolated down to them leaves out;
- with the ``"self"`` reference (ms per sample: no intercept), a batch below every batch size
  the reference was learned from.

Such a sample is judged against the time of the batch it is bounded by (the plan's, or the
smallest learned) ::

    x = log(measured / ref(bound))

It counts only as evidence that the rank is slow (``x`` above its normal level by more than the
drift k: slower than the larger batch would be), never as evidence of normal speed: while no
event is open it may add to the onset CUSUM, it never enters the baseline, and while an event is
open it is left out (its time can show neither the level nor a recovery). A rank whose times
match its model therefore never opens an event at an epoch's tail, however far the model is off
below the sizes it was fitted on.

State is plain data (``RankState``: ints, floats, lists, strings), so the detector can be
serialised, stored and rebuilt.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from dataclasses import dataclass, field
from functools import cached_property
from statistics import median
from typing import Any

from server.planner import PerfModel
from server.stragglers.event import Change, EventUpdate, StragglerEvent, StragglerKind

MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True)
class DetectorConfig:
    """Tuning of the detector; the defaults meet the targets in the package docstring."""

    min_factor: float = 1.25
    """Least sustained slowdown worth an event; sets the CUSUM drift k = log(min_factor) / 2."""
    h: float = 0.6
    """Least CUSUM threshold, in log-ratio units (both the onset and the recovery test)."""
    h_sigmas: float = 5.0
    """Threshold in noise sigmas, used when larger than ``h`` (noisy ranks)."""
    k_sigmas: float = 1.0
    """Drift in noise sigmas, used when larger than ``log(min_factor) / 2``."""
    sigma_prior: float = 0.05
    """Noise scale of the log-ratio before ``min_samples`` normal samples are in."""
    sigma_floor: float = 0.005
    min_samples: int = 8
    """Normal samples needed to estimate mu and sigma (and a fallback reference model)."""
    baseline_window: int = 64
    max_bias: float = 1.25
    """The learned normal level may put a model off by at most this factor either way."""
    sustain_iterations: int = 4
    """Iterations from the onset after which an unrecovered event is DYNAMIC, not TRANSIENT."""
    fast_factor: float = 1.75
    """A slowdown whose every sample since the onset is this severe is confirmed sooner..."""
    fast_sustain_iterations: int = 3
    """... after this many iterations from the onset (see the module docstring)."""
    act_factor: float = 1.75
    """An unconfirmed (TRANSIENT) event whose every sample is this severe ..."""
    act_iterations: int = 1
    """... for this many iterations is reported as ``actionable``: the ladder may act before it is
    confirmed (see the module docstring); its class is not changed by this."""
    level_window: int = 8
    """Recent samples whose median is the event's current level (and the ladder's ratio)."""
    event_memory: int = 256
    """Samples of an event kept for its severity (the median over at most these)."""
    severity_step: float = 0.1
    """An UPDATED is emitted when severity moves by more than this fraction since the last."""

    def __post_init__(self) -> None:
        positive = ("h", "h_sigmas", "sigma_prior", "sigma_floor", "severity_step")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"DetectorConfig.{name} must be > 0")
        for name in ("min_factor", "max_bias", "fast_factor", "act_factor"):
            if not getattr(self, name) > 1:
                raise ValueError(f"DetectorConfig.{name} must be > 1")
        if self.k_sigmas < 0:
            raise ValueError("DetectorConfig.k_sigmas must be >= 0")
        counts = (
            "min_samples",
            "baseline_window",
            "sustain_iterations",
            "fast_sustain_iterations",
            "act_iterations",
            "level_window",
        )
        for name in (*counts, "event_memory"):
            if getattr(self, name) < 1:
                raise ValueError(f"DetectorConfig.{name} must be >= 1")
        if self.baseline_window < max(self.min_samples, 3):
            raise ValueError("DetectorConfig.baseline_window must be >= min_samples and >= 3")

    @cached_property
    def delta(self) -> float:
        return math.log(self.min_factor)

    @cached_property
    def bias_bound(self) -> float:
        """``log(max_bias)``: how far the normal level may move either way."""
        return math.log(self.max_bias)


@dataclass
class RankState:
    """Everything the detector remembers about one rank; plain data only."""

    rank: int
    last_iteration: int = -1
    ref: list[float] | None = None
    """Reference model ``[per_sample_ms, intercept_ms, floor_ms]``; frozen while an event is open."""
    ref_source: str = ""
    """``"model"`` (the fitted model) or ``"self"`` (own median ms per sample: no model known)."""
    self_rates: list[float] = field(default_factory=list)
    self_batches: list[int] = field(default_factory=list)
    """Batch sizes of the samples ``self_rates`` came from (a smaller one is only bounded)."""
    base_its: list[int] = field(default_factory=list)
    base: list[float] = field(default_factory=list)
    """Log-ratios of the latest normal samples (and their iterations)."""
    base_sorted: list[float] = field(default_factory=list)
    """``base`` in ascending order, kept up to date as samples come and go (``baseline`` runs
    for every sample of every rank; sorting the window each time was most of its cost). A
    length that differs from ``base``'s (state from before this field) is sorted afresh."""
    up: float = 0.0
    up_from: int | None = None
    run: list[float] = field(default_factory=list)
    """Log-ratios since ``up_from`` (they seed the event's level when it opens)."""
    # The open dynamic or transient event; ``start`` is None when there is none.
    start: int | None = None
    detected: int = 0
    confirmed: int | None = None
    kind: str = ""
    mu: float = 0.0
    k: float = 0.0
    h: float = 0.0
    logs: list[float] = field(default_factory=list)
    peak: float = 0.0
    down: float = 0.0
    down_from: int | None = None
    down_its: list[int] = field(default_factory=list)
    down_logs: list[float] = field(default_factory=list)
    reported: float = 1.0


def _ref_predict(ref: list[float], batch: int) -> float:
    return max(ref[2], ref[1] + ref[0] * batch)


def _trim(values: list[Any], keep: int) -> None:
    if len(values) > keep:
        del values[: len(values) - keep]


def baseline(state: RankState, config: DetectorConfig) -> tuple[float, float]:
    """``(mu, sigma)``: the rank's normal level and noise scale (see the module doc)."""
    if len(state.base) < config.min_samples:
        return 0.0, config.sigma_prior
    if len(state.base_sorted) != len(state.base):
        state.base_sorted = sorted(state.base)
    bound = config.bias_bound
    # Called for every sample of every rank: from the kept sorted window, the median and the
    # median deviation from it without building the deviations (``statistics.median``'s own
    # arithmetic on the same values, so the same result to the last bit).
    center = _median_of_sorted(state.base_sorted)
    mu = min(bound, max(-bound, center))
    sigma = MAD_TO_SIGMA * median_deviation(state.base_sorted, center)
    return mu, max(config.sigma_floor, sigma)


def _median_of_sorted(data: list[float]) -> float:
    """``statistics.median`` of an already sorted, non-empty list."""
    n = len(data)
    i = n // 2
    return data[i] if n % 2 == 1 else (data[i - 1] + data[i]) / 2


def median_deviation(data: list[float], center: float) -> float:
    """``statistics.median(abs(v - center) for v in data)`` of a sorted, non-empty ``data``, in
    O(log n) steps: deviations fall then rise along sorted data, so the ``m`` smallest are those
    of a run of ``m`` neighbouring values, and the largest of a run is at one of its ends. The
    run of the ``n // 2 + 1`` nearest values is found by bisection (the "k closest elements"
    search); its largest deviation is the median's upper middle, and for an even ``n`` the run
    less that end holds the lower middle."""
    n = len(data)
    m = n // 2 + 1
    lo, hi = 0, n - m
    while lo < hi:
        mid = (lo + hi) // 2
        if center - data[mid] > data[mid + m] - center:
            lo = mid + 1
        else:
            hi = mid
    first, last = abs(data[lo] - center), abs(data[lo + m - 1] - center)
    upper = max(first, last)
    if n % 2 == 1:
        return upper
    if first >= last:  # the run without its first value
        lower = max(abs(data[lo + 1] - center), last)
    else:  # the run without its last value
        lower = max(first, abs(data[lo + m - 2] - center))
    return (lower + upper) / 2


def _keep_base(state: RankState, config: DetectorConfig) -> None:
    """Trim the baseline to its window after samples were added, and the sorted copy with it."""
    excess = len(state.base) - config.baseline_window
    if excess > 0:
        for old in state.base[:excess]:
            del state.base_sorted[bisect_left(state.base_sorted, old)]
        del state.base[:excess]
    _trim(state.base_its, config.baseline_window)


def current_level(state: RankState, config: DetectorConfig) -> float:
    """Current measured/predicted ratio: the event's recent median, or the normal level."""
    if state.start is not None and state.logs:
        return math.exp(median(state.logs[-config.level_window :]))
    return math.exp(baseline(state, config)[0])


def _update_ref(
    state: RankState, batch: int, ms: float, model: PerfModel | None, config: DetectorConfig
) -> None:
    if model is not None:
        state.ref = [model.per_sample_ms, model.intercept_ms, model.floor_ms]
        state.ref_source = "model"
        return
    if state.ref_source == "model":
        return  # keep the last model rather than switch the reference under a running baseline
    if _bound(state, batch, None) is not None:
        return  # below what it was learned from: ms per sample would overstate its time
    state.self_rates.append(ms / batch)
    state.self_batches.append(batch)
    _trim(state.self_rates, config.baseline_window)
    _trim(state.self_batches, config.baseline_window)
    if len(state.self_rates) >= config.min_samples:
        state.ref = [median(state.self_rates), 0.0, 0.0]
        state.ref_source = "self"


def event_of(state: RankState) -> StragglerEvent | None:
    """The rank's open dynamic or transient event, as a value."""
    if state.start is None:
        return None
    return StragglerEvent(
        rank=state.rank,
        kind=StragglerKind(state.kind),
        start_iteration=state.start,
        end_iteration=None,
        severity=math.exp(median(state.logs) - state.mu) if state.logs else 1.0,
        detected_iteration=state.detected,
        confirmed_iteration=state.confirmed,
        peak=math.exp(state.peak),
    )


def observe_sample(
    state: RankState,
    iteration: int,
    batch: int,
    ms: float,
    model: PerfModel | None,
    config: DetectorConfig,
    planned: int | None = None,
) -> list[EventUpdate]:
    """Feed one timing of the rank (iterations ascending); return what changed.

    ``planned`` is the rank's batch in the plan in force, when known: a smaller ``batch`` is an
    epoch's final partial batch (module docstring).
    """
    if iteration <= state.last_iteration:
        return []  # late or duplicate
    state.last_iteration = iteration
    if batch <= 0 or not ms > 0 or not math.isfinite(ms):
        return []  # computed nothing: says nothing about its speed
    partial = planned is not None and batch < planned
    if state.start is None and not partial:
        _update_ref(state, batch, ms, model, config)
    if state.ref is None:
        return []
    bound = _bound(state, batch, planned if partial else None)
    predicted = _ref_predict(state.ref, bound or batch)
    if predicted <= 0:
        return []
    x = math.log(ms / predicted)
    if state.start is None:
        return _normal(state, iteration, x, config, exact=bound is None)
    if bound is not None:
        return []  # a bound cannot show the event's level, nor a recovery
    return _in_event(state, iteration, x, config)


def _bound(state: RankState, batch: int, planned: int | None) -> int | None:
    """The batch size whose reference time bounds this sample's from above, when its own cannot
    be predicted (module docstring); None when it can."""
    if planned is not None:
        return planned
    learned = state.self_batches
    # ``learned[-1]`` first: a batch below the least is below the last (no scan of the window
    # per sample while the batch sizes stay)
    if state.ref_source == "self" and learned and batch < learned[-1] and batch < min(learned):
        return min(learned)
    return None


def _normal(
    state: RankState, iteration: int, x: float, config: DetectorConfig, *, exact: bool = True
) -> list[EventUpdate]:
    mu, sigma = baseline(state, config)
    k = max(config.delta / 2, config.k_sigmas * sigma)
    h = max(config.h, config.h_sigmas * sigma)
    z = x - mu - k
    if not exact and z <= 0:
        return []  # within its bound: no evidence either way
    if state.up <= 0 and z > 0:
        state.up_from, state.run = iteration, []
    state.up = max(0.0, state.up + z)
    if state.up > 0:
        state.run.append(x)
        _trim(state.run, config.event_memory)
    else:
        state.up_from, state.run = None, []
    if state.up <= h or state.up_from is None:
        if not exact:
            return []  # one-sided evidence never enters the baseline
        state.base_its.append(iteration)
        state.base.append(x)
        if len(state.base_sorted) == len(state.base) - 1:
            insort(state.base_sorted, x)
        else:  # state from before ``base_sorted``
            state.base_sorted = sorted(state.base)
        _keep_base(state, config)
        return []
    # Open: the samples of the run belong to the event, not to the normal baseline.
    start = state.up_from
    keep = [i for i, it in enumerate(state.base_its) if it < start]
    state.base_its = [state.base_its[i] for i in keep]
    state.base = [state.base[i] for i in keep]
    state.base_sorted = sorted(state.base)
    state.start, state.detected, state.confirmed = start, iteration, None
    state.kind = StragglerKind.TRANSIENT.value
    state.mu, state.k, state.h = mu, k, h
    state.logs = list(state.run)
    state.peak = max(state.logs) - mu
    state.down, state.down_from, state.down_its, state.down_logs = 0.0, None, [], []
    state.up, state.up_from, state.run = 0.0, None, []
    if _sustained(state, iteration, config):
        state.kind, state.confirmed = StragglerKind.DYNAMIC.value, iteration
    event = event_of(state)
    assert event is not None
    state.reported = event.severity
    return [EventUpdate(Change.OPENED, event, iteration)]


def _in_event(
    state: RankState, iteration: int, x: float, config: DetectorConfig
) -> list[EventUpdate]:
    assert state.start is not None
    state.logs.append(x)
    _trim(state.logs, config.event_memory)
    state.peak = max(state.peak, x - state.mu)
    level = median(state.logs[-config.level_window :])
    middle = state.mu + max((level - state.mu) / 2, state.k)
    z = middle - x
    if state.down <= 0 and z > 0:
        state.down_from, state.down_its, state.down_logs = iteration, [], []
    state.down = max(0.0, state.down + z)
    if state.down > 0:
        state.down_its.append(iteration)
        state.down_logs.append(x)
        _trim(state.down_its, config.event_memory)
        _trim(state.down_logs, config.event_memory)
    else:
        state.down_from, state.down_its, state.down_logs = None, [], []
    recovered = (
        state.down > state.h
        and state.down_from is not None
        and median(state.down_logs) < state.mu + config.delta
    )
    if recovered:
        return [_close(state, iteration, config)]
    event = event_of(state)
    assert event is not None
    if state.kind == StragglerKind.TRANSIENT and _sustained(state, iteration, config):
        state.kind, state.confirmed = StragglerKind.DYNAMIC.value, iteration
        state.reported = event.severity
        return [EventUpdate(Change.UPDATED, event_of(state) or event, iteration)]
    if abs(math.log(event.severity / state.reported)) > math.log1p(config.severity_step):
        state.reported = event.severity
        return [EventUpdate(Change.UPDATED, event, iteration)]
    return []


def actionable(state: RankState, iteration: int, config: DetectorConfig) -> bool:
    """Whether the open event is an unconfirmed one the ladder may act on (module docstring)."""
    if state.start is None or state.kind != StragglerKind.TRANSIENT.value or not state.logs:
        return False
    age = iteration - state.start + 1
    return age >= config.act_iterations and min(state.logs) - state.mu >= math.log(
        config.act_factor
    )


def _sustained(state: RankState, iteration: int, config: DetectorConfig) -> bool:
    """Whether the open event has lasted long enough to be DYNAMIC (module docstring)."""
    assert state.start is not None
    if state.down > 0:
        return False  # the newest sample is on its way back to normal: not evidence it lasts
    age = iteration - state.start + 1
    if age >= config.sustain_iterations:
        return True
    return (
        age >= config.fast_sustain_iterations
        and bool(state.logs)
        and min(state.logs) - state.mu >= math.log(config.fast_factor)
    )


def _close(state: RankState, iteration: int, config: DetectorConfig) -> EventUpdate:
    assert state.start is not None and state.down_from is not None
    slow = state.logs[: len(state.logs) - len(state.down_logs)] or state.logs
    event = StragglerEvent(
        rank=state.rank,
        kind=StragglerKind(state.kind),
        start_iteration=state.start,
        end_iteration=max(state.down_from, state.start + 1),
        severity=math.exp(median(slow) - state.mu),
        detected_iteration=state.detected,
        confirmed_iteration=state.confirmed,
        peak=math.exp(state.peak),
    )
    # The recovered samples are normal ones: they restart the baseline.
    state.base_its.extend(state.down_its)
    state.base.extend(state.down_logs)
    _trim(state.base_its, config.baseline_window)
    _trim(state.base, config.baseline_window)
    state.base_sorted = sorted(state.base)
    state.start, state.confirmed, state.kind, state.logs = None, None, "", []
    state.down, state.down_from, state.down_its, state.down_logs = 0.0, None, [], []
    return EventUpdate(Change.CLOSED, event, iteration)
