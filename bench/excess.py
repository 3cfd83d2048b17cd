"""Where a straggler run's time goes beyond the oracle: ``decompose(run, schedule)``.

Input: one job's raw record as ``bench/stragglers.py`` collects it (``--dump``): its telemetry
rows, plan history and straggler events, plus the emulated speeds and the slowdown schedule
(the truth, which the control plane never sees). Per iteration ``i`` (``d_i`` its wall time: the
last rank's end minus the previous iteration's; iteration 0 counts its slowest rank's phases)::

    d_i = oracle_i + plan_gap_i + overhead_i
    oracle_i   = continuous min-max optimum of the true speeds (the bench's oracle, per iteration)
    plan_gap_i = true makespan of the plan in force (max over ranks with samples of
                 factor_r(i) * (intercept + per_sample_r * b_r)) - oracle_i
    overhead_i = d_i - true makespan: what no plan removes

The plan gap is attributed to one phase per iteration:

- ``warm-up``: before the first plan that is not the initial split or an exploration step took
  effect (the models are being identified);
- ``reaction``: from a change of the true speeds (a slowdown's onset or end) until the first plan
  made after it took effect, split into ``detect`` (until the detector's verdict: the event's
  ``confirmed_iteration`` at an onset, ``closed_iteration`` at an end), ``server`` (until the
  iteration in progress when the plan was stored: telemetry flush plus the control-loop round)
  and ``delivery`` (until the first iteration under it: the leader's plan poll plus the
  agreement's one iteration). Without any plan before the next change, the whole segment is
  ``no reaction``;
- ``integrality``: the integer optimum of the true speeds over the continuous one (no plan can
  remove it);
- ``plan quality``: the rest (plans off the true optimum: models refitted on mixed windows,
  fine-tune steps, exclusion instead of re-planning, hysteresis).

The overhead is split by the telemetry's phases: ``all-reduce`` (per iteration the least sync
time among the ranks, i.e. the collective itself as the last rank to arrive sees it), ``data``,
``compute over target`` (the slowest compute above the emulated target: sleep overshoot and CPU
contention) and ``step + boundary`` (the rest: optimizer step, plan agreement, telemetry, the
scheduler); the part of ``step + boundary`` above its median at iterations where the all-reduce
group changed (and the one after) is ``regroup/resync``.

All figures are seconds; the parts add up to ``total - oracle`` exactly.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cache
from typing import Any

from evenflow.experiment import optimum_ms
from server.planner import PerfModel

Schedule = Mapping[int, Sequence[tuple[int, int, float]]]
"""rank -> [(from_iteration, to_iteration, factor)]."""


@dataclass
class Reaction:
    """The way to the first plan after one change of the true speeds."""

    iteration: int
    kind: str
    """``onset r`` or ``end r``."""
    detect: int | None = None
    server: int | None = None
    delivery: int | None = None
    """Iterations in each stage (None: unknown, e.g. no verdict recorded)."""
    reacted_at: int | None = None
    """First iteration under the reacting plan; None: no plan before the next change."""
    cost_s: dict[str, float] = field(default_factory=dict)

    @property
    def iterations(self) -> int | None:
        return None if self.reacted_at is None else self.reacted_at - self.iteration

    def line(self) -> str:
        parts = " + ".join(f"{k} {v:.2f}" for k, v in self.cost_s.items() if v)
        if self.reacted_at is None:
            return f"{self.kind}@{self.iteration}: no plan before the next change ({parts} s)"
        stages = "/".join("?" if s is None else str(s) for s in self._stages())
        return (
            f"{self.kind}@{self.iteration}: {self.iterations} its (detect/server/delivery "
            f"{stages}) = {sum(self.cost_s.values()):.2f} s"
        )

    def _stages(self) -> tuple[int | None, int | None, int | None]:
        return self.detect, self.server, self.delivery


@dataclass
class Excess:
    oracle_s: float
    total_s: float
    parts: dict[str, float]
    """Name -> seconds; they sum to ``total_s - oracle_s``."""
    reactions: list[Reaction]
    warmup_iterations: int
    mean_allreduce_ms: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "oracle_s": self.oracle_s,
            "total_s": self.total_s,
            "parts": self.parts,
            "warmup_iterations": self.warmup_iterations,
            "mean_allreduce_ms": self.mean_allreduce_ms,
            "reactions": [
                {
                    "iteration": r.iteration,
                    "kind": r.kind,
                    "detect": r.detect,
                    "server": r.server,
                    "delivery": r.delivery,
                    "reacted_at": r.reacted_at,
                    "cost_s": r.cost_s,
                }
                for r in self.reactions
            ],
        }

    def lines(self) -> list[str]:
        p = self.parts
        excess = self.total_s - self.oracle_s
        out = [
            f"oracle {self.oracle_s:.2f} s, total {self.total_s:.2f} s "
            f"({self.total_s / self.oracle_s:.3f}x), excess {excess:.2f} s:",
            f"  warm-up ({self.warmup_iterations} its before the first min-max plan) "
            f"{p['warm-up']:.2f} s",
            f"  overhead: all-reduce {p['all-reduce']:.2f} s ({self.mean_allreduce_ms:.1f} ms/it),"
            f" step + boundary {p['step + boundary']:.2f}, data {p['data']:.2f}, "
            f"compute over target {p['compute over target']:.2f}, "
            f"regroup/resync {p['regroup/resync']:.2f}",
            f"  reaction: detect {p['reaction: detect']:.2f} s, server {p['reaction: server']:.2f},"
            f" delivery {p['reaction: delivery']:.2f}, no reaction {p['no reaction']:.2f}",
            f"  plans: quality {p['plan quality']:.2f} s, integrality {p['integrality']:.2f}",
        ]
        out += [f"    {r.line()}" for r in self.reactions]
        return out


def factor(schedule: Schedule, rank: int, it: int) -> float:
    f = 1.0
    for a, b, x in schedule.get(rank, ()):
        if a <= it < b:
            f *= x
    return f


@cache
def _optima(
    per_sample: tuple[float, ...], intercept: float, global_batch: int, factors: tuple[float, ...]
) -> tuple[float, float]:
    models = [PerfModel(f * s, f * intercept) for f, s in zip(factors, per_sample, strict=True)]
    return optimum_ms(models, global_batch)


def _ts(created_at: str) -> float:
    return datetime.fromisoformat(created_at.replace("Z", "+00:00")).timestamp()


INITIAL_OR_EXPLORING = ("equal split", "exploring")


OVERHEADS = ("all-reduce", "data", "compute over target", "step + boundary")
GAP_PHASES = (
    "warm-up",
    "reaction: detect",
    "reaction: server",
    "reaction: delivery",
    "no reaction",
    "integrality",
    "plan quality",
)


@dataclass
class _Record:
    """One job's raw record, indexed by iteration."""

    n: int
    rows: dict[int, list[Mapping[str, Any]]]
    its: list[int]
    plans: dict[int, Mapping[str, Any]]
    end: dict[int, float]
    """Iteration -> its last rank's end (worker time, s)."""
    version: dict[int, int]
    first_of: dict[int, int]
    """Plan version -> the first iteration under it."""

    @classmethod
    def of(cls, run: Mapping[str, Any]) -> _Record:
        rows: dict[int, list[Mapping[str, Any]]] = {}
        for r in run["telemetry"]:
            if not r["probe"]:
                rows.setdefault(int(r["iteration"]), []).append(r)
        its = sorted(rows)
        version = {i: int(rows[i][0]["plan_version"]) for i in its}
        first_of: dict[int, int] = {}
        for i in its:
            first_of.setdefault(version[i], i)
        return cls(
            n=int(run["iterations"]),
            rows=rows,
            its=its,
            plans={int(p["version"]): p for p in run["plans"]},
            end={i: max(float(r["ts"]) for r in rows[i]) for i in its},
            version=version,
            first_of=first_of,
        )


@dataclass
class _PerIteration:
    """Per iteration, in ms: the oracle, the integer optimum, the plan gap and the overheads."""

    oracle: dict[int, float] = field(default_factory=dict)
    integer: dict[int, float] = field(default_factory=dict)
    gap: dict[int, float] = field(default_factory=dict)
    over: dict[str, dict[int, float]] = field(default_factory=lambda: {k: {} for k in OVERHEADS})


def decompose(
    run: Mapping[str, Any],
    schedule: Schedule,
    *,
    per_sample: Sequence[float],
    intercept: float,
    global_batch: int,
) -> Excess:
    """The decomposition in the module docstring, for one job's raw record."""
    rec = _Record.of(run)
    per = _per_iteration(rec, schedule, tuple(per_sample), intercept, global_batch)
    regroup = _regroup(rec, per.over["step + boundary"])
    warm_end = _warm_end(rec)
    phase: dict[int, str] = {i: "warm-up" for i in rec.its if i < warm_end}
    verdicts = _verdicts(run["events"])
    reactions = [
        _reaction(rec, c, kind, nxt, verdicts.get((kind, c)), per.gap, phase)
        for c, kind, nxt in _changes(schedule, rec.n)
        if c >= warm_end
    ]
    parts = dict.fromkeys(GAP_PHASES, 0.0)
    for i in rec.its:
        p = phase.get(i)
        if p is None:
            parts["integrality"] += (per.integer[i] - per.oracle[i]) / 1000
            parts["plan quality"] += (per.gap[i] - per.integer[i] + per.oracle[i]) / 1000
        else:
            parts[p] += per.gap[i] / 1000
    for name, values in per.over.items():
        parts[name] = sum(values.values()) / 1000
    parts["regroup/resync"] = sum(regroup.values()) / 1000
    oracle_s = sum(per.oracle.values()) / 1000
    return Excess(
        oracle_s=oracle_s,
        total_s=oracle_s + sum(parts.values()),
        parts=parts,
        reactions=reactions,
        warmup_iterations=warm_end,
        mean_allreduce_ms=statistics.fmean(per.over["all-reduce"].values()) if rec.its else 0.0,
    )


def _per_iteration(
    rec: _Record,
    schedule: Schedule,
    per_sample: tuple[float, ...],
    intercept: float,
    global_batch: int,
) -> _PerIteration:
    per = _PerIteration()
    for k, i in enumerate(rec.its):
        fs = tuple(factor(schedule, r, i) for r in range(len(per_sample)))
        per.integer[i], per.oracle[i] = _optima(per_sample, intercept, global_batch, fs)
        sizes = rec.plans[rec.version[i]]["batch_sizes"]
        true = max(
            (fs[r] * (intercept + per_sample[r] * b) for r, b in enumerate(sizes) if b > 0),
            default=0.0,
        )
        per.gap[i] = true - per.oracle[i]
        rs = rec.rows[i]
        if k == 0:
            d = max(r["data_ms"] + r["compute_ms"] + r["sync_ms"] for r in rs)
        else:
            d = (rec.end[i] - rec.end[rec.its[k - 1]]) * 1000.0
        compute = max(r["compute_ms"] for r in rs)
        critical = max(r["data_ms"] + r["compute_ms"] for r in rs)
        allreduce = min(r["sync_ms"] for r in rs)
        per.over["all-reduce"][i] = allreduce
        per.over["compute over target"][i] = compute - true
        per.over["data"][i] = critical - compute
        per.over["step + boundary"][i] = d - true - allreduce - (critical - true)
    return per


def _regroup(rec: _Record, rest: dict[int, float]) -> dict[int, float]:
    """Regroup/resync: ``rest`` (step + boundary) above its median where the group changed, and
    just after; taken out of ``rest``."""
    typical = statistics.median(rest.values()) if rest else 0.0
    regroup: dict[int, float] = {}
    for k, i in enumerate(rec.its[1:]):
        prev = rec.its[k]
        if rec.plans[rec.version[i]].get("excluded", []) != rec.plans[rec.version[prev]].get(
            "excluded", []
        ):
            for j in (i, i + 1):
                if j in rest and j not in regroup:
                    regroup[j] = max(0.0, rest[j] - typical)
                    rest[j] -= regroup[j]
    return regroup


def _warm_end(rec: _Record) -> int:
    """The first iteration under a plan that is neither the initial split nor exploration."""
    settled = [
        v
        for v in sorted(rec.plans)
        if not str(rec.plans[v]["reason"]).startswith(INITIAL_OR_EXPLORING) and v in rec.first_of
    ]
    return rec.first_of[settled[0]] if settled else rec.n


def _changes(schedule: Schedule, n: int) -> list[tuple[int, str, int]]:
    """Each change of the true speeds: (iteration, ``onset r`` / ``end r``, the next change's
    iteration or ``n``)."""
    changes: list[tuple[int, str]] = []
    for rank, windows in schedule.items():
        for a, b, _ in windows:
            changes.append((a, f"onset {rank}"))
            if b < n:
                changes.append((b, f"end {rank}"))
    changes.sort()
    nexts = [c for c, _ in changes[1:]] + [n]
    return [(c, kind, nxt) for (c, kind), nxt in zip(changes, nexts, strict=True)]


def _reaction(
    rec: _Record,
    c: int,
    kind: str,
    nxt: int,
    verdict: int | None,
    gap: Mapping[int, float],
    phase: dict[int, str],
) -> Reaction:
    """The way to the first plan made after the change at ``c``; marks the phase of its
    iterations."""
    start_ts = rec.end.get(c - 1, 0.0)
    later = sorted(
        (v for v in rec.plans if v in rec.first_of and _ts(rec.plans[v]["created_at"]) > start_ts),
        key=lambda v: rec.first_of[v],
    )
    reaction = Reaction(c, kind)
    v = later[0] if later else None
    if v is None or rec.first_of[v] > nxt:
        for i in range(c, nxt):
            phase.setdefault(i, "no reaction")
        reaction.cost_s["no reaction"] = sum(gap.get(i, 0.0) for i in range(c, nxt)) / 1000
        return reaction
    reacted = rec.first_of[v]
    created = _ts(rec.plans[v]["created_at"])
    made_during = next((i for i in rec.its if rec.end[i] >= created), reacted)
    stage_ends = [
        ("detect", None if verdict is None else min(max(verdict + 1, c), reacted)),
        ("server", min(max(made_during + 1, c), reacted)),
        ("delivery", reacted),
    ]
    at = c
    for name, until in stage_ends:
        if until is None:
            continue
        for i in range(at, until):
            phase.setdefault(i, f"reaction: {name}")
        reaction.cost_s[name] = sum(gap.get(i, 0.0) for i in range(at, until)) / 1000
        setattr(reaction, name, until - at)
        at = until
    reaction.reacted_at = reacted
    return reaction


def _verdicts(events: Sequence[Mapping[str, Any]]) -> dict[tuple[str, int], int]:
    """(``onset r`` / ``end r``, iteration) -> the iteration of the detector's verdict about it
    (``confirmed_iteration`` / ``closed_iteration``), for changes within 5 iterations of a
    dynamic event's estimated start / end."""
    out: dict[tuple[str, int], int] = {}
    for e in events:
        if e["kind"] != "dynamic" or e["rank"] is None:
            continue
        detail = e.get("detail") or {}
        confirmed = detail.get("confirmed_iteration")
        closed = detail.get("closed_iteration")
        for dx in range(-5, 6):
            if confirmed is not None:
                out.setdefault((f"onset {e['rank']}", e["start_iteration"] + dx), confirmed)
            if closed is not None and e["end_iteration"] is not None:
                out.setdefault((f"end {e['rank']}", e["end_iteration"] + dx), closed)
    return out
