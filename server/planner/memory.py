"""The per-worker memory model: peak device memory of one pass against its batch size. Pure.

::

    mem(0) = 0
    mem(b) = base_mb + per_sample_mb * b        for b >= 1

``base_mb`` is what a pass holds whatever its batch (weights, gradients, optimizer state, the
allocator's workspace), ``per_sample_mb`` the activations of one more sample. Measured on an H100
(``tests/data/h100_tb_curves.csv``) this line holds to a few percent from small batches to
the largest that fit, for convolutional and transformer models alike.

Fit. The line is fitted to (batch size, peak MB) pairs with the time model's robust line
(:func:`server.planner.fit._robust_line`: Huber IRLS started from the per-batch-size medians,
clamped to ``per_sample >= 0`` and ``base >= 0``). Memory does not drift the way speed does, so
every observation weighs the same. With a single batch size seen the slope is unknown: the fit
is not identifiable and offers a labelled ``guess`` through the origin,
``mem(b) = (peak / b0) * b``, which over-states memory for every ``b > b0`` (the true base is
``>= 0``), so a cap derived from it is safe.

Cap. A worker's cap on a device of ``memory_mb`` with fractional ``headroom`` is the largest b
with ``mem(b) <= (1 - headroom) * memory_mb`` (0 when not even the base fits).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from server.planner.errors import InvalidInput
from server.planner.fit import _robust_line

DEFAULT_HEADROOM = 0.1
"""Fraction of a device's memory a plan leaves unused: allocator fragmentation, other tenants'
contexts and a model's own variation between steps."""
MAX_CAP = 10_000_000
"""A cap never exceeds the largest batch a job may have."""


@dataclass(frozen=True)
class MemoryModel:
    """``mem(b) = base_mb + per_sample_mb * b`` for b >= 1, ``mem(0) = 0``."""

    base_mb: float
    per_sample_mb: float

    def __post_init__(self) -> None:
        for name in ("base_mb", "per_sample_mb"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise InvalidInput(f"{name} must be finite and >= 0, got {value!r}", field=name)

    def predict(self, batch_size: int) -> float:
        """Predicted peak MB of one pass of ``batch_size`` samples."""
        if batch_size <= 0:
            return 0.0
        return self.base_mb + self.per_sample_mb * batch_size

    def cap(self, memory_mb: float, headroom: float = DEFAULT_HEADROOM) -> int:
        """The largest batch one pass fits in ``(1 - headroom) * memory_mb``."""
        if not 0 <= headroom < 1:
            raise InvalidInput(f"headroom must be in [0, 1), got {headroom!r}", field="headroom")
        usable = (1.0 - headroom) * memory_mb
        room = usable - self.base_mb
        if room < 0:
            return 0
        quotient = room // self.per_sample_mb if self.per_sample_mb > 0 else math.inf
        if quotient >= MAX_CAP:
            return MAX_CAP
        b = int(quotient)
        # Correct the division's rounding against the very expression predict evaluates.
        while b > 0 and self.predict(b) > usable:
            b -= 1
        while b < MAX_CAP and self.predict(b + 1) <= usable:
            b += 1
        return b


@dataclass(frozen=True)
class MemoryObservation:
    """One pass of one worker: its batch size and its peak memory."""

    batch_size: int
    peak_mb: float


@dataclass(frozen=True)
class MemoryFit:
    identifiable: bool
    model: MemoryModel | None
    """The fitted line; None when not identifiable (see ``guess``)."""
    reason: str
    observations: int
    distinct_batch_sizes: int
    max_relative_error: float | None = None
    """Largest ``|predicted - measured| / measured`` over the observations (identifiable fits)."""
    notes: tuple[str, ...] = ()
    guess: MemoryModel | None = None
    """When not identifiable: ``mem(b) = (peak / b0) * b``, conservative above ``b0``."""

    @property
    def usable(self) -> MemoryModel | None:
        """The model to plan with: the fit, else the labelled guess."""
        return self.model or self.guess


def fit_memory(observations: Iterable[MemoryObservation]) -> MemoryFit:
    """Fit ``mem(b)`` robustly to observations with ``batch_size >= 1`` (see the docstring)."""
    rows = list(observations)
    for o in rows:
        if o.batch_size < 0 or not math.isfinite(o.peak_mb) or o.peak_mb < 0:
            raise InvalidInput(f"bad memory observation {o!r}", field="observations")
    rows = [o for o in rows if o.batch_size >= 1]
    if not rows:
        return MemoryFit(False, None, "no pass with samples has reported its peak memory", 0, 0)
    x = np.array([o.batch_size for o in rows], dtype=np.float64)
    y = np.array([o.peak_mb for o in rows], dtype=np.float64)
    distinct = len(np.unique(x))
    if distinct < 2:
        b0 = int(x[0])
        peak = float(np.median(y))
        return MemoryFit(
            False,
            None,
            f"only batch size {b0} seen: base and per-sample memory cannot be told apart; "
            "planning with the conservative guess through the origin",
            len(rows),
            1,
            guess=MemoryModel(0.0, peak / b0),
        )
    notes: list[str] = []
    scale = max(float(np.median(y)), 1e-9)
    s, c = _robust_line(x, y, np.ones_like(x), scale, notes)
    model = MemoryModel(c, s)
    predicted = c + s * x
    error = float(np.max(np.abs(predicted - y) / np.maximum(y, 1e-9)))
    return MemoryFit(
        True,
        model,
        f"mem(b) = {c:.0f} MB + {s:.3g} MB * b over {distinct} batch sizes",
        len(rows),
        distinct,
        max_relative_error=error,
        notes=tuple(notes),
    )
