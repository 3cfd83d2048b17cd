"""The per-worker performance model: compute time of one iteration against local batch size.

::

    t(0) = 0
    t(b) = max(floor_ms, intercept_ms + per_sample_ms * b)      for b >= 1

``per_sample_ms`` is the marginal cost of one more sample once the device is saturated,
``intercept_ms`` the fixed cost of an iteration (kernel launches, optimizer step, ...), and
``floor_ms`` the flat region of an under-used device: for b below the knee
``(floor_ms - intercept_ms) / per_sample_ms`` the time does not fall any further. A worker given no
samples computes nothing, so t jumps from 0 to ``t(1) = max(floor, intercept + per_sample)``.

With all three parameters >= 0, t is non-decreasing in b, and so is its floating-point evaluation
``max(f, c + s*b)`` (IEEE rounding is monotone). The exact min-max solver relies on exactly this,
and every function here evaluates t with the same operations, so a scalar ``predict`` and the
vectorised ``predict_many`` agree bit for bit.

Gradient accumulation. A worker whose batch exceeds its memory cap ``m`` (the most samples one
forward/backward pass holds) runs it as ``k = b // m`` full passes of ``m`` and one pass of the
remainder ``r = b - k m`` (none when ``r = 0``), summing the gradients; its time is
``k * t(m) + t(r)`` (``predict_passes``). Evaluated as ``fl(k P) + min(t(r), fl((k+1) P) - fl(k P))``
with ``P = t(m)``: the difference is exact (Sterbenz: the two multiples are within a factor 2 for
``k >= 1``), so the sum at ``r = m - 1`` never exceeds ``fl((k+1) P)``, the time at ``b = (k+1) m``,
and the floating-point evaluation stays non-decreasing in b, which the exact solver needs. With no
cap (``m`` = :data:`NO_CAP`) it is bit for bit ``predict_many``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from server.planner.errors import InvalidInput

FloatArray = npt.NDArray[np.float64]


def _check_param(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(f"{name} must be a number, got {value!r}", field=name)
    if not math.isfinite(value) or value < 0:
        raise InvalidInput(f"{name} must be finite and >= 0, got {value!r}", field=name)


@dataclass(frozen=True)
class PerfModel:
    """``t(b) = max(floor_ms, intercept_ms + per_sample_ms * b)`` for b >= 1 and ``t(0) = 0``."""

    per_sample_ms: float
    """Milliseconds per additional sample on a saturated device (1000 / samples per second)."""
    intercept_ms: float = 0.0
    """Fixed milliseconds per iteration that do not depend on the batch size."""
    floor_ms: float = 0.0
    """Least time of a non-empty iteration: the flat region of an under-used device."""

    def __post_init__(self) -> None:
        _check_param("per_sample_ms", self.per_sample_ms)
        _check_param("intercept_ms", self.intercept_ms)
        _check_param("floor_ms", self.floor_ms)

    def predict(self, batch_size: int) -> float:
        """Predicted compute milliseconds of one iteration with ``batch_size`` samples."""
        if batch_size < 0:
            raise InvalidInput(f"batch_size must be >= 0, got {batch_size}", field="batch_size")
        if batch_size == 0:
            return 0.0
        return max(self.floor_ms, self.intercept_ms + self.per_sample_ms * float(batch_size))

    @property
    def knee(self) -> float:
        """Batch size where the linear part meets the floor (0 when there is no flat region)."""
        if self.floor_ms <= self.intercept_ms:
            return 0.0
        if self.per_sample_ms == 0:
            return math.inf
        return (self.floor_ms - self.intercept_ms) / self.per_sample_ms

    @property
    def samples_per_s(self) -> float:
        """Asymptotic throughput ``1000 / per_sample_ms`` (inf for a zero marginal cost)."""
        return math.inf if self.per_sample_ms == 0 else 1000.0 / self.per_sample_ms


def predict_many(
    per_sample: FloatArray, intercept: FloatArray, floor: FloatArray, batch: FloatArray
) -> FloatArray:
    """Vectorised ``PerfModel.predict``: the same floating-point operations, element by element."""
    busy = np.maximum(floor, intercept + per_sample * batch)
    return np.where(batch > 0, busy, 0.0)


NO_CAP = 2.0**62
"""The memory cap of a worker without one: far above any batch, so ``b // NO_CAP == 0``."""


def predict_passes(
    per_sample: FloatArray,
    intercept: FloatArray,
    floor: FloatArray,
    micro: FloatArray,
    batch: FloatArray,
) -> FloatArray:
    """Compute time of ``batch`` run in passes of at most ``micro`` samples (see the module
    docstring); ``micro >= 1`` everywhere (``NO_CAP`` for none)."""
    full = np.floor(batch / micro)
    rest = batch - full * micro
    one = predict_many(per_sample, intercept, floor, micro)
    done = full * one
    step = (full + 1.0) * one - done
    return done + np.minimum(predict_many(per_sample, intercept, floor, rest), step)


def predict_accumulated(model: PerfModel, batch_size: int, micro_batch: int | None) -> float:
    """``predict_passes`` for one worker (``model.predict`` when it has no cap)."""
    if micro_batch is None or batch_size <= micro_batch:
        return model.predict(batch_size)
    one = np.array([1.0])
    return float(
        predict_passes(
            one * model.per_sample_ms,
            one * model.intercept_ms,
            one * model.floor_ms,
            one * max(1, micro_batch),
            one * batch_size,
        )[0]
    )


def passes(batch_size: int, micro_batch: int | None) -> int:
    """Forward/backward passes a worker runs for ``batch_size`` samples under its cap."""
    if batch_size <= 0:
        return 0
    if micro_batch is None or micro_batch <= 0:
        return 1
    return -(-batch_size // micro_batch)
