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
