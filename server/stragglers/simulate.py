"""A pure discrete simulator: replay a ``Scenario`` under a balancing policy, against the oracle.

Each iteration k: every rank in the group computes its batch (``Scenario`` says how long that
really takes), the iteration lasts as long as the slowest plus the all-reduce, and the policy
sees the timings at the end of the iteration and may switch plans from iteration k + 1. Costs of
acting are paid in simulated time: a plan change costs ``plan_change_iterations`` iterations of
the iteration it follows; leaving the group costs ``regroup_ms``, rejoining ``regroup_ms +
resync_ms`` (the ladder's own cost figures, so it is judged by the costs it assumed).

Policies:

- ``equal``: ``B / n`` each, never changed (plain DDP).
- ``static``: min-max from the true base models, computed once at the start, never changed.
- ``minmax``: starts like ``static``; every ``replan_every`` iterations, each rank's model is its
  base model scaled by its median measured/predicted ratio over that window (a rank that got no
  samples is assumed back to normal), and the plan is re-solved; a changed plan is a plan change.
- ``adaptive``: the detector and the mitigation ladder, from the ``static`` plan. A rank the
  ladder excluded runs a probe of ``probe_batch`` samples every ``probe_every`` iterations off the
  critical path; its timings feed the detector, which is how its recovery is seen. As on the
  server, the ladder gets the all-reduce's measured slowdown since the onset of an event, not an
  assumption.

The detector and the planner see only timings and the base models, never the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from statistics import median

from server.planner import solve
from server.stragglers.candidates import Situation
from server.stragglers.changepoint import DetectorConfig
from server.stragglers.detector import Detector, RankHealth
from server.stragglers.event import StragglerEvent, StragglerKind
from server.stragglers.ladder import Action, Decision, LadderConfig, LadderState, decide, rank_views
from server.stragglers.scenario import Scenario
from server.stragglers.timing import ComputeTiming

POLICY_NAMES = ("equal", "static", "minmax", "adaptive")


@dataclass(frozen=True)
class SimConfig:
    replan_every: int = 20
    """K of the periodic ``minmax`` policy."""
    probe_every: int = 5
    probe_batch: int | None = None
    """Samples of an excluded rank's probe; default ``B / n``."""
    detector: DetectorConfig = field(default_factory=DetectorConfig)
    ladder: LadderConfig = field(default_factory=LadderConfig)


@dataclass(frozen=True)
class SimResult:
    scenario: str
    policy: str
    total_ms: float
    oracle_ms: float
    plan_changes: int
    regroups: int
    events: tuple[StragglerEvent, ...] = ()
    """Every dynamic/transient event the detector reported (``adaptive`` only)."""
    detection_delays: tuple[int | None, ...] = ()
    """Per slowdown of the schedule: iterations from its onset until a DYNAMIC event of that rank
    was confirmed (None: not detected). ``adaptive`` only."""
    recovery_delays: tuple[int | None, ...] = ()
    """Per slowdown that ends inside the run: iterations from its end until the event closed."""
    changes_per_event: tuple[int, ...] = ()
    """Plan changes charged to each event the ladder acted on."""
    decisions: tuple[tuple[int, Decision], ...] = ()
    """Every plan-changing decision with its iteration."""

    @property
    def ratio(self) -> float:
        return self.total_ms / self.oracle_ms


def simulate(scenario: Scenario, policy: str, config: SimConfig | None = None) -> SimResult:
    """Run ``scenario`` under ``policy`` (one of ``POLICY_NAMES``)."""
    if policy not in POLICY_NAMES:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICY_NAMES)}")
    config = config or SimConfig()
    run = _Run(scenario, policy, config)
    for k in range(scenario.iterations):
        run.step(k)
    return run.result()


class _Run:
    def __init__(self, scenario: Scenario, policy: str, config: SimConfig) -> None:
        self.sc, self.policy, self.config = scenario, policy, config
        self.models = dict(enumerate(scenario.models))
        normal = (1.0,) * scenario.ranks
        first = solve(scenario.problem(normal), "equal" if policy == "equal" else "minmax")
        self.batches = {int(k): v for k, v in first.batch_sizes.items()}
        self.noise = scenario.noise_matrix()
        self.excluded: set[int] = set()
        self.total = 0.0
        self.changes = 0
        self.regroups = 0
        self.overhead = 0.0
        self.window: list[ComputeTiming] = []
        self.detector = Detector(config.detector)
        self.ladder = LadderState()
        self.events: dict[tuple[int, int, StragglerKind], StragglerEvent] = {}
        self.closed_at: dict[tuple[int, int, StragglerKind], int] = {}
        self.decisions: list[tuple[int, Decision]] = []
        self.per_event: dict[tuple[int, int], int] = {}
        self.all_reduce: list[float] = []
        """The all-reduce time of every iteration so far (what the server measures)."""
        n = scenario.ranks
        self.probe = config.probe_batch or max(1, scenario.global_batch // n)

    def step(self, k: int) -> None:
        sc = self.sc
        factors = sc.factors(k)
        timings = []
        for rank, b in self.batches.items():
            running = rank not in self.excluded
            probing = not running and k % self.config.probe_every == 0
            batch = b if running else (self.probe if probing else 0)
            if batch <= 0:
                continue
            ms = factors[rank] * self.models[rank].predict(batch) * float(self.noise[k, rank])
            timings.append((rank, batch, ms, running))
        group = [r for r in range(sc.ranks) if r not in self.excluded]
        busy = [ms for _, _, ms, running in timings if running]
        iteration_ms = sc.iteration_ms(busy, group, k)
        self.all_reduce.append(iteration_ms - max(busy, default=0.0))
        self.total += iteration_ms + self.overhead
        self.overhead = 0.0
        records = [ComputeTiming(r, k, b, ms) for r, b, ms, _ in timings]
        if self.policy == "minmax":
            self._periodic(k, records, iteration_ms)
        elif self.policy == "adaptive":
            self._adaptive(k, records, iteration_ms)

    def _change(self, batches: dict[int, int], iteration_ms: float) -> None:
        self.batches = batches
        self.changes += 1
        self.overhead += self.config.ladder.plan_change_iterations * iteration_ms

    def _periodic(self, k: int, records: list[ComputeTiming], iteration_ms: float) -> None:
        self.window += records
        if (k + 1) % self.config.replan_every:
            return
        ratios: dict[int, list[float]] = {}
        for t in self.window:
            ratios.setdefault(t.rank, []).append(
                t.compute_ms / self.models[t.rank].predict(t.batch_size)
            )
        self.window = []
        factors = tuple(median(ratios[r]) if r in ratios else 1.0 for r in range(self.sc.ranks))
        plan = solve(self.sc.problem(factors), "minmax")
        new = {int(r): b for r, b in plan.batch_sizes.items()}
        if new != self.batches:
            self._change(new, iteration_ms)

    def _adaptive(self, k: int, records: list[ComputeTiming], iteration_ms: float) -> None:
        for u in self.detector.observe(records, self.models):
            known = self.events.get(u.event.key)  # the detector does not carry actions
            self.events[u.event.key] = replace(u.event, action=known.action if known else "")
            if u.event.end_iteration is not None:
                self.closed_at[u.event.key] = k
        caps = {r: self.sc.cap(r) for r in range(self.sc.ranks)}
        health = self.detector.health()
        views = rank_views(
            self.models,
            self.batches,
            health,
            caps,
            all_reduce_ratio=self._all_reduce_ratio(k, health),
            excluded=self.excluded,
        )
        situation = Situation(
            iteration=k,
            global_batch=self.sc.global_batch,
            ranks=views,
            granularity=self.sc.granularity,
            remaining_iterations=self.sc.iterations - k - 1,
            sync_ms=self.sc.sync_ms,
        )
        decision, self.ladder = decide(situation, self.ladder, self.config.ladder)
        if decision.new_batch_sizes is None:
            return
        self.decisions.append((k, decision))
        if decision.event is not None:
            self.per_event[decision.event] = self.per_event.get(decision.event, 0) + 1
            key = (decision.event[0], decision.event[1], StragglerKind.DYNAMIC)
            if key in self.events:
                self.events[key] = replace(
                    self.events[key], action=_joined(self.events[key].action, decision)
                )
        self._change(dict(decision.new_batch_sizes), iteration_ms)
        lc = self.config.ladder
        if decision.action is Action.EXCLUDE and decision.rank is not None:
            self.excluded.add(decision.rank)
            self.regroups += 1
            self.overhead += lc.regroup_ms
        elif decision.action is Action.READMIT and decision.rank is not None:
            self.excluded.discard(decision.rank)
            self.regroups += 1
            self.overhead += lc.regroup_ms + lc.resync_ms

    def _all_reduce_ratio(self, k: int, health: dict[int, RankHealth]) -> float | None:
        """As the server measures it (``server.services.stragglers``): the median all-reduce of
        the last few iterations since the oldest open event's onset over the median of the 20
        before it (from the onset's own iteration on)."""
        starts = [
            h.event.start_iteration for h in health.values() if h.straggling and h.event is not None
        ]
        if not starts or self.sc.sync_ms <= 0:
            return None
        onset = min(starts)
        since = k - onset + 1
        before = self.all_reduce[max(0, onset - 20) : max(0, onset)]
        if not before:
            return None
        now = median(self.all_reduce[k + 1 - min(5, since) : k + 1])
        return now / median(before)

    def result(self) -> SimResult:
        events = tuple(sorted(self.events.values(), key=lambda e: (e.start_iteration, e.rank)))
        detection: list[int | None] = []
        recovery: list[int | None] = []
        if self.policy == "adaptive":
            for s in self.sc.slowdowns:
                mine = [
                    e
                    for e in events
                    if e.rank == s.rank
                    and e.confirmed_iteration is not None
                    and s.from_iteration - 5 <= e.start_iteration < s.to_iteration
                ]
                first = min(mine, key=lambda e: e.start_iteration, default=None)
                delay = None if first is None else first.confirmed_iteration
                detection.append(None if delay is None else delay - s.from_iteration)
                if s.to_iteration < self.sc.iterations and first is not None:
                    closed = self.closed_at.get(first.key)
                    recovery.append(None if closed is None else closed - s.to_iteration)
        return SimResult(
            scenario=self.sc.name,
            policy=self.policy,
            total_ms=self.total,
            oracle_ms=self.sc.oracle_ms(),
            plan_changes=self.changes,
            regroups=self.regroups,
            events=events,
            detection_delays=tuple(detection),
            recovery_delays=tuple(recovery),
            changes_per_event=tuple(self.per_event.values()),
            decisions=tuple(self.decisions),
        )


def _joined(previous: str, decision: Decision) -> str:
    what = decision.action.value + (f"({decision.rank})" if decision.rank is not None else "")
    return what if not previous else f"{previous}, {what}"
