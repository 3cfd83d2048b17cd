"""The planner's input and output values: one immutable problem in, one plan out, for every policy.

A ``PlanProblem`` asks for local batch sizes ``b_i`` with

- ``sum(b_i) == global_batch``;
- ``min_batch_i <= b_i <= max_batch_i`` (no upper bound when ``max_batch`` is None);
- ``b_i`` a multiple of ``granularity`` (0 is a multiple of everything);
- ``b_i == pinned_batch_i`` for pinned workers;
- ``b_i == 0`` for a worker whose memory cap (``micro_batch``) is 0: not even one sample fits.

A worker's ``micro_batch`` is the most samples one forward/backward pass may hold (its memory
cap). It does not bound ``b_i``: a larger share runs as several passes whose gradients are
accumulated, and its predicted time counts every pass (``model.predict_passes``), so the min-max
plan gives a worker more than its cap only where the extra pass pays.

Constructing a problem checks that every value is well formed (``InvalidInput``); whether the
constraints can all hold together is decided when it is solved (``Infeasible``), by ``bounds``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from server.planner.errors import Infeasible, InvalidInput
from server.planner.model import NO_CAP, FloatArray, PerfModel, predict_many, predict_passes

IntArray = npt.NDArray[np.int64]

MAX_GLOBAL_BATCH = 10**12
"""Batch sizes stay far below 2**53, so they are exact as float64 as well."""


def _check_count(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise InvalidInput(f"{name} must be an integer, got {value!r}", field=name)
    number = int(value)
    if not minimum <= number <= MAX_GLOBAL_BATCH:
        raise InvalidInput(
            f"{name} must be between {minimum} and {MAX_GLOBAL_BATCH}, got {number}", field=name
        )
    return number


@dataclass(frozen=True)
class WorkerSpec:
    """One worker of the job: its performance model and its own constraints."""

    id: str
    model: PerfModel
    min_batch: int = 0
    """Fewest samples it may get; 0 allows leaving it idle for the iteration."""
    max_batch: int | None = None
    """Most samples it may get (its memory cap); None for no cap."""
    pinned_batch: int | None = None
    """Exactly this many samples (an operator's pin); None when free."""
    micro_batch: int | None = None
    """Most samples one pass holds (its memory cap); more run as accumulated passes. None: no
    cap; 0: not even one sample fits (the worker gets none)."""

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise InvalidInput(f"worker id must be a non-empty string, got {self.id!r}", field="id")
        if not isinstance(self.model, PerfModel):
            raise InvalidInput(f"worker {self.id}: model must be a PerfModel", field="model")
        # Store plain ints (numpy integers pass the check) so the value serialises anywhere.
        for name in ("min_batch", "max_batch", "pinned_batch", "micro_batch"):
            value = getattr(self, name)
            if value is not None:
                number = _check_count(f"worker {self.id}: {name}", value, minimum=0)
                object.__setattr__(self, name, number)


@dataclass(frozen=True)
class PlanProblem:
    """Split ``global_batch`` samples over ``workers`` (rank order) in steps of ``granularity``."""

    global_batch: int
    workers: tuple[WorkerSpec, ...]
    granularity: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "global_batch", _check_count("global_batch", self.global_batch, minimum=0)
        )
        object.__setattr__(
            self, "granularity", _check_count("granularity", self.granularity, minimum=1)
        )
        if not isinstance(self.workers, tuple):
            # Accept any sequence, but store a tuple so the value stays immutable and hashable.
            object.__setattr__(self, "workers", tuple(self.workers))
        if not self.workers:
            raise InvalidInput("a plan needs at least one worker", field="workers")
        seen: set[str] = set()
        for worker in self.workers:
            if not isinstance(worker, WorkerSpec):
                raise InvalidInput("workers must be WorkerSpec values", field="workers")
            if worker.id in seen:
                raise InvalidInput(f"worker id {worker.id!r} appears twice", field="workers")
            seen.add(worker.id)

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(w.id for w in self.workers)

    def model_arrays(self) -> tuple[FloatArray, FloatArray, FloatArray]:
        """``(per_sample_ms, intercept_ms, floor_ms)`` as float64 arrays in worker order."""
        s = np.array([w.model.per_sample_ms for w in self.workers], dtype=np.float64)
        c = np.array([w.model.intercept_ms for w in self.workers], dtype=np.float64)
        f = np.array([w.model.floor_ms for w in self.workers], dtype=np.float64)
        return s, c, f

    def micro_array(self) -> FloatArray:
        """Each worker's memory cap as float64 (``NO_CAP`` for none; at least 1)."""
        return np.array(
            [NO_CAP if w.micro_batch is None else max(1, w.micro_batch) for w in self.workers],
            dtype=np.float64,
        )

    def times(self, batch: FloatArray) -> FloatArray:
        """Predicted compute time of every worker with ``batch``, counting accumulated passes."""
        s, c, f = self.model_arrays()
        if all(w.micro_batch is None for w in self.workers):
            return predict_many(s, c, f, batch)
        return predict_passes(s, c, f, self.micro_array(), batch)

    def bounds(self) -> tuple[IntArray, IntArray]:
        """Smallest and largest admissible batch of every worker, or ``Infeasible`` saying why.

        Worker i may take the multiples of g in ``[lo_i, hi_i]`` (every one of them), where
        ``lo_i = g * ceil(min_i / g)`` and ``hi_i = g * floor(min(max_i, B) / g)``, or exactly its
        pin. With B a multiple of g, every total between ``sum(lo)`` and ``sum(hi)`` in steps of g
        is reachable, so the problem is feasible exactly when ``sum(lo) <= B <= sum(hi)``.
        """
        g, total = self.granularity, self.global_batch
        if total % g:
            raise Infeasible(
                f"global_batch {total} is not a multiple of granularity {g}",
                constraint="granularity",
            )
        lo = np.empty(len(self.workers), dtype=np.int64)
        hi = np.empty(len(self.workers), dtype=np.int64)
        for i, w in enumerate(self.workers):
            lo[i], hi[i] = _worker_bounds(w, g, total)
        if int(lo.sum()) > total:
            pinned = sum(w.pinned_batch for w in self.workers if w.pinned_batch is not None)
            raise Infeasible(
                f"pinned batches ({pinned}) plus minimum batches add up to {int(lo.sum())}, "
                f"more than global_batch {total}",
                constraint="minimums",
            )
        if int(hi.sum()) < total:
            raise Infeasible(
                f"capacity: the workers can take at most {int(hi.sum())} samples in all "
                f"(max_batch, pins and granularity {g}), less than global_batch {total}",
                constraint="capacity",
            )
        return lo, hi


def _worker_bounds(w: WorkerSpec, g: int, total: int) -> tuple[int, int]:
    lo_raw = w.min_batch
    hi_raw = total if w.max_batch is None else min(w.max_batch, total)
    if w.micro_batch == 0:  # not even one sample fits in the device's memory
        hi_raw = 0
        asked = w.pinned_batch or w.min_batch
        if asked:
            raise Infeasible(
                f"worker {w.id}: not one sample fits its memory (memory cap 0), yet it must "
                f"take {asked}",
                constraint="worker_bounds",
                worker=w.id,
            )
    if w.max_batch is not None and w.min_batch > w.max_batch:
        raise Infeasible(
            f"worker {w.id}: min_batch {w.min_batch} > max_batch {w.max_batch}",
            constraint="worker_bounds",
            worker=w.id,
        )
    if w.pinned_batch is not None:
        pin = w.pinned_batch
        if pin < w.min_batch or (w.max_batch is not None and pin > w.max_batch):
            raise Infeasible(
                f"worker {w.id}: pinned_batch {pin} is outside its bounds "
                f"[{w.min_batch}, {w.max_batch if w.max_batch is not None else 'inf'}]",
                constraint="worker_bounds",
                worker=w.id,
            )
        if pin % g:
            raise Infeasible(
                f"worker {w.id}: pinned_batch {pin} is not a multiple of granularity {g}",
                constraint="worker_bounds",
                worker=w.id,
            )
        return pin, pin
    lo = -(-lo_raw // g) * g
    hi = (hi_raw // g) * g
    if lo > hi:
        if w.max_batch is not None and lo > w.max_batch:
            raise Infeasible(
                f"worker {w.id}: no multiple of granularity {g} lies in "
                f"[min_batch {w.min_batch}, max_batch {w.max_batch}]",
                constraint="worker_bounds",
                worker=w.id,
            )
        raise Infeasible(
            f"worker {w.id}: min_batch {w.min_batch} (rounded up to granularity {g}: {lo}) "
            f"exceeds global_batch {total}",
            constraint="minimums",
            worker=w.id,
        )
    return lo, hi


@dataclass(frozen=True)
class Allocation:
    """Local batch sizes for one problem, with their predicted times. Do not mutate the dicts."""

    batch_sizes: dict[str, int]
    """Samples per worker, in worker (rank) order; sums to the problem's global batch."""
    predicted_ms: dict[str, float]
    """Each worker's predicted compute time with its batch."""
    makespan_ms: float
    """Predicted iteration compute time: the largest predicted time."""
    lower_bound_ms: float
    """No plan of this problem can have a smaller makespan (continuous relaxation)."""
    optimal: bool
    """True when ``makespan_ms`` is proven to be the least possible."""
    policy: str

    @property
    def batch_list(self) -> list[int]:
        """Batch sizes as a list in worker order, as the wire contract carries them."""
        return list(self.batch_sizes.values())

    @property
    def gap(self) -> float:
        """Relative distance of the makespan above the lower bound (0 when they meet)."""
        if self.makespan_ms <= self.lower_bound_ms or self.makespan_ms == 0:
            return 0.0
        return (self.makespan_ms - self.lower_bound_ms) / self.makespan_ms


def make_plan(
    problem: PlanProblem,
    batches: IntArray,
    *,
    lower_bound_ms: float,
    optimal: bool,
    policy: str,
) -> Allocation:
    """Wrap solver output in an ``Allocation``, checking every constraint one last time.

    A violation here is a planner bug, never a property of the input, so it is an AssertionError
    rather than ``Infeasible``.
    """
    lo, hi = problem.bounds()
    g = problem.granularity
    if int(batches.sum()) != problem.global_batch:
        raise AssertionError(f"plan sums to {int(batches.sum())}, not {problem.global_batch}")
    if np.any(batches < lo) or np.any(batches > hi) or np.any(batches % g):
        raise AssertionError("plan violates a worker's bounds, pin or the granularity")
    times = problem.times(batches.astype(np.float64))
    ids = problem.ids
    makespan = float(times.max())
    return Allocation(
        batch_sizes={i: int(b) for i, b in zip(ids, batches, strict=True)},
        predicted_ms={i: float(t) for i, t in zip(ids, times, strict=True)},
        makespan_ms=makespan,
        lower_bound_ms=min(lower_bound_ms, makespan) if math.isfinite(lower_bound_ms) else 0.0,
        optimal=optimal,
        policy=policy,
    )
