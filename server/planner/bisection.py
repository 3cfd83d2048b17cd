"""Exact bisection over the non-negative doubles.

For non-negative IEEE-754 doubles, the order of the values is the order of their bit patterns read
as 64-bit integers, and consecutive integers are consecutive doubles. Bisecting on the bit pattern
therefore finds, in at most 63 halvings, the *smallest double* at which a monotone predicate holds:
no tolerance, no "close enough". The min-max solver uses this to land exactly on a candidate
makespan; the policies use it to find a water level.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable


def to_bits(x: float) -> int:
    """The bit pattern of a non-negative double as an integer (order-preserving)."""
    if not x >= 0 or math.isnan(x):
        raise ValueError(f"expected a non-negative double, got {x!r}")
    (bits,) = struct.unpack("<q", struct.pack("<d", x + 0.0))  # + 0.0 turns -0.0 into 0.0
    return int(bits)


def from_bits(bits: int) -> float:
    """The double whose bit pattern is ``bits`` (inverse of ``to_bits``)."""
    (value,) = struct.unpack("<d", struct.pack("<q", bits))
    return float(value)


def least_true(holds: Callable[[float], bool], low: float, high: float) -> float:
    """Smallest double ``x`` in ``(low, high]`` with ``holds(x)``.

    Requires ``0 <= low < high``, ``holds(high)`` true, ``holds(low)`` false and ``holds``
    monotone (false then true) on ``[low, high]``. Invariant of the loop: ``holds(from_bits(lo))``
    is false and ``holds(from_bits(hi))`` true; it stops when they are adjacent doubles, so ``hi``
    is the first double where the predicate holds.
    """
    lo, hi = to_bits(low), to_bits(high)
    if lo >= hi:
        raise ValueError(f"empty interval ({low}, {high}]")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if holds(from_bits(mid)):
            hi = mid
        else:
            lo = mid
    return from_bits(hi)
