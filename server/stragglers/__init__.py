"""Pure straggler detection and mitigation decisions. No database, no HTTP, no clock.

Iteration numbers are the only time axis; plain values in, plain values out.

Detection (``changepoint``, ``detector``)::

    ComputeTiming(rank, iteration, batch_size, compute_ms, plan_version=0, planned_batch=None)
    Detector(config=DetectorConfig(), state=None)
        .observe(timings, models=None) -> list[EventUpdate]      incremental, any order
        .health() -> dict[rank, RankHealth]                        the ladder's input
        .open_events() -> list[StragglerEvent]
        .to_dict() / Detector.from_dict(data, config)              plain-data state
    detect(window, models=None, config=None) -> list[StragglerEvent]     batch replay
    StragglerEvent(rank, kind, start_iteration, end_iteration, severity, detected_iteration,
                   confirmed_iteration, peak, action)
    StragglerKind: dynamic | transient (its docstring draws an event's state machine)
    EventUpdate(change: opened | updated | closed, event, iteration)
    iteration_stats(window, models) -> list[IterationStats]     imbalance and ratios per iteration

Mitigation (``candidates``, ``ladder``)::

    Situation(iteration, global_batch, ranks: tuple[RankView, ...], granularity=1,
              overrides=Overrides(), remaining_iterations=None, sync_ms=0.0)
    RankView(rank, model, batch_size, ratio=1.0, straggling=False, event_start=None,
             max_batch=None, min_batch=0);  rank_views(models, batches, health, max_batch)
    Overrides(frozen=False, pins={rank: batch}, excluded=frozenset())
    decide(situation, state: LadderState, config=LadderConfig()) -> (Decision, LadderState)
    Decision(action: none | fine_tune | replan | exclude | readmit, reason, new_batch_sizes,
             predicted_ms_before, predicted_ms_after, rank, event, horizon, imbalance, candidates)

Simulation (``scenario``, ``simulate``)::

    Scenario(name, models, global_batch, iterations, slowdowns: tuple[RankSlowdown, ...], noise,
             noise_kind, seed, max_batch, granularity, sync_ms).oracle_ms()
    RankSlowdown(rank, from_iteration, to_iteration, factor)
    simulate(scenario, policy in POLICY_NAMES, SimConfig()) -> SimResult
"""

from server.stragglers.candidates import Overrides, RankView, Situation
from server.stragglers.changepoint import DetectorConfig
from server.stragglers.detector import Detector, DetectorState, RankHealth, detect
from server.stragglers.event import Change, EventUpdate, StragglerEvent, StragglerKind
from server.stragglers.ladder import (
    Action,
    Candidate,
    Decision,
    LadderConfig,
    LadderState,
    decide,
    rank_views,
)
from server.stragglers.scenario import RankSlowdown, Scenario
from server.stragglers.simulate import POLICY_NAMES, SimConfig, SimResult, simulate
from server.stragglers.timing import ComputeTiming, IterationStats, imbalance, iteration_stats

__all__ = [
    "POLICY_NAMES",
    "Action",
    "Candidate",
    "Change",
    "ComputeTiming",
    "Decision",
    "Detector",
    "DetectorConfig",
    "DetectorState",
    "EventUpdate",
    "IterationStats",
    "LadderConfig",
    "LadderState",
    "Overrides",
    "RankHealth",
    "RankSlowdown",
    "RankView",
    "Scenario",
    "SimConfig",
    "SimResult",
    "Situation",
    "StragglerEvent",
    "StragglerKind",
    "decide",
    "detect",
    "imbalance",
    "iteration_stats",
    "rank_views",
    "simulate",
]
