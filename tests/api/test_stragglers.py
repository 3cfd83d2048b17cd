"""Straggler detection and mitigation through the API, on simulated workers with noise.

Workers report t = factor * (intercept + per_sample * b) * noise for the plan they are served,
and an all-reduce slowed by the slowest rank of the group (unless told otherwise); the control loop (rebalancer + straggler watch) runs after every iteration, as the server's
background loop would."""

from __future__ import annotations

import itertools
import random
import threading
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import select

from contract.enums import PlanSource
from server import workqueue
from server.controller import Controller
from server.db import transaction
from server.models import Job
from server.services import control_loop, jobs, rebalancer, stragglers
from server.stragglers import LadderConfig
from tests.harness import Api, statements

PER_SAMPLE = [1.0, 1.0, 2.0, 4.0]
INTERCEPT = 5.0
B = 256
PROBE_EVERY = 5
TAIL = 5


class Cluster:
    def __init__(
        self,
        api: Api,
        policy: str,
        slow: dict[int, tuple[int, int, float]],
        sync_ms: float = 1.0,
        *,
        slow_all_reduce: bool = True,
        prefetch: bool = False,
        epoch: int | None = None,
        per_sample: list[float] = PER_SAMPLE,
        exclude: bool = True,
    ) -> None:
        self.api, self.slow, self.sync_ms = api, slow, sync_ms
        self.per_sample = per_sample
        """Each rank's ms per sample (the default: two GPU models' worth, and two others)."""
        self.epoch = epoch
        """Every ``epoch``-th iteration is an epoch's final partial batch of ``TAIL`` samples,
        split over the first ranks; each takes at least half its full batch's time (a step's
        fixed cost, which the fitted line leaves out)."""
        self.prefetch = prefetch
        """Read each round's telemetry ahead, in a transaction of its own, and hold the writer
        lock meanwhile from another thread, as the controller process does (``Controller``)."""
        self.slow_all_reduce = slow_all_reduce
        """A slowed rank slows the all-reduce of its group by its factor (else it does not)."""
        self.host = api.register("sim", devices=4)
        spec_policy = {
            "name": policy,
            "explore_iterations": 5,
            "rebalance_every": 10,
            "exclude": exclude,
        }
        self.job = int(
            api.submit(workers=4, global_batch=B, iterations=100_000, policy=spec_policy)["id"]
        )  # type: ignore[call-overload]
        self.iteration = 0
        self.state = control_loop.LoopState()
        self.rng = random.Random(7)

    def factor(self, rank: int) -> float:
        start, end, f = self.slow.get(rank, (0, 0, 1.0))
        return f if start <= self.iteration < end else 1.0

    def plan(self) -> dict[str, Any]:
        data: dict[str, Any] = self.api.client.get(
            f"/api/v1/jobs/{self.job}/plan", headers=self.api.headers()
        ).json()
        return data

    def run(self, iterations: int) -> None:
        for _ in range(iterations):
            plan = self.plan()
            group = [r for r in range(4) if r not in plan["excluded"]]
            sync = self.sync_ms * (
                max(self.factor(r) for r in group) if self.slow_all_reduce else 1.0
            )
            records = []
            sizes = self.sizes(plan["batch_sizes"])
            for r, b in enumerate(plan["batch_sizes"]):
                probe = r in plan["excluded"]
                if probe and self.iteration % PROBE_EVERY:
                    continue
                size = B // 4 if probe else sizes[r]
                floor = 0.5 * (INTERCEPT + self.per_sample[r] * b) if size < b else 0.0
                ms = (
                    self.factor(r)
                    * max(floor, INTERCEPT + self.per_sample[r] * size)
                    * self.rng.uniform(0.95, 1.05)
                    if size
                    else 0.0
                )
                records.append(
                    {
                        "rank": r,
                        "iteration": self.iteration,
                        "plan_version": plan["version"],
                        "batch_size": size,
                        "data_ms": 0.5,
                        "compute_ms": ms,
                        "sync_ms": self.sync_ms if probe else sync,
                        "ts": 1.7e9 + self.iteration,
                        "probe": probe,
                    }
                )
            r = self.api.client.post(
                f"/api/v1/jobs/{self.job}/telemetry",
                json={"records": records},
                headers=self.api.headers(str(self.host["_token"])),
            )
            assert r.status_code == 200, r.text
            self.iteration += 1
            sessions = self.api.client.app.state.context.sessions  # type: ignore[attr-defined]
            if self.prefetch:
                self._prefetch_while_a_writer_holds_the_lock(sessions)
            self.sweep()

    def sweep(self) -> None:
        """A controller's round (one sweep of every job, in one transaction)."""
        sessions = self.api.client.app.state.context.sessions  # type: ignore[attr-defined]
        with transaction(sessions) as s:
            control_loop.sweep(s, self.state)

    def sizes(self, planned: list[int]) -> list[int]:
        """Each rank's batch this iteration: its plan's, or its share of an epoch's tail."""
        if self.epoch is None or self.iteration % self.epoch != self.epoch - 1:
            return planned
        left, out = TAIL, []
        for b in planned:
            out.append(min(b, left))
            left -= out[-1]
        return out

    def _prefetch_while_a_writer_holds_the_lock(self, sessions: Any) -> None:
        lock = self.api.client.app.state.context.write_lock  # type: ignore[attr-defined]
        held, done, released = threading.Event(), threading.Event(), threading.Event()

        def writer() -> None:
            with lock:
                held.set()
                done.wait(5)
            released.set()

        t = threading.Thread(target=writer)
        t.start()
        try:
            assert held.wait(10)
            with transaction(sessions) as s:  # must not need the lock the writer holds
                control_loop.prefetch(s, self.state, self.job)
            assert not released.is_set(), "the read-ahead waited for the writer lock"
        finally:
            done.set()
            t.join()

    def events(self) -> list[dict[str, Any]]:
        data: list[dict[str, Any]] = self.api.client.get(
            f"/api/v1/jobs/{self.job}/events", headers=self.api.headers()
        ).json()["items"]
        return data

    def plans(self) -> list[dict[str, Any]]:
        data: list[dict[str, Any]] = self.api.client.get(
            f"/api/v1/jobs/{self.job}/plans?limit=1000", headers=self.api.headers()
        ).json()["items"]
        return data[::-1]


@pytest.mark.parametrize("prefetch", [False, True], ids=["in-round", "read-ahead"])
def test_a_3x_slowdown_is_detected_mitigated_and_undone(api: Api, prefetch: bool) -> None:
    c = Cluster(api, "adaptive", slow={2: (80, 160, 3.0)}, prefetch=prefetch)
    c.run(80)
    settled = len(c.plans())
    assert c.events() == [], "no event for +-5% noise"
    c.run(80)  # iterations 80..159: rank 2 three times slower
    events = c.events()
    assert len(events) == 1
    e = events[0]
    assert e["rank"] == 2 and e["kind"] == "dynamic"
    assert 78 <= e["start_iteration"] <= 82 and e["detail"]["confirmed_iteration"] - 80 <= 5
    assert 2.2 <= e["severity"] <= 3.5  # measured against a model fitted from noisy timings
    reactions = [p for p in c.plans()[settled:] if p["reason"].startswith("straggler ladder")]
    assert reactions, "the ladder reacted"
    first = reactions[0]
    assert first["batch_sizes"][2] < c.plans()[settled - 1]["batch_sizes"][2]
    assert e["action"] not in ("", "none")
    c.run(60)  # recovered
    e = c.events()[0]
    assert e["end_iteration"] is not None and 160 <= e["end_iteration"] <= 166
    assert e["end_iteration"] <= e["detail"]["closed_iteration"] <= e["end_iteration"] + 5
    changes = [p for p in c.plans()[settled:] if p["reason"].startswith("straggler ladder")]
    assert 1 <= len(changes) <= 1 + 2 + 1, "one reaction, at most two more, and one to undo"
    final = c.plan()["batch_sizes"]
    assert abs(final[2] - c.plans()[settled - 1]["batch_sizes"][2]) <= 4, "back to the normal plan"


def test_a_job_of_one_gpu_model_settles_and_its_straggler_is_answered(api: Api) -> None:
    """Every rank alike: the plan on guesses is the plan in force, so exploring moves the
    ranks in pairs. Before, no rank could move: the job explored (refitting every rank) at
    every cadence for ever, had no normal models, and the ladder never answered a straggler."""
    c = Cluster(api, "adaptive", slow={2: (80, 160, 3.0)}, per_sample=[1.0] * 4)
    c.run(80)
    reasons = [p["reason"] for p in c.plans()]
    assert any("exploring" in r for r in reasons), reasons
    last = c.state.decisions[c.job]
    assert not last.exploring, "identified and settled"
    assert len(c.state.watches[c.job].normal) == 4, "a normal model for every rank"
    settled = len(c.plans())
    c.run(40)  # rank 2 three times slower from iteration 80
    (event,) = c.events()
    assert event["rank"] == 2 and event["kind"] == "dynamic"
    reactions = [p for p in c.plans()[settled:] if p["reason"].startswith("straggler ladder")]
    assert reactions, "the ladder answered"
    assert reactions[0]["batch_sizes"][2] < min(reactions[0]["batch_sizes"][r] for r in (0, 1, 3))


def test_static_keeps_its_plan_but_events_are_still_reported(api: Api) -> None:
    c = Cluster(api, "static", slow={3: (60, 200, 3.0)})
    c.run(60)
    settled = c.plan()["version"]
    c.run(60)
    assert c.plan()["version"] == settled
    events = c.events()
    assert [e["rank"] for e in events] == [3] and events[0]["action"] == "none"


def test_a_10x_straggler_keeps_only_a_sliver_when_the_all_reduce_is_cheap(api: Api) -> None:
    # 1 ms of all-reduce, not slowed by the straggler: leaving the group would buy nothing.
    c = Cluster(api, "adaptive", slow={1: (60, 140, 10.0)}, slow_all_reduce=False)
    c.run(140)
    assert c.plan()["batch_sizes"][1] <= B // 20 and c.plan()["excluded"] == []
    c.run(60)
    assert c.plan()["batch_sizes"][1] > B // 5, "given its share back once it recovered"


def test_a_10x_straggler_leaves_the_all_reduce_and_comes_back(api: Api) -> None:
    # The all-reduce costs 40 ms here, and a 10x slower rank would slow it too: leaving pays.
    c = Cluster(api, "adaptive", slow={1: (60, 140, 10.0)}, sync_ms=40.0)
    c.run(140)
    out = [p for p in c.plans() if 1 in p["excluded"]]
    assert out, "rank 1 was taken out of the all-reduce group"
    assert all(p["batch_sizes"][1] == 0 and sum(p["batch_sizes"]) == B for p in out)
    assert out[0]["version"] - c.plans()[0]["version"] <= 6
    c.run(80)  # its probes show it recovered: readmitted
    final = c.plan()
    assert final["excluded"] == [] and final["batch_sizes"][1] > 0
    event = next(e for e in c.events() if e["rank"] == 1)
    assert "exclude" in event["action"] and event["end_iteration"] is not None


def test_a_job_that_may_not_exclude_re_plans_around_its_10x_straggler(api: Api) -> None:
    # The situation above, where leaving pays; the spec says no rank leaves: it is re-planned.
    c = Cluster(api, "adaptive", slow={1: (60, 140, 10.0)}, sync_ms=40.0, exclude=False)
    c.run(140)
    assert all(p["excluded"] == [] for p in c.plans())
    shares = [p["batch_sizes"][1] for p in c.plans()]
    assert 0 < min(shares) < max(shares) / 5, shares  # its share cut, not to nothing
    assert any(e["rank"] == 1 for e in c.events())


def test_a_10x_straggler_stays_in_the_group_when_the_all_reduce_does_not_slow(api: Api) -> None:
    # The same costly all-reduce, but measured not to slow with the straggler (contention for its
    # compute only, as in the emulation): leaving would buy nothing, re-planning does it all.
    c = Cluster(api, "adaptive", slow={1: (60, 140, 10.0)}, sync_ms=40.0, slow_all_reduce=False)
    c.run(140)
    assert all(p["excluded"] == [] for p in c.plans())
    assert c.plan()["batch_sizes"][1] <= B // 20


def test_switching_costs_follow_the_backend_and_the_measured_all_reduce(api: Api) -> None:
    c = Cluster(api, "adaptive", slow={})
    c.run(1)
    with transaction(api.client.app.state.context.sessions) as s:  # type: ignore[attr-defined]
        job = s.get(Job, c.job)
        assert job is not None
        measured = stragglers.ladder_config(s, job, 20.0)
        unmeasured = stragglers.ladder_config(s, job, 0.0)
    assert measured.regroup_ms == stragglers.GLOO_REGROUP_MS  # every device is a CPU: gloo
    assert measured.resync_ms == stragglers.RESYNC_PER_ALL_REDUCE * 20.0
    assert unmeasured.resync_ms == LadderConfig().resync_ms


@pytest.mark.parametrize("policy", ["minmax", "adaptive"])
def test_epoch_tails_and_a_slow_by_design_rank_open_no_event(api: Api, policy: str) -> None:
    """Rank 3 is four times slower by design, and every eighth iteration is an epoch's partial
    batch of 5 samples taking up to half a full batch's time: neither is an event."""
    c = Cluster(api, policy, slow={}, epoch=8)
    c.run(200)
    assert c.events() == []


def test_events_still_open_close_when_the_job_ends(api: Api) -> None:
    c = Cluster(api, "adaptive", slow={2: (60, 10**9, 3.0)})
    c.run(100)
    (event,) = c.events()
    assert event["end_iteration"] is None
    r = api.client.post(f"/api/v1/jobs/{c.job}/cancel", headers=api.headers())
    assert r.status_code == 200, r.text
    (event,) = c.events()
    assert event["end_iteration"] == 100  # after the last iteration reported (99)
    assert event["detail"]["closed_by"] == "job ended"


def test_a_settled_job_is_not_priced_every_round_yet_a_slowdown_is_answered_at_once(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While nothing changes (no open event; plan, normal models, overrides the same) the
    ladder of a settled job is asked at most every ``REFRESH_EVERY`` iterations, not every
    round; detection still sees every iteration, and once an event opens the ladder is asked
    every round until it closes."""
    asked: list[int] = []
    decide = stragglers.decide

    def counting(situation: Any, *a: Any, **kw: Any) -> Any:
        asked.append(situation.iteration)
        return decide(situation, *a, **kw)

    monkeypatch.setattr(stragglers, "decide", counting)
    c = Cluster(api, "adaptive", slow={2: (80, 160, 3.0)})
    c.run(80)
    settled = len(c.plans())
    quiet = [i for i in asked if 50 <= i < 80]
    assert len(quiet) <= 30 // stragglers.REFRESH_EVERY + 2, quiet  # was one per round
    c.run(80)  # iterations 80..159: rank 2 three times slower
    (event,) = c.events()
    assert event["rank"] == 2 and 78 <= event["start_iteration"] <= 82
    detected = event["detail"]["detected_iteration"]
    assert event["detail"]["confirmed_iteration"] - 80 <= 5, "detection is as prompt as ever"
    open_rounds = range(detected, 160)
    assert set(open_rounds) <= set(asked), "asked every round while the event is open"
    assert any(p["reason"].startswith("straggler ladder") for p in c.plans()[settled:])


def test_a_sweep_whose_rebalancer_makes_a_plan_still_stores_the_detectors_event(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The detector is fed and its events stored before the rebalancer decides: a straggler's
    event is stored in the sweep that has its slow iterations, even when the rebalancer makes a
    plan in that sweep (at fleet scale a straggler's urgent sweep of a young job made an
    exploring plan, and the event waited for the sweep after). Here the rebalancer is made to
    report a plan in every sweep after the slowdown begins."""
    c = Cluster(api, "adaptive", slow={2: (80, 160, 3.0)})
    c.run(80)
    assert c.events() == []
    rebalance = control_loop._rebalance
    made: list[int] = []

    def replanning(session: Any, job: Job, *a: Any, **kw: Any) -> int:
        version = rebalance(session, job, *a, **kw)
        made.append(job.id)
        return version if version is not None else job.plan_version

    monkeypatch.setattr(control_loop, "_rebalance", replanning)
    c.run(10)  # iterations 80..89: rank 2 three times slower
    assert len(made) == 10, "every sweep reported a plan"
    (event,) = c.events()
    assert event["rank"] == 2 and 78 <= event["start_iteration"] <= 82
    assert event["detail"]["confirmed_iteration"] - 80 <= 5, "as prompt as without the plans"


def test_an_event_written_in_a_sweep_that_rolled_back_is_written_by_the_next_sweep(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The detector reports each change of an event once. When the sweep that wrote it rolls
    back (a later step failed: a deadlock abort, the database gone), the job's next sweep
    writes it again; before, it stayed unwritten until the event changed again, and one that
    never changed again for good. Here the rebalancer fails in the sweep that writes the
    slowdown's first update, then in the one that writes its second (its confirmation)."""
    c = Cluster(api, "adaptive", slow={2: (80, 100_000, 3.0)})
    c.run(80)
    detect, rebalance = control_loop.detect, control_loop._rebalance
    reported: list[list[str]] = []
    failed: list[int] = []

    def detecting(*a: Any, **kw: Any) -> Any:
        detected = detect(*a, **kw)
        reported.append([u.change.value for u in detected.updates] if detected else [])
        return detected

    def failing(session: Any, job: Job, *a: Any, **kw: Any) -> int | None:
        if reported[-1] and len(failed) < 2:
            failed.append(c.iteration)
            raise RuntimeError("a later step of the sweep failed")
        return rebalance(session, job, *a, **kw)

    monkeypatch.setattr(control_loop, "detect", detecting)
    monkeypatch.setattr(control_loop, "_rebalance", failing)
    stored: list[list[dict[str, Any]]] = []
    while len(failed) < 2:
        assert c.iteration < 140, f"the slowdown was reported only at {failed}"
        try:
            c.run(1)
        except RuntimeError:
            stored.append(c.events())  # what the failed sweep leaves: none of its writes
            continue
        if failed:
            stored.append(c.events())
    c.run(1)
    (event,) = c.events()
    assert event["rank"] == 2 and 78 <= event["start_iteration"] <= 82
    assert event["detail"]["confirmed_iteration"] is not None, "the second update written"
    assert event["end_iteration"] is None
    assert stored[0] == [], "the first failed sweep wrote nothing that stayed"
    assert len(stored[1]) == 1, "the sweep after it wrote the event"
    assert stored[-1] == stored[1], "the second failed sweep left the event as it was"


def test_a_controller_that_takes_over_carries_on_the_events_stored_open(api: Api) -> None:
    """A controller that takes over (the active one failed) starts its watches afresh. A
    slowdown under way then was stored a second time and neither event ever closed: the new
    watch's detector, fed a window that held the slowdown, had no model of the rank's normal
    speed, so the rank never looked recovered and the ladder kept cutting its share. Now the stored
    event is the one the new watch updates, and it closes when the rank recovers, as it
    does under the controller that opened it."""
    c = Cluster(api, "adaptive", slow={2: (60, 140, 3.0)})
    c.run(100)
    (opened,) = c.events()
    assert (opened["rank"], opened["end_iteration"]) == (2, None)
    c.state = control_loop.LoopState()  # what a controller that takes over starts with
    c.run(100)
    (event,) = c.events()
    assert event["id"] == opened["id"] and event["start_iteration"] == opened["start_iteration"]
    assert event["end_iteration"] is not None and 138 <= event["end_iteration"] <= 145
    assert c.plan()["batch_sizes"][2] >= 32, "the recovered rank has its share back"


@pytest.mark.parametrize("policy", ["static", "adaptive"])
def test_a_controller_that_takes_over_keeps_a_settled_plan(api: Api, policy: str) -> None:
    """``static`` and ``adaptive`` plan on the measured models once, after warm-up, and keep
    that plan (adaptive's ladder acts on stragglers by hand-sized cuts it undoes). A controller
    that took over knew nothing of that decision, took the job for one still exploring and
    planned it again on the window it saw: in the middle of a 3x slowdown of rank 2, a plan
    that gave rank 2 no samples, so it was never measured again. Now the job says it has
    settled, and the new controller reads that."""
    c = Cluster(api, policy, slow={2: (60, 140, 3.0)})
    c.run(100)
    before = [p["version"] for p in c.plans() if p["source"] == "automatic"]
    assert before, "the rebalancer planned the job during warm-up"
    sessions = api.client.app.state.context.sessions  # type: ignore[attr-defined]
    with transaction(sessions) as s:  # a sweep that rolled back leaves the mark unwritten
        job = s.get(Job, c.job)
        assert job is not None and job.settled_through is not None
        job.settled_through = None
    c.run(1)
    with transaction(sessions) as s:
        job = s.get(Job, c.job)
        assert job is not None and job.settled_through is not None, "written again"
    c.state = control_loop.LoopState()  # what a controller that takes over starts with
    c.run(100)
    made = [p for p in c.plans() if p["source"] == "automatic" and p["version"] > before[-1]]
    if policy == "static":
        assert made == [], "a static job's plan never changes after warm-up"
    else:
        assert all(p["reason"].startswith("straggler ladder") for p in made), [
            p["reason"] for p in made
        ]
    assert min(c.plan()["batch_sizes"]) > 0


def test_a_static_plan_made_in_a_sweep_that_rolled_back_is_made_again(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``static`` job is planned on its measured models once, after warm-up. The controller
    remembered that decision in memory even when the sweep that made it rolled back (the
    database went away before its commit), so the plan was never stored and never made again:
    the job ran on its warm-up plan for good. Now a failed sweep leaves nothing of the job in
    the controller's memory, and the next one decides again."""
    c = Cluster(api, "static", slow={})
    context = api.client.app.state.context  # type: ignore[attr-defined]
    controller = Controller(context.settings, engine=context.engine, sessions=context.sessions)
    c.state = controller.state
    c.state.min_decision_interval_s = 0.0  # a decision whenever due, as the test's rounds
    real = control_loop.record
    failed: list[str] = []

    def record(session: Any, who: str, action: str, target: str, detail: Any = None) -> None:
        settling = action == "plan.automatic" and not detail["reason"].startswith("exploring")
        if settling and not failed:
            failed.append(detail["reason"])
            raise RuntimeError("the database went away before the sweep's commit")
        real(session, who, action, target, detail)

    monkeypatch.setattr(control_loop, "record", record)
    monkeypatch.setattr(c, "sweep", controller.sweep)
    monkeypatch.setattr(workqueue, "SWEEP_RETRY_FIRST_S", 0.0)  # tried again at once
    c.run(60)  # the failed sweep is logged; the rounds go on
    assert failed, "the sweep that settled the job failed"
    settled = [
        p
        for p in c.plans()
        if p["source"] == "automatic" and not p["reason"].startswith("exploring")
    ]
    assert len(settled) == 1, [p["reason"] for p in c.plans()]
    assert c.plan()["version"] == settled[0]["version"]


def test_a_restart_closes_the_events_still_open(api: Api) -> None:
    """The next attempt runs on other devices under a watch of its own: an event of the
    attempt before it ends with it (it stayed open through every later attempt)."""
    c = Cluster(api, "adaptive", slow={2: (60, 10**9, 3.0)})
    c.run(100)
    sessions = api.client.app.state.context.sessions  # type: ignore[attr-defined]
    with transaction(sessions) as s:
        job = s.get(Job, c.job)
        assert job is not None and job.settled_through is not None
        jobs.restart(s, job, "a rank's host was lost", datetime.now(UTC))
    (event,) = c.events()
    assert event["end_iteration"] == 100  # after the last iteration reported (99)
    assert event["detail"]["closed_by"] == "job restarted"
    with transaction(sessions) as s:
        job = s.get(Job, c.job)
        assert job is not None and job.settled_through is None, "the next attempt explores"


def test_a_sweep_the_ladder_is_asked_in_reads_neither_workers_nor_the_plan_again(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a straggler's event is open the ladder is asked every round. Those rounds take the
    job's number of ranks and its plan in force from its tracker, which read them once (the
    plan again only when a new one is made): loading the job's workers and the plan
    (``plans.current``) every round was a fifth of a settled fleet job's sweep."""
    c = Cluster(api, "adaptive", slow={2: (60, 100_000, 3.0)})
    c.run(60)
    engine = api.client.app.state.context.engine  # type: ignore[attr-defined]
    sweep, decide = control_loop.sweep, stragglers.decide
    rounds: list[tuple[int | None, list[str], int, bool]] = []
    asked: list[int] = []

    def watched(s: Any, state: Any, **kw: Any) -> Any:
        version = s.scalar(select(Job.plan_version).where(Job.id == c.job))
        with statements(engine) as sql:
            made = sweep(s, state, **kw)
        rounds.append((version, sql, len(asked), bool(made)))
        return made

    def counting(*a: Any, **kw: Any) -> Any:
        asked.append(1)
        return decide(*a, **kw)

    monkeypatch.setattr(control_loop, "sweep", watched)
    monkeypatch.setattr(stragglers, "decide", counting)
    c.run(40)
    (event,) = c.events()
    assert event["rank"] == 2 and event["end_iteration"] is None
    checked = 0
    for (before, _, was_asked, _), (version, sql, now_asked, made) in itertools.pairwise(rounds):
        if made or version != before or now_asked == was_asked:
            continue  # a plan made (its checks load the workers), a new plan, or no ladder
        assert [q for q in sql if "workers" in q] == []
        assert [q for q in sql if "FROM plans" in q] == []
        checked += 1
    assert checked >= 10, f"only {checked} of {len(rounds)} rounds asked the ladder unchanged"


def test_the_ladder_reads_the_devices_once(api: Api) -> None:
    """One query for every worker's device (not one per device), none while they stay put."""
    from sqlalchemy import event as sa_event

    c = Cluster(api, "adaptive", slow={})
    c.run(1)
    context = api.client.app.state.context  # type: ignore[attr-defined]
    statements: list[str] = []

    def count(*args: Any) -> None:
        statements.append(str(args[2]))

    sa_event.listen(context.engine, "before_cursor_execute", count)
    try:
        with transaction(context.sessions) as s:
            job = s.get(Job, c.job)
            assert job is not None
            _ = list(job.workers)  # loaded: what the round has at hand anyway
            watch = stragglers.Watch()
            statements.clear()
            first = stragglers.ladder_config(s, job, 20.0, watch)
            read = [q for q in statements if "devices" in q]
            statements.clear()
            again = stragglers.ladder_config(s, job, 20.0, watch)
            reread = [q for q in statements if "devices" in q]
    finally:
        sa_event.remove(context.engine, "before_cursor_execute", count)
    assert len(read) == 1 and reread == []
    assert first.regroup_ms == again.regroup_ms == stragglers.GLOO_REGROUP_MS


def test_a_steady_job_refits_its_normal_models_less_often_until_something_happens(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same plan, no event: the normal models are refitted every ``REFRESH_STEADY`` iterations,
    not every ``REFRESH_EVERY`` (each refit is a fit of every rank); once an event opens the
    refits come at ``REFRESH_EVERY`` again, and the event is found as promptly."""
    refits: list[int] = []
    refresh = stragglers._refresh_normal

    def counting(session: Any, job: Any, watch: Any, through: int, *a: Any) -> None:
        refits.append(through)
        refresh(session, job, watch, through, *a)

    monkeypatch.setattr(stragglers, "_refresh_normal", counting)
    c = Cluster(api, "adaptive", slow={2: (200, 300, 3.0)})
    c.run(200)
    steady = [i for i in refits if 100 <= i < 200]
    assert 1 <= len(steady) <= 2, refits  # every REFRESH_EVERY (25) iterations: 4
    c.run(60)  # iterations 200..259: rank 2 three times slower
    (event,) = c.events()
    assert event["rank"] == 2 and 198 <= event["start_iteration"] <= 202
    assert event["detail"]["confirmed_iteration"] - 200 <= 5
    during = [i for i in refits if i >= 200]
    assert len(during) >= 60 // stragglers.REFRESH_EVERY - 1, refits


def _override(c: Cluster, **body: Any) -> dict[str, Any]:
    r = c.api.client.post(
        f"/api/v1/jobs/{c.job}/overrides",
        json={"reason": "operator", **body},
        headers=c.api.headers(),
    )
    assert r.status_code in (200, 201), r.text
    data: dict[str, Any] = r.json()
    return data


def test_other_plans_keep_the_ladders_exclusion_until_one_brings_the_rank_back(api: Api) -> None:
    # Rank 1 stays 10x slow: the ladder takes it out of the group and keeps it out.
    c = Cluster(api, "adaptive", slow={1: (60, 10_000, 10.0)}, sync_ms=40.0)
    c.run(120)
    assert c.plan()["excluded"] == [1]
    churn = "breaks an operator's override"

    # An operator's pin of another rank: rank 1 stays out, and the ladder does not churn.
    preview = _override(c, kind="rebalance_now", preview=True)["plan"]
    assert preview["excluded"] == [1] and preview["batch_sizes"][1] == 0
    pinned = _override(c, kind="pin", rank=0, batch_size=64)["plan"]
    assert pinned["excluded"] == [1] and pinned["batch_sizes"][:2] == [64, 0]
    c.run(10)
    assert not any(churn in p["reason"] for p in c.plans())
    assert all(p["excluded"] == [1] for p in c.plans() if p["version"] >= pinned["version"])

    # A hand-made plan that gives it nothing keeps it out, and so does the rebalancer's.
    left_out = _override(c, kind="set_batches", batch_sizes=[64, 0, 96, 96])["plan"]
    assert left_out["excluded"] == [1]
    _override(c, kind="unfreeze")
    sessions = api.client.app.state.context.sessions  # type: ignore[attr-defined]
    with transaction(sessions) as s:
        job = s.get(Job, c.job)
        assert job is not None
        decision = rebalancer.propose(s, job, force=True)
        version = rebalancer.apply(s, job, decision, PlanSource.AUTOMATIC, by="test")
    assert version == left_out["version"] + 1, "96/96 is far from the best split of 2 and 3"
    assert c.plan()["excluded"] == [1] and c.plan()["batch_sizes"][:2] == [64, 0]

    # An operator's readmit brings it back; frozen, the ladder follows and holds.
    _override(c, kind="freeze")
    back = _override(c, kind="readmit", rank=1)["plan"]
    assert back is not None and back["excluded"] == [], "back in the group, with or without samples"
    assert "rank(s) 1 back in the all-reduce group" in back["reason"] or back["batch_sizes"][1] > 0
    c.run(5)
    assert c.state.watches[c.job].ladder.excluded == ()
    assert c.plan()["version"] == back["version"]
    _override(c, kind="unfreeze")  # the ladder's own again: it may take rank 1 out, for its reasons
    c.run(10)
    assert not any(churn in p["reason"] for p in c.plans())


def test_readmit_names_what_it_can_undo(api: Api) -> None:
    c = Cluster(api, "adaptive", slow={})
    c.run(3)
    r = c.api.client.post(
        f"/api/v1/jobs/{c.job}/overrides",
        json={"kind": "readmit", "rank": 1, "reason": "x"},
        headers=c.api.headers(),
    )
    assert r.status_code == 422 and r.json()["field"] == "rank"
    assert "neither excluded, pinned nor out of the all-reduce group" in r.json()["detail"]


def test_the_watch_reads_a_plans_batch_sizes_once(api: Api) -> None:
    """Each timing carries its rank's batch in its plan; a plan version's sizes are read when
    the watch first meets it, not every round (plans never change once made)."""
    from sqlalchemy import event as sa_event

    c = Cluster(api, "adaptive", slow={})
    context = api.client.app.state.context  # type: ignore[attr-defined]
    reads: list[str] = []

    def count(*args: Any) -> None:
        query = str(args[2])
        if "FROM plans" in query and "batch_sizes" in query and "plans.version IN" in query:
            reads.append(query)

    sa_event.listen(context.engine, "before_cursor_execute", count)
    try:
        c.run(30)  # exploring: a few plans
    finally:
        sa_event.remove(context.engine, "before_cursor_execute", count)
    versions = c.plan()["version"]
    assert 1 <= len(reads) <= versions, (len(reads), versions)  # not one per round (30)
    with transaction(context.sessions) as s:  # what the cache keeps matches the plans
        job = s.get(Job, c.job)
        assert job is not None
        rows = rebalancer.NewRows().read(s, job)
        first = stragglers.Watch()
        first.add(rows)
        fresh = stragglers._take(s, job, first, 29)
        again = stragglers.Watch(plan_sizes=dict(first.plan_sizes))
        again.add(rows)
        cached = stragglers._take(s, job, again, 29)
    # (iteration, [(rank, batch, compute ms, planned batch), ...]), each with its planned batch
    assert fresh == cached and all(t[3] is not None for _, group in fresh for t in group)
    assert len(fresh) >= 20 and all(group for _, group in fresh)


def test_a_sweep_reads_the_jobs_new_telemetry_once(api: Api) -> None:
    """The tracker, the fit window (the rebalancer's decisions, the watch's normal models) and
    the straggler watch take the same new rows: one read of them per sweep, and never the
    window again, through refreshes of the normal models and decisions alike."""
    from sqlalchemy import event as sa_event

    c = Cluster(api, "minmax", slow={2: (150, 170, 3.0)})
    c.run(120)  # explored and settled; the rebalancer decides every 10 iterations
    context = api.client.app.state.context  # type: ignore[attr-defined]
    reads: list[str] = []
    sweep = control_loop.sweep
    sweeping = False

    def count(*args: Any) -> None:
        query = str(args[2])
        if sweeping and "FROM iteration_telemetry" in query and "compute_ms" in query:
            reads.append(query)

    def counted(*a: Any, **kw: Any) -> Any:
        nonlocal sweeping
        sweeping = True
        try:
            return sweep(*a, **kw)
        finally:
            sweeping = False

    sa_event.listen(context.engine, "before_cursor_execute", count)
    control_loop.sweep = counted  # type: ignore[assignment]
    try:
        c.run(100)  # decisions, normal-model refreshes, an event opened and closed
    finally:
        control_loop.sweep = sweep  # type: ignore[assignment]
        sa_event.remove(context.engine, "before_cursor_execute", count)
    assert len(reads) == 100, len(reads)
    assert [e["rank"] for e in c.events()] == [2]
    assert len(c.plans()) > 3  # the rebalancer went on deciding from the kept window


def test_a_window_is_fitted_once_until_rows_come_in(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep that both decides (``propose``) and refreshes the watch's normal models fits
    each rank once: the fits are kept with the window until new rows come in, and a caller
    asking for another cap or granularity gets its own."""
    c = Cluster(api, "minmax", slow={})
    c.run(30)
    calls: list[int] = []

    def counting(fit: Any) -> Any:
        def counted(*a: Any, **kw: Any) -> Any:
            calls.append(1)
            return fit(*a, **kw)

        return counted

    for name in ("fit_model", "fit_arrays"):  # a whole read's fits, and a kept window's
        monkeypatch.setattr(rebalancer, name, counting(getattr(rebalancer, name)))
    sessions = api.client.app.state.context.sessions  # type: ignore[attr-defined]
    window = c.state.windows[c.job]
    with transaction(sessions) as s:
        job = s.get(Job, c.job)
        assert job is not None
        first = rebalancer.fits(s, job, kept=window)
        assert len(calls) == 4
        assert rebalancer.fits(s, job, kept=window) == first and len(calls) == 4
        fresh = rebalancer.fits(s, job)  # read whole, not kept: fitted afresh, the same
        assert fresh == first and len(calls) == 8
    kept = window.fitted
    assert kept is not None
    c.run(1)  # new rows: the kept fits are dropped (the sweep may have fitted them again)
    assert window.fitted is not kept
    with transaction(sessions) as s:
        job = s.get(Job, c.job)
        assert job is not None
        rebalancer.fits(s, job, kept=window)
        after = len(calls)
        rebalancer.fits(s, job, kept=window)
        assert len(calls) == after
