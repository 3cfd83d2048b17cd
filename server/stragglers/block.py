"""The quiet ranks of a wide job, judged an iteration at a time as arrays.

Most samples of most ranks are quiet: the rank has no open event, its onset CUSUM is at zero,
its reference is its fitted model, its baseline window is full, and the sample is no slower
than its normal level plus the drift k (``z <= 0``). Such a sample only enters the baseline:
the oldest log-ratio leaves, the new one comes in, and the CUSUM stays at zero. Taken a sample
at a time in Python, that path would be a large share of the controller's time at fleet scale,
where most rows come from wide jobs.

A ``QuietBlock`` keeps those ranks' baselines as arrays, ``(ranks, baseline_window)``: the
window in time order as a ring, and the same values sorted, so a baseline is two middle columns
and a partition of the deviations. ``QuietBlock.step`` takes one iteration's samples of block
ranks and commits the quiet ones, with the same arithmetic as ``changepoint.observe_sample``
(the same IEEE operations in the same order, ``math.log`` for the log-ratio), so its state is
the scalar path's to the last bit. A sample that is anything else (an epoch's partial batch, a
rank without a model, ``z > 0``) is not touched: the rank leaves the block (its
``RankState`` is written back first) and the scalar path judges the sample, as it judges every
sample of a narrow job. A rank comes back into a block once it is quiet again
(``quiet``; the detector rebuilds its block then).

While a rank is in the block its ``RankState``'s window, iteration and reference are stale;
``write_back`` brings them up to date (the detector does before anything reads them: health,
``to_dict``). Its event fields are never stale: a rank in the block has no event.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from server.planner import PerfModel
from server.stragglers.changepoint import MAD_TO_SIGMA, DetectorConfig, RankState

Floats = npt.NDArray[np.float64]
_NAN = math.nan
Ints = npt.NDArray[np.int64]


def quiet(state: RankState, config: DetectorConfig) -> bool:
    """Whether ``state`` may be judged in a block: no event, no onset under way, its reference
    a fitted model and a full baseline window."""
    window = config.baseline_window
    return (
        state.start is None
        and state.up == 0.0
        and state.up_from is None
        and not state.run
        and state.ref_source == "model"
        and state.ref is not None
        and len(state.base) == window
        and len(state.base_its) == window
        and len(state.base_sorted) == window
    )


def _middle(s: Floats) -> Floats:
    """The median of each row of sorted rows (``statistics.median``'s arithmetic)."""
    n = s.shape[1]
    i = n // 2
    return s[:, i] if n % 2 == 1 else (s[:, i - 1] + s[:, i]) / 2


class QuietBlock:
    """Quiet ranks' baselines as arrays; see the module docstring."""

    def __init__(self, states: Sequence[RankState], config: DetectorConfig) -> None:
        self.config = config
        self.states = list(states)
        self.rows = {s.rank: i for i, s in enumerate(self.states)}
        """rank -> its row, for the ranks still in the block."""
        self.base: Floats = np.array([s.base for s in self.states], dtype=np.float64)
        """Each row's window in time order from ``head`` (a ring: the oldest at ``head``)."""
        self.its: Ints = np.array([s.base_its for s in self.states], dtype=np.int64)
        self.head: Ints = np.zeros(len(self.states), dtype=np.int64)
        self.sorted: Floats = np.array([s.base_sorted for s in self.states], dtype=np.float64)
        self.last: Ints = np.array([s.last_iteration for s in self.states], dtype=np.int64)
        self.ref: Floats = np.array([s.ref for s in self.states], dtype=np.float64)
        self.model: Floats = self.ref.copy()
        """Each row's model of the current ``observe`` call (``use_models``)."""
        self.has_model = np.zeros(len(self.states), dtype=bool)
        self.changed = np.zeros(len(self.states), dtype=bool)
        """Rows changed since ``write_back`` last wrote them."""
        self._half_k = config.delta / 2

    def __len__(self) -> int:
        return len(self.rows)

    def use_models(self, models: Mapping[int, PerfModel]) -> None:
        """The fitted models of this call's samples, by rank (a rank without one keeps its
        reference, as the scalar path does once its reference is a model)."""
        for rank, row in self.rows.items():
            m = models.get(rank)
            self.has_model[row] = m is not None
            if m is not None:
                self.model[row] = (m.per_sample_ms, m.intercept_ms, m.floor_ms)

    def step(
        self,
        iteration: int,
        rows: Sequence[int],
        samples: Sequence[tuple[int, int, float, int | None]],
    ) -> list[int]:
        """Judge ``samples`` (``(rank, batch, compute ms, planned batch)``) of block ``rows``
        at ``iteration``; commit the quiet ones. Returns the positions (in ``samples``) of
        those it left alone: their ranks have left the block, for the scalar path to judge."""
        n = len(rows)
        idx: Ints = np.fromiter(rows, dtype=np.int64, count=n)
        columns: Floats = np.fromiter(
            (v for _, b, c, p in samples for v in (b, c, _NAN if p is None else p)),
            dtype=np.float64,
            count=3 * n,
        )
        batch, ms, planned = columns[0::3], columns[1::3], columns[2::3]
        fresh = iteration > self.last[idx]
        valid = fresh & (batch > 0) & (ms > 0) & np.isfinite(ms)
        partial = valid & (batch < planned)  # NaN (no plan known) compares False
        judged = valid & ~partial
        leave = partial.copy()
        j = np.flatnonzero(judged)
        if len(j):
            rj = idx[j]
            ref = np.where(self.has_model[rj, None], self.model[rj], self.ref[rj])
            predicted = np.maximum(ref[:, 2], ref[:, 1] + ref[:, 0] * batch[j])
            positive = predicted > 0
            leave[j[~positive]] = True
            j, rj, ref, predicted = j[positive], rj[positive], ref[positive], predicted[positive]
            ratio = (ms[j] / predicted).tolist()
            x: Floats = np.array([math.log(v) for v in ratio], dtype=np.float64)
            mu, k = self._baseline(rj)
            z = x - mu - k
            calm = z <= 0
            leave[j[~calm]] = True
            self._commit(rj[calm], x[calm], ref[calm], iteration)
        touched = idx[fresh & ~leave]
        self.last[touched] = iteration
        self.changed[touched] = True
        out = np.flatnonzero(leave).tolist()
        for pos in out:
            self.evict(samples[pos][0])
        return out

    def normal(self) -> dict[int, tuple[float, float]]:
        """``changepoint.baseline`` (``(mu, sigma)``) of every rank in the block, from the
        arrays: what the detector's health needs, without writing the windows back."""
        if not self.rows:
            return {}
        ranks = list(self.rows)
        rows = np.fromiter(self.rows.values(), dtype=np.int64, count=len(ranks))
        mu, sigma = self._levels(rows)
        return dict(zip(ranks, zip(mu.tolist(), sigma.tolist(), strict=True), strict=True))

    def _levels(self, rows: Ints) -> tuple[Floats, Floats]:
        """``(mu, sigma)`` of ``changepoint.baseline`` for full windows."""
        c = self.config
        s = self._rows_of(self.sorted, rows)
        center = _middle(s)
        mu = np.minimum(c.bias_bound, np.maximum(-c.bias_bound, center))
        # |v - center| is |center - v| to the bit; a sort of short rows is quicker than a
        # partition at two places
        mad = _middle(np.sort(np.abs(s - center[:, None]), axis=1))
        return mu, np.maximum(c.sigma_floor, MAD_TO_SIGMA * mad)

    def _baseline(self, rows: Ints) -> tuple[Floats, Floats]:
        """``(mu, k)`` of ``changepoint._normal`` for full windows: the median within the bias
        bound, and the drift ``max(delta / 2, k_sigmas * sigma)`` with ``sigma`` the scaled
        median deviation from the median (``changepoint.baseline``)."""
        mu, sigma = self._levels(rows)
        return mu, np.maximum(self._half_k, self.config.k_sigmas * sigma)

    def _commit(self, rows: Ints, x: Floats, ref: Floats, iteration: int) -> None:
        """Quiet samples ``x`` enter their rows' windows; the oldest leave (``_keep_base``)."""
        if not len(rows):
            return
        self.ref[rows] = ref
        head = self.head[rows]
        old = self.base[rows, head]
        self.base[rows, head] = x
        self.its[rows, head] = iteration
        width = self.base.shape[1]
        self.head[rows] = (head + 1) % width
        s = self._rows_of(self.sorted, rows)
        # The old value leaves from its first occurrence (bisect_left) and the new one comes in
        # after its equals (insort: bisect_right), counted without the old value: one delete
        # and one insert over the rows laid end to end.
        at = np.count_nonzero(s < old[:, None], axis=1)
        to = np.count_nonzero(s <= x[:, None], axis=1) - (old <= x)
        starts = np.arange(len(rows)) * width
        keep = np.ones(s.size, dtype=bool)
        keep[starts + at] = False
        new = np.ones(s.size, dtype=bool)
        new[starts + to] = False
        merged = np.empty(s.size, dtype=np.float64)
        merged[starts + to] = x
        merged[new] = s.ravel()[keep]
        self.sorted[rows] = merged.reshape(len(rows), width)

    def _rows_of(self, table: Floats, rows: Ints) -> Floats:
        """``table[rows]``, without the copy when ``rows`` are all the rows in order (a block
        none of whose ranks has left: the common case)."""
        n = len(table)
        if len(rows) == n and n and rows[0] == 0 and rows[-1] == n - 1:
            return table  # rows are distinct and ascending: 0 .. n - 1
        return table[rows]

    def write_back(self) -> None:
        """Bring the ``RankState`` of every changed row up to date."""
        for row in np.flatnonzero(self.changed).tolist():
            self._write(row)
        self.changed[:] = False

    def _write(self, row: int) -> None:
        state = self.states[row]
        h = int(self.head[row])
        state.base = [*self.base[row, h:].tolist(), *self.base[row, :h].tolist()]
        state.base_its = [*self.its[row, h:].tolist(), *self.its[row, :h].tolist()]
        state.base_sorted = self.sorted[row].tolist()
        state.last_iteration = int(self.last[row])
        state.ref = self.ref[row].tolist()  # (its source stays "model": ``quiet``)

    def evict(self, rank: int) -> None:
        """Take ``rank`` out of the block, its ``RankState`` up to date."""
        row = self.rows.pop(rank)
        if self.changed[row]:
            self._write(row)
            self.changed[row] = False

    def close(self) -> None:
        """Write back every rank and empty the block."""
        self.write_back()
        self.rows.clear()
