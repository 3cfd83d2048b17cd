"""The control loop's take-in as columns (``rebalancer.NewColumns``): the tracker and the
straggler watch keep exactly what they kept taking the rows one by one (the reference code
below is what they ran before), whatever the rows: late ones, probes, out-of-memory reports,
rows without samples, iterations every rank has reported or not, and a flood wider than a
round's cap. (The fit window's equivalence with a whole read is ``test_rebalancer``'s.)"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.services import stragglers
from server.services.rebalancer import NewColumns, NewRow, Tracker
from server.services.stragglers import Watch

Pending = dict[int, list[tuple[int, int, float, int]]]


def _reference_absorb(tracker: dict[str, Any], rows: list[NewRow]) -> None:
    seen, firsts = tracker["max_iteration"], tracker["first_of_version"]
    for _, rank, iteration, version, probe, oom, _, _, _, _ in rows:
        if oom is not None:
            tracker["ooms"].append((rank, iteration, oom))
        if not probe and seen.get(rank, -1) < iteration:
            seen[rank] = iteration
        first = firsts.get(version)
        if first is None or iteration < first:
            firsts[version] = iteration


def _after(state: dict[str, Any]) -> int:
    fed, newest = state["fed_through"], state["newest"]
    return int(fed if fed >= 0 else max(-1, newest - stragglers.REPLAY))


def _reference_add(state: dict[str, Any], rows: list[NewRow]) -> None:
    state["newest"] = max(state["newest"], max(r[2] for r in rows))
    after = _after(state)
    pending: Pending = state["pending"]
    for _, rank, iteration, version, _, _, batch, compute, _, _ in rows:
        if batch > 0 and iteration > after:
            pending.setdefault(iteration, []).append((rank, batch, compute, version))
    if state["fed_through"] < 0:
        for iteration in [i for i in pending if i <= after]:
            del pending[iteration]


def _reference_take(
    state: dict[str, Any], through: int, sizes: dict[int, list[int]], cap: int
) -> list[tuple[int, list[tuple[int, int, float, int | None]]]]:
    after = _after(state)
    pending: Pending = state["pending"]
    groups = []
    taken = 0
    for iteration in sorted(i for i in pending if i <= through):
        group = pending[iteration]
        if iteration > after:
            if taken and taken + len(group) > cap:
                break
            group.sort()
            groups.append((iteration, group))
            taken += len(group)
        del pending[iteration]

    def at(v: int, r: int) -> int | None:
        s = sizes.get(v)
        return s[r] if s is not None and 0 <= r < len(s) else None

    return [(i, [(r, b, c, at(v, r)) for r, b, c, v in g]) for i, g in groups]


def _rows(draw: Any, ranks: int, start: int, first_id: int) -> list[NewRow]:
    n = draw(st.integers(1, 12))
    rows: list[NewRow] = []
    for k in range(n):
        iteration = draw(st.integers(max(0, start - 3), start + 4))  # some late, some ahead
        rows.append(
            (
                first_id + k,
                draw(st.integers(0, ranks - 1)),
                iteration,
                draw(st.sampled_from([1, 1, 2, 3])),
                draw(st.booleans()),
                draw(st.sampled_from([None, None, None, 4])),
                draw(st.sampled_from([0, 8, 8, 16])),
                draw(st.floats(0.5, 100.0)),
                draw(st.sampled_from([None, None, 2])),
                draw(st.sampled_from([None, None, 900.0])),
            )
        )
    # (rank, iteration) is unique in a job's telemetry: keep each pair's first row
    unique: dict[tuple[int, int], NewRow] = {}
    for r in rows:
        unique.setdefault((r[1], r[2]), r)
    return list(unique.values())


@st.composite
def _script(draw: Any) -> list[tuple[list[NewRow], int]]:
    """Batches of new rows, each with the ``through`` a round takes them up to."""
    ranks = draw(st.integers(1, 4))
    steps, start, next_id, seen = [], 0, 1, set[tuple[int, int]]()
    for _ in range(draw(st.integers(1, 8))):
        rows = [r for r in _rows(draw, ranks, start, next_id) if (r[1], r[2]) not in seen]
        if not rows:
            continue
        seen |= {(r[1], r[2]) for r in rows}
        next_id += 20
        start += draw(st.integers(0, 4))
        steps.append((rows, draw(st.integers(start - 3, start + 5))))
    return steps


@settings(max_examples=300, deadline=None)
@given(script=_script(), cap=st.sampled_from([1, 3, 6, 4096]))
def test_the_tracker_and_the_watch_keep_what_row_by_row_code_kept(
    script: list[tuple[list[NewRow], int]], cap: int
) -> None:
    sizes = {1: [8, 8, 16], 2: [8, 0, 8, 8], 3: []}  # a rank past its plan's sizes: None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stragglers, "MAX_TIMINGS_PER_ROUND", cap)
        patch.setattr(
            stragglers, "_planned", lambda _s, _j, vs: {v: sizes[v] for v in vs if v in sizes}
        )
        _play(script, cap, sizes)


def _play(script: list[tuple[list[NewRow], int]], cap: int, sizes: dict[int, list[int]]) -> None:
    job: Any = SimpleNamespace(id=1, plan_version=1)
    plan: Any = SimpleNamespace(version=1, excluded=[])  # the plan in force, read already
    tracker = Tracker(started=True, plan=plan, world=4)
    ref_tracker: dict[str, Any] = {"max_iteration": {}, "first_of_version": {}, "ooms": []}
    watch = Watch()
    ref: dict[str, Any] = {"fed_through": -1, "newest": -1, "pending": {}}
    for rows, through in script:
        columns = NewColumns(rows)
        tracker.absorb(None, job, rows, columns)  # type: ignore[arg-type]
        _reference_absorb(ref_tracker, rows)
        assert tracker.max_iteration == ref_tracker["max_iteration"]
        assert tracker.first_of_version == ref_tracker["first_of_version"]
        assert tracker.ooms == ref_tracker["ooms"]

        watch.add(rows, columns)
        _reference_add(ref, rows)
        assert watch.newest == ref["newest"] and watch.after() == _after(ref)
        got = stragglers._take(None, job, watch, through)  # type: ignore[arg-type]
        want = _reference_take(ref, through, sizes, cap)
        assert got == want
        assert all(
            type(v) is type(w)
            for g, h in zip(got, want, strict=True)
            for a, b in zip(g[1], h[1], strict=True)
            for v, w in zip(a, b, strict=True)
        )
        if got:  # as stragglers.detect does once the detector has them
            watch.fed_through = ref["fed_through"] = got[-1][0]
        left = sorted(
            zip(watch.pending.iteration.tolist(), watch.pending.rank.tolist(), strict=True)
        )
        assert left == sorted((i, r) for i, g in ref["pending"].items() for r, *_ in g)
