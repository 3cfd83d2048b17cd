"""The straggler detector: per-rank change-point tests over iteration timings, incrementally.

``Detector(config)`` keeps one ``RankState`` per rank (plain data, see ``changepoint``) and
``observe(timings, models)`` feeds it new timings, returning what changed as ``EventUpdate``
values. ``detect(window, models, config)`` is the same for a batch: a fresh detector replays the
window and returns every event it saw, closed or still open. Replaying the last N iterations is
also how a server without stored state rebuilds one (N >= ``baseline_window`` gives it a warm
baseline); ``to_dict`` / ``from_dict`` store and restore the exact state instead.

Events mean a rank is slower than its own reference predicts for the batch it ran. A rank that
is slow by design (an older device) is not an event: its model says so, and that is the
planner's input, which gives it fewer samples. An epoch's final partial batch is judged at its
size, bounded by the plan's (``ComputeTiming.planned_batch``; see ``changepoint``).

Models are read only while a rank is normal: the reference of an open event stays the model it
was opened against, so a server refitting models during the slowdown (which would absorb it)
cannot make the event look recovered.

A wide job's quiet ranks (``wide_ranks`` or more of them) are judged as arrays, an iteration at
a time (``block.QuietBlock``), with the same arithmetic as a sample at a time: the events and the
state are the same to the last bit, in a tenth of the time.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from server.planner import PerfModel
from server.stragglers.block import QuietBlock, quiet
from server.stragglers.changepoint import (
    DetectorConfig,
    RankState,
    actionable,
    baseline,
    current_level,
    event_of,
    observe_sample,
)
from server.stragglers.event import EventUpdate, StragglerEvent, StragglerKind
from server.stragglers.timing import ComputeTiming, by_iteration


@dataclass(frozen=True)
class RankHealth:
    """What the detector currently believes about one rank (the ladder's input)."""

    rank: int
    ratio: float
    """Current measured/predicted time: the event's recent level, or the normal level."""
    normal_ratio: float
    """The rank's normal measured/predicted level (its model's bias)."""
    noise: float
    """Robust sigma of its log-ratio."""
    event: StragglerEvent | None
    """Its open dynamic or transient event, if any."""
    reference: str
    """``"model"``, ``"self"`` (no model known: its own median ms/sample) or ``""`` (warming)."""
    actionable: bool = False
    """Its open event is still TRANSIENT but so severe that waiting for confirmation costs more
    than a false alarm (``DetectorConfig.act_factor``): the ladder may act provisionally."""

    @property
    def straggling(self) -> bool:
        """In a confirmed (DYNAMIC) event, or an actionable unconfirmed one: what the ladder acts
        on."""
        if self.event is None:
            return False
        return self.event.kind is StragglerKind.DYNAMIC or self.actionable


@dataclass
class DetectorState:
    """The detector's whole memory; plain data (``dataclasses.asdict`` makes it JSON-ready)."""

    ranks: list[RankState] = field(default_factory=list)
    last_iteration: int = -1


WIDE_RANKS = 32
"""Quiet ranks from which a job's are judged as arrays (``block.QuietBlock``): below it, the
arrays' fixed cost per iteration is more than a sample at a time costs."""


class Detector:
    """Incremental straggler detection; see the module docstring."""

    def __init__(
        self,
        config: DetectorConfig | None = None,
        state: DetectorState | None = None,
        *,
        wide_ranks: int | None = WIDE_RANKS,
    ):
        """``wide_ranks``: the quiet ranks from which they are judged as arrays (None: never;
        the results are the same either way)."""
        self.config = config or DetectorConfig()
        self._state = state or DetectorState()
        self._index = {r.rank: r for r in self._state.ranks}
        self._wide = wide_ranks
        self._block: QuietBlock | None = None

    @property
    def state(self) -> DetectorState:
        """The detector's whole memory, up to date (to read: the ranks judged as arrays keep
        their windows in the block, and are written back here)."""
        if self._block is not None:
            self._block.write_back()
        return self._state

    def _rank(self, rank: int) -> RankState:
        found = self._index.get(rank)
        if found is None:
            found = RankState(rank=rank)
            self._state.ranks.append(found)
            self._state.ranks.sort(key=lambda r: r.rank)
            self._index[rank] = found
        return found

    def _quiet_block(self) -> QuietBlock | None:
        """The block of quiet ranks for this call: kept while no rank outside it has become
        quiet, built afresh (the old one written back) when one has; None while fewer than
        ``wide_ranks`` ranks are quiet."""
        if self._wide is None or len(self._state.ranks) < self._wide:
            return self._block
        block, config = self._block, self.config
        inside = block.rows if block is not None else {}
        waiting = [s for s in self._state.ranks if s.rank not in inside and quiet(s, config)]
        if not waiting:
            return block
        if block is not None:
            block.close()
        members = [s for s in self._state.ranks if quiet(s, config)]
        self._block = QuietBlock(members, config) if len(members) >= self._wide else None
        return self._block

    def observe(
        self,
        timings: Iterable[ComputeTiming],
        models: Mapping[int, PerfModel] | None = None,
    ) -> list[EventUpdate]:
        """Feed new timings (any number of iterations, any order); return the event changes.

        A rank's timing for an iteration it already passed is ignored (late or duplicate).
        ``models`` maps rank to its fitted model; ranks without one use their own baseline.
        """
        return self.observe_iterations(
            (
                (iteration, [(r.rank, r.batch_size, r.compute_ms, r.planned_batch) for r in rows])
                for iteration, rows in by_iteration(timings)
            ),
            models,
        )

    def observe_iterations(
        self,
        iterations: Iterable[tuple[int, Sequence[tuple[int, int, float, int | None]]]],
        models: Mapping[int, PerfModel] | None = None,
    ) -> list[EventUpdate]:
        """``observe`` of timings already grouped: ``(iteration, [(rank, batch, compute ms,
        planned batch or None), ...])``, iterations ascending and each one's ranks in rank
        order (what ``by_iteration`` makes of any order). The control loop keeps new timings
        grouped so, and feeds them here without a ``ComputeTiming`` per row or a sort."""
        models = models or {}
        block = self._quiet_block()
        if block is not None:
            block.use_models(models)
        updates: list[EventUpdate] = []
        index, config, state_of = self._index, self.config, self._rank
        for iteration, rows in iterations:
            handled = self._step_block(block, iteration, rows) if block is not None else set()
            if len(handled) < len(rows):
                inside = block.rows if block is not None else {}
                for i, (rank, batch, compute_ms, planned) in enumerate(rows):
                    if i in handled or rank in inside:
                        continue  # judged in the block (or a duplicate of one that was)
                    state = index.get(rank) or state_of(rank)
                    changed = observe_sample(
                        state, iteration, batch, compute_ms, models.get(rank), config, planned
                    )
                    if changed:
                        updates += changed
            self._state.last_iteration = max(self._state.last_iteration, iteration)
        return updates

    @staticmethod
    def _step_block(
        block: QuietBlock, iteration: int, rows: Sequence[tuple[int, int, float, int | None]]
    ) -> set[int]:
        """Judge the samples of block ranks (a rank's first sample of the iteration) in the
        block; the positions in ``rows`` of those it judged."""
        inside = block.rows
        positions: list[int] = []
        members: list[int] = []
        taken: set[int] = set()
        for i, sample in enumerate(rows):
            row = inside.get(sample[0])
            if row is not None and row not in taken:
                taken.add(row)
                positions.append(i)
                members.append(row)
        if not positions:
            return set()
        left = block.step(iteration, members, [rows[i] for i in positions])
        handled = set(positions)
        handled.difference_update(positions[p] for p in left)
        return handled

    def any_open(self) -> bool:
        """Whether some rank is in an open event (cheaper than ``open_events``)."""
        return any(state.start is not None for state in self._state.ranks)

    def open_events(self) -> list[StragglerEvent]:
        """Every open event, by rank."""
        return [e for e in (event_of(state) for state in self._state.ranks) if e is not None]

    def health(self) -> dict[int, RankHealth]:
        """``RankHealth`` of every rank seen so far."""
        out = {}
        whole = self._state
        # the block's ranks from its arrays (no event, a model reference: only the baseline
        # to work out), without writing their windows back
        quiet = self._block.normal() if self._block is not None else {}
        for state in whole.ranks:
            level = quiet.get(state.rank)
            if level is not None:
                mu, sigma = level
                out[state.rank] = RankHealth(
                    rank=state.rank,
                    ratio=math.exp(mu),
                    normal_ratio=math.exp(mu),
                    noise=sigma,
                    event=None,
                    reference="model",
                )
                continue
            mu, sigma = baseline(state, self.config)
            out[state.rank] = RankHealth(
                rank=state.rank,
                ratio=current_level(state, self.config),
                normal_ratio=math.exp(mu),
                noise=sigma,
                event=event_of(state),
                reference=state.ref_source,
                actionable=actionable(state, whole.last_iteration, self.config),
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        """The state as JSON-ready plain data."""
        return dataclasses.asdict(self.state)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], config: DetectorConfig | None = None) -> Detector:
        """Rebuild a detector from ``to_dict`` output (keys it no longer knows are dropped)."""
        known = {f.name for f in dataclasses.fields(RankState)}
        ranks = [
            RankState(**{k: v for k, v in dict(r).items() if k in known})
            for r in data.get("ranks", [])
        ]
        return cls(config, DetectorState(ranks=ranks, last_iteration=int(data["last_iteration"])))


def detect(
    window: Iterable[ComputeTiming],
    models: Mapping[int, PerfModel] | None = None,
    config: DetectorConfig | None = None,
) -> list[StragglerEvent]:
    """Every event a fresh detector finds in ``window``, in order of onset then rank.

    Closed events carry their end iteration; events still open at the end of the window have
    ``end_iteration=None``.
    """
    detector = Detector(config)
    latest: dict[tuple[int, int, StragglerKind], StragglerEvent] = {}
    for update in detector.observe(window, models):
        latest[update.event.key] = update.event
    return sorted(latest.values(), key=lambda e: (e.start_iteration, e.rank, e.kind.value))
