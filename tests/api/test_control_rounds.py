"""A controller round costs the jobs with new telemetry, not every live job on the cluster."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server import controller as controller_module
from server import workqueue
from server.context import context_of
from server.controller import Controller
from server.db import transaction
from server.notify import PLACEMENT
from server.services import control_loop, scheduler
from server.workqueue import CpuPace
from tests.harness import Api, statements, until


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


def test_one_jobs_failing_sweep_does_not_stop_the_others(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job whose sweep fails (a bug its data brings out, a deadlock) ended the round, and the
    jobs queued after it were never swept while it kept failing. Now the round goes on with
    them, and the failing job is taken up afresh after a wait (each try re-reads its history);
    a round ends early only once several sweeps in a row fail (the database is away)."""
    jobs = _jobs_on_hosts(api, "abcd")
    controller = _controller(api)
    swept: list[int] = []
    failing = {jobs[0], jobs[2]}
    real = control_loop.sweep_job

    def sweep_job(session: Any, state: Any, job_id: int, **kw: Any) -> Any:
        swept.append(job_id)
        out = real(session, state, job_id, **kw)
        if job_id in failing:
            raise RuntimeError(f"job {job_id}'s data brings out a bug")
        return out

    monkeypatch.setattr(control_loop, "sweep_job", sweep_job)
    controller.sweep()
    assert sorted(swept) == sorted(jobs), "every job swept, those after a failing one too"
    assert set(controller.state.trackers) == {jobs[1], jobs[3]}, "the failed ones forgotten"
    swept.clear()
    for job in jobs:
        _post(api, job, range(0, 3))
    controller.sweep()
    assert sorted(swept) == sorted([jobs[1], jobs[3]]), "the failed ones wait before a new try"
    for job in jobs:
        controller.queue.forget(job)  # (their waits over)
    failing.update(jobs)
    swept.clear()
    for job in jobs:
        _post(api, job, range(3, 6))
    with pytest.raises(RuntimeError):
        controller.sweep()
    assert len(swept) == workqueue.ROUND_GIVES_UP_AFTER


def test_placement_and_the_rounds_do_not_wait_for_each_other(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Placement runs on a thread of its own (``Controller.placements``): a job submitted while
    a sweep is under way is placed before the sweep ends, and a round sweeps every job while a
    placement pass is under way (at fleet scale one takes a second or more: CBC solving)."""
    jobs = _jobs_on_hosts(api, "ab")
    api.register("c", devices=2)
    controller = _controller(api)
    stop, done = threading.Event(), threading.Event()
    placer = threading.Thread(target=controller.placements, args=(stop, done), daemon=True)
    placer.start()
    try:
        release, sweeping = threading.Event(), threading.Event()
        real_sweep = controller._sweep_job

        def held(job_id: int) -> None:
            sweeping.set()
            release.wait(20)
            real_sweep(job_id)

        monkeypatch.setattr(controller, "_sweep_job", held)
        sweeper = threading.Thread(target=controller.sweep, daemon=True)
        sweeper.start()
        assert sweeping.wait(10)
        job = int(api.submit(workers=2, global_batch=32, place=False)["id"])  # type: ignore[call-overload]
        controller.poke([PLACEMENT])
        until(
            lambda: (
                api.client.get(f"/api/v1/jobs/{job}", headers=api.headers()).json()["status"]
                != "pending"
            )
        )
        assert sweeper.is_alive(), "placed while the sweep was still held"
        release.set()
        sweeper.join(20)

        monkeypatch.setattr(controller, "_sweep_job", real_sweep)
        placing, unblock = threading.Event(), threading.Event()
        real_place = controller.place

        def slow_place() -> list[int]:
            placing.set()
            unblock.wait(20)
            return real_place()

        monkeypatch.setattr(controller, "place", slow_place)
        controller.poke([PLACEMENT])
        assert placing.wait(10)
        swept_before = controller.rounds
        controller.sweep()  # returns while the placement pass is still held
        assert controller.rounds == swept_before + 1 and not unblock.is_set()
        assert set(jobs) <= set(controller.state.swept_at)
        unblock.set()
    finally:
        done.set()
        controller._place_wake.set()
        placer.join(20)


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
    monkeypatch.setattr(workqueue, "HOT_CHECK_S", 0.0)
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
    monkeypatch.setattr(workqueue, "HOT_S", 0.0)
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


def test_placement_passes_are_paced_however_often_asked(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asked for placement all the time (a fleet's submissions and ends), passes start at once
    for a burst of ``PLACE_BURST``, then once per ``PLACE_GAP_S``."""
    monkeypatch.setattr(controller_module, "PLACE_GAP_S", 0.3)
    monkeypatch.setattr(controller_module, "PLACE_BURST", 2)
    controller = _controller(api)
    starts: list[float] = []

    def a_pass(*_: Any, **__: Any) -> list[Any]:
        starts.append(time.monotonic())
        time.sleep(0.05)
        return []

    monkeypatch.setattr(scheduler, "place_pending", a_pass)
    stop, done = threading.Event(), threading.Event()
    placer = threading.Thread(target=controller.placements, args=(stop, done), daemon=True)
    placer.start()
    try:
        asked = time.monotonic()
        while time.monotonic() < asked + 1.5:
            controller.poke([PLACEMENT])
            time.sleep(0.01)
    finally:
        done.set()
        controller._place_wake.set()
        placer.join(20)
    assert starts and starts[0] - asked < 0.2, "the first pass starts at once"
    assert starts[1] - starts[0] < 0.2, "and the burst's second"
    # Then one per 0.3 s (the first gap a little less: the bucket refilled during a pass).
    paced = [b - a for a, b in itertools.pairwise(starts[1:])]
    assert len(paced) >= 3 and all(g >= 0.2 for g in paced), paced
    assert sum(paced[1:]) / len(paced[1:]) >= 0.28, paced
    assert len(starts) <= 2 + 1.5 / 0.3 + 1


def test_a_job_that_starts_during_a_round_is_swept_when_poked_in_it(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet's round takes seconds; a job that started after it began and turns urgent (a
    straggler whose slowdown comes early) is swept in this round, not left for the next."""
    jobs = _jobs_on_hosts(api, "ab")
    controller = _controller(api)
    monkeypatch.setattr(workqueue, "HOT_CHECK_S", 0.0)
    order: list[int] = []
    late: list[int] = []

    def sweep_job(job_id: int) -> None:
        if not late:  # while the first job is swept, a new one starts and posts urgently
            late.extend(_jobs_on_hosts(api, "c"))
            controller.poke(late)
            controller.poke([999_999])  # no such job: nothing to sweep
        order.append(job_id)

    monkeypatch.setattr(controller, "_sweep_job", sweep_job)
    controller.sweep()
    assert order[1] == late[0]
    assert sorted(order) == sorted([*jobs, *late])


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@settings(max_examples=200, deadline=None)
@given(
    cores=st.floats(0.05, 2.0),
    burst=st.floats(0.0, 0.5),
    steps=st.lists(st.tuples(st.floats(0.0, 0.3), st.floats(0.0, 2.0)), min_size=1, max_size=40),
)
def test_paced_work_takes_no_more_than_its_cores_and_burst(
    cores: float, burst: float, steps: list[tuple[float, float]]
) -> None:
    """Work started only when the pace allows takes at most ``cores`` of the time since the
    start, plus the burst and the last piece (which it cannot know before it runs); idle time
    earns credit for no more than the burst."""
    clock = _Clock()
    pace = CpuPace(cores, burst_s=burst, clock=clock)
    spent = 0.0
    for cpu, idle in steps:
        clock.now += pace.wait_s()  # wait as long as it says
        assert pace.wait_s() <= 1e-9
        clock.now += cpu  # the work itself (its CPU as its wall time: the most it could be)
        pace.spend(cpu)
        spent += cpu
        assert spent <= cores * clock.now + burst + cpu + 1e-9
        clock.now += idle  # nothing to do
    clock.now += 1000.0
    assert pace.wait_s() == 0.0
    pace.spend(burst + cores)  # a long idle spell earned the burst, no more
    assert pace.wait_s() == pytest.approx(1.0)


def _burn(cpu_s: float) -> None:
    start = time.thread_time()
    while time.thread_time() - start < cpu_s:
        pass


def test_a_paced_round_spaces_its_sweeps_yet_takes_an_urgent_job_at_once(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``controller_cores`` the sweeps of a round wait for the CPU the ones before took to
    be paid back (``CpuPace``); a job poked meanwhile (a straggler) is swept at once, not
    after the wait, and what it took is paid back too."""
    jobs = _jobs_on_hosts(api, "abcd")
    controller = _controller(api)
    cores = 0.01
    controller.queue.pace = CpuPace(cores, burst_s=0.0)  # 10 ms of CPU: 1 s to pay back
    swept: list[tuple[int, float, float]] = []  # job, wall start, thread CPU taken
    poked: list[int] = []

    def sweep_job(job_id: int) -> None:
        t0, cpu = time.monotonic(), time.thread_time()
        _burn(0.01)
        swept.append((job_id, t0, time.thread_time() - cpu))
        controller.state.swept_at[job_id] = time.monotonic()
        if len(swept) == 1:  # a worker of another job turns urgent while the round waits
            poked.append(max(set(jobs) - {job_id}))
            threading.Timer(0.05, controller.poke, args=(poked,)).start()

    monkeypatch.setattr(controller, "_sweep_job", sweep_job)
    controller.sweep()
    order = [j for j, _, _ in swept]
    assert order[1:2] == poked and sorted(order) == sorted(jobs)
    first_start, urgent_start = swept[0][1], swept[1][1]
    assert urgent_start - first_start < 0.6, "the urgent job waited for the pace"
    # a regular sweep starts only once the CPU of every sweep before it is paid back
    last_start = swept[-1][1]
    paid = sum(cpu for _, _, cpu in swept[:-1]) / cores
    assert last_start - first_start >= paid - 0.05, "a regular sweep did not wait for the pace"


def test_a_sweep_rolled_back_leaves_the_trackers_plan_readable(api: Api) -> None:
    """The tracker keeps the plan in force across rounds (``Tracker.plan``). A sweep whose
    transaction rolls back (the database aborted it, an error in the round) must not leave
    it expired and detached: the job's next sweeps read it as before."""
    (job,) = _jobs_on_hosts(api, "a")
    state = control_loop.LoopState()
    sessions = context_of(api.client.app).sessions  # type: ignore[arg-type]
    _post(api, job, range(0, 5))
    with pytest.raises(RuntimeError), transaction(sessions) as s:
        control_loop.sweep_job(s, state, job)  # the tracker reads the plan in this one
        raise RuntimeError("the round failed after the sweep")
    for first in (5, 10):
        _post(api, job, range(first, first + 5))
        with transaction(sessions) as s:
            control_loop.sweep_job(s, state, job)
    plan = state.trackers[job].plan
    assert plan is not None and plan.version == 1 and list(plan.batch_sizes) == [16, 16]
