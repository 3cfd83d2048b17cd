"""A controller round costs the jobs with new telemetry, not every live job on the cluster."""

from __future__ import annotations

import time
from typing import Any

import pytest

from server import controller as controller_module
from server.context import context_of
from server.controller import Controller
from server.db import transaction
from server.notify import PLACEMENT
from server.services import control_loop
from tests.harness import Api, statements


def _post(api: Api, job: int, iterations: range) -> None:
    records: list[dict[str, Any]] = [
        {
            "rank": rank,
            "iteration": it,
            "plan_version": 1,
            "batch_size": 16,
            "data_ms": 1.0,
            "compute_ms": 10.0,
            "sync_ms": 2.0,
            "ts": 1_700_000_000.0 + it,
        }
        for it in iterations
        for rank in range(2)
    ]
    r = api.client.post(
        f"/api/v1/jobs/{job}/telemetry", json={"records": records}, headers=api.headers()
    )
    assert r.status_code == 200, r.text


def _jobs_on_hosts(api: Api, hosts: str) -> list[int]:
    """A 2-rank job on each of ``hosts`` (one letter each), placed as it is submitted."""
    jobs = []
    for host in hosts:
        api.register(host, devices=2)
        jobs.append(int(api.submit(workers=2, global_batch=32)["id"]))  # type: ignore[call-overload]
    return jobs


def _controller(api: Api) -> Controller:
    context = context_of(api.client.app)  # type: ignore[arg-type]
    return Controller(context.settings, engine=context.engine, sessions=context.sessions)


def _due(api: Api, state: control_loop.LoopState) -> list[int]:
    sessions = context_of(api.client.app).sessions
    with transaction(sessions) as s:
        live = control_loop.live_jobs(s)
        due = control_loop.jobs_to_sweep(s, state, live)
    for job_id in due:  # swept now; far from idle for the rest of the test
        state.swept_at[job_id] = 1e18
    return due


def test_only_jobs_with_new_telemetry_are_swept(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(control_loop, "REREAD_IDS", 0)  # judge by exactly the new rows
    jobs = _jobs_on_hosts(api, "abc")
    state = control_loop.LoopState()
    assert sorted(_due(api, state)) == sorted(jobs)  # never swept: all of them, once
    assert _due(api, state) == []  # nothing new anywhere
    _post(api, jobs[1], range(0, 5))
    assert _due(api, state) == [jobs[1]]
    assert _due(api, state) == []
    _post(api, jobs[0], range(0, 3))
    _post(api, jobs[2], range(0, 3))
    assert sorted(_due(api, state)) == [jobs[0], jobs[2]]


def test_an_idle_job_is_still_swept_now_and_then(api: Api) -> None:
    api.register("a", devices=2)
    job = int(api.submit(workers=2, global_batch=32)["id"])  # type: ignore[call-overload]
    state = control_loop.LoopState()
    state.swept_at[job] = 0.0  # long ago on the monotonic clock
    sessions = context_of(api.client.app).sessions
    with transaction(sessions) as s:
        assert control_loop.jobs_to_sweep(s, state, [job]) == [job]


def test_urgent_jobs_are_swept_first_even_when_poked_mid_round(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At fleet scale a round over every job with new data takes seconds: a job whose worker
    sent urgent telemetry (a straggler starting) goes first, and one poked while a round is
    under way goes next, not after the rest of the round."""
    jobs = _jobs_on_hosts(api, "abcd")
    controller = _controller(api)
    order: list[int] = []
    poked_mid_round: list[int] = []

    def sweep_job(job_id: int) -> None:
        if not poked_mid_round:  # a worker of the last job turns urgent while one is swept
            poked_mid_round.append(jobs[3])
            controller.poke([jobs[3]])
        order.append(job_id)
        controller.state.swept_at[job_id] = time.monotonic()

    monkeypatch.setattr(controller, "_sweep_job", sweep_job)
    controller.poke([jobs[2]])
    controller.sweep()
    assert order[:2] == [jobs[2], jobs[3]]
    assert sorted(order) == sorted(jobs)  # each once: never swept, all of them are due
    order.clear()
    controller.poke([jobs[1], PLACEMENT])
    controller.sweep()  # nothing new but the poke: the urgent job is swept all the same
    assert order == [jobs[1]]


def test_a_job_submitted_during_a_round_is_placed_before_the_round_ends(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = _jobs_on_hosts(api, "abc")
    api.register("d", devices=2)
    controller = _controller(api)
    controller.place()  # nothing pending: the jobs above were placed as they were submitted
    monkeypatch.setattr(controller_module, "PLACE_GAP_S", 0.0)  # (it ran just now)
    steps: list[str] = []
    submitted: list[int] = []
    place = controller.place

    def sweep_job(job_id: int) -> None:
        steps.append(f"sweep {job_id}")
        if not submitted:  # the wake bus pokes the controller for placement
            submitted.append(int(api.submit(workers=2, global_batch=32, place=False)["id"]))  # type: ignore[call-overload]
            controller.poke([PLACEMENT])

    def placing() -> list[int]:
        placed = place()
        steps.append(f"placed {placed}")
        return placed

    monkeypatch.setattr(controller, "_sweep_job", sweep_job)
    monkeypatch.setattr(controller, "place", placing)
    controller.sweep()
    assert steps[:2] == [f"sweep {jobs[0]}", f"placed {submitted}"]
    assert len(steps) == 1 + 1 + 2  # the other two jobs swept after it, placement not again


def test_an_urgent_job_poked_again_is_swept_again_in_the_same_round(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A straggler's ranks post their urgent batches one by one: the iteration is judged once
    every rank has reported it, so the job is swept on each, not left for the next round."""
    jobs = _jobs_on_hosts(api, "abc")
    controller = _controller(api)
    order: list[int] = []

    def sweep_job(job_id: int) -> None:
        if len(order) == 1:  # the straggler's second rank reports while another job is swept
            controller.poke([jobs[1]])
        order.append(job_id)

    monkeypatch.setattr(controller, "_sweep_job", sweep_job)
    controller.poke([jobs[1]])
    controller.sweep()
    assert order == [jobs[1], jobs[0], jobs[1], jobs[2]]


def test_a_hot_job_with_new_telemetry_is_swept_again_in_the_same_round(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A straggler's urgent batch comes from its own host; its ranks on other hosts report the
    slow iteration with their next regular batch, and the iteration is judged only once every
    rank has. A job poked as urgent stays hot for a while: telemetry of it that arrives during
    a round has it swept again before the round ends. Another job's new rows wait their turn."""
    jobs = _jobs_on_hosts(api, "abc")
    controller = _controller(api)
    monkeypatch.setattr(controller_module, "HOT_CHECK_S", 0.0)
    order: list[int] = []
    posted = [0]

    def sweep_job(job_id: int) -> None:
        if len(order) == 1:  # while another job is swept, both get their next rows
            first = posted[0]
            posted[0] += 3
            _post(api, jobs[1], range(first, first + 3))
            _post(api, jobs[2], range(first, first + 3))
        order.append(job_id)

    monkeypatch.setattr(controller, "_sweep_job", sweep_job)
    controller.poke([jobs[1]])
    controller.sweep()
    assert order == [jobs[1], jobs[0], jobs[1], jobs[2]]
    order.clear()
    monkeypatch.setattr(controller_module, "HOT_S", 0.0)
    controller.poke([jobs[1]])  # hot no more: swept for the poke, its next rows wait their turn
    controller.sweep()
    assert order[:2] == [jobs[1], jobs[0]]
    assert order.count(jobs[1]) == 1


def test_a_sweep_counts_a_jobs_ranks_once_not_every_round(api: Api) -> None:
    """The tracker counts the job's ranks on its first round; later rounds of the same attempt
    read no worker rows (a 256-rank job's workers were loaded every round to count them). The
    ``equal`` policy makes no decisions, which read them for the models."""
    api.register("a", devices=2)
    job = int(api.submit(workers=2, global_batch=32, policy={"name": "equal"})["id"])  # type: ignore[call-overload]
    state = control_loop.LoopState()
    context = context_of(api.client.app)
    for first, last in ((0, 4), (5, 9), (10, 14)):
        _post(api, job, range(first, last + 1))
        with statements(context.engine) as sql, transaction(context.sessions) as s:
            control_loop.sweep_job(s, state, job, watch=False)
        worker_reads = [q for q in sql if "FROM workers" in q]
        if first == 0:
            assert worker_reads, "the first round counts the ranks"
        else:
            assert worker_reads == []


def test_a_round_places_between_sweeps_at_most_once_per_gap(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asked for placement before every job's sweep (a fleet's submissions and ends), a round
    places once per ``PLACE_GAP_S``, not between every two sweeps."""
    _jobs_on_hosts(api, "abcd")
    controller = _controller(api)
    monkeypatch.setattr(controller_module, "PLACE_GAP_S", 3600.0, raising=False)
    steps: list[str] = []
    place = controller.place

    def sweep_job(job_id: int) -> None:
        steps.append("sweep")
        controller.poke([PLACEMENT])

    def placing() -> list[int]:
        steps.append("place")
        return place()

    monkeypatch.setattr(controller, "_sweep_job", sweep_job)
    monkeypatch.setattr(controller, "place", placing)
    controller.sweep()
    assert steps == ["sweep", "place", "sweep", "sweep", "sweep"]
    assert controller._place_now  # the rest waits for the gap, or the round's end
