"""Bounded telemetry: rows older than the retention window become per-rank rollups, and the
charts, the models and the placement priors read rollups and raw rows as one history."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from server.context import context_of
from server.controller import Controller
from server.db import transaction
from server.models import JOB_RANK, IterationTelemetry, Job, TelemetryRollup
from server.services import control_loop, rebalancer, retention, scheduler
from server.services.rebalancer import NewRows, Tracker
from tests.harness import Api, make_settings, statements
from tests.ui.simulated import emulated_iteration

T, R = IterationTelemetry, TelemetryRollup


def _job(api: Api, workers: int = 2) -> int:
    api.register("h", devices=workers)
    return int(api.submit(workers=workers, global_batch=64)["id"])  # type: ignore[call-overload]


def _post(api: Api, job: int, its: range, version: int, *, ts0: float = 1000.0) -> None:
    records: list[dict[str, Any]] = []
    for it in its:
        # Rank 1 is slow now and then, so bucket means, minima and maxima all differ.
        records += emulated_iteration(
            it,
            version,
            [40, 24] if version > 1 else [32, 32],
            [0.5, 1.0],
            slowdown=lambda rank, i: 1.0 + (rank == 1) * ((i * 7) % 13) / 4,
            ts=ts0 + it * 0.1,
        )
    for start in range(0, len(records), 4000):
        r = api.client.post(
            f"/api/v1/jobs/{job}/telemetry",
            json={"records": records[start : start + 4000]},
            headers=api.headers(),
        )
        assert r.status_code == 200, r.text


def _series(api: Api, job: int, points: int) -> dict[str, Any]:
    r = api.client.get(f"/api/v1/jobs/{job}/series?points={points}", headers=api.headers())
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    out.pop("last_id")
    return out


def _roll_up_all(api: Api, job: int, window: retention.Window) -> int:
    ctx = context_of(api.client.app)  # type: ignore[arg-type]
    keeper = retention.Retention(window)
    removed = 0
    while True:
        with transaction(ctx.sessions) as s:
            moved = keeper.roll_up(s, job)
        removed += moved
        if not moved:
            return removed


def _count(api: Api, *where: Any, table: Any = T) -> int:
    with transaction(context_of(api.client.app).sessions) as s:  # type: ignore[arg-type]
        return int(s.scalar(select(func.count()).select_from(table).where(*where)) or 0)


def test_charts_read_the_same_history_after_roll_up(api: Api) -> None:
    job = _job(api)
    _post(api, job, range(0, 600), 1)
    _post(api, job, range(600, 1000), 2)
    before = _series(api, job, points=10)  # buckets of 100 iterations, like the rollups'
    removed = _roll_up_all(api, job, retention.Window(keep_iterations=300, keep_running_s=0))
    # Iterations 0..699 move (whole buckets outside the newest 300); 700..999 stay raw.
    assert removed == 700 * 2
    assert _count(api, T.job_id == job) == 300 * 2
    assert _count(api, R.job_id == job, R.rank != JOB_RANK, table=R) == 7 * 2
    assert _count(api, R.job_id == job, R.rank == JOB_RANK, table=R) == 7
    after = _series(api, job, points=10)
    assert after == before


def test_charts_read_no_raw_row_of_the_rolled_up_iterations(api: Api) -> None:
    """A row stored again after its iteration was rolled up (a post retried that late: the
    key that dedupes retries no longer holds the row) is not counted twice: the charts read
    raw rows only after the rolled-up iterations. That is also what keeps a long job's chart
    fast right after its roll-up, before the deleted rows' index entries are vacuumed
    (bench/retention.py: 0.21 s against 1.17 s)."""
    job = _job(api)
    _post(api, job, range(0, 1000), 1)
    _roll_up_all(api, job, retention.Window(keep_iterations=300, keep_running_s=0))
    before = _series(api, job, points=10)
    assert before["first_iteration"] == 0 and before["last_iteration"] == 999
    _post(api, job, range(50, 51), 1)  # iteration 50 again, both ranks
    assert _count(api, T.job_id == job, T.iteration == 50) == 2
    assert _series(api, job, points=10) == before


def test_rollups_keep_count_mean_min_and_max(api: Api) -> None:
    job = _job(api)
    _post(api, job, range(0, 400), 1)
    _roll_up_all(api, job, retention.Window(keep_iterations=200, keep_running_s=0))
    first = api.client.get(f"/api/v1/jobs/{job}/telemetry?limit=1", headers=api.headers())
    assert first.json()["items"][0]["iteration"] == 200  # by iteration: the oldest kept
    with transaction(context_of(api.client.app).sessions) as s:  # type: ignore[arg-type]
        first = s.scalars(
            select(R).where(R.job_id == job, R.rank == 1).order_by(R.first_iteration)
        ).first()
        job_level = s.scalars(
            select(R).where(R.job_id == job, R.rank == JOB_RANK).order_by(R.first_iteration)
        ).first()
    expected = [
        emulated_iteration(
            it,
            1,
            [32, 32],
            [0.5, 1.0],
            slowdown=lambda rank, i: 1.0 + (rank == 1) * ((i * 7) % 13) / 4,
        )
        for it in range(0, 100)
    ]
    compute = [e[1]["compute_ms"] for e in expected]
    slowest = [max(r["data_ms"] + r["compute_ms"] + r["sync_ms"] for r in e) for e in expected]
    assert first is not None and job_level is not None
    assert (first.first_iteration, first.last_iteration, first.count) == (0, 99, 100)
    assert first.compute_ms == pytest.approx(sum(compute) / 100)
    assert (first.compute_min_ms, first.compute_max_ms) == pytest.approx(
        (min(compute), max(compute))
    )
    assert job_level.count == 100
    assert job_level.iteration_ms == pytest.approx(sum(slowest) / 100)
    assert job_level.iteration_max_ms == pytest.approx(max(slowest))


def test_a_running_job_keeps_its_last_hour_raw(api: Api) -> None:
    job = _job(api)
    now = time.time()
    _post(api, job, range(0, 500), 1, ts0=now - 7200)  # two hours ago
    _post(api, job, range(500, 1000), 1, ts0=now - 60 - 50)  # the last two minutes
    removed = _roll_up_all(api, job, retention.Window(keep_iterations=100, keep_running_s=3600))
    assert removed == 500 * 2  # everything before the hour, nothing inside it
    with transaction(context_of(api.client.app).sessions) as s:  # type: ignore[arg-type]
        assert s.scalar(select(func.min(T.iteration)).where(T.job_id == job)) == 500


def test_a_fresh_tracker_still_knows_when_the_plan_took_effect(api: Api) -> None:
    job = _job(api)
    _post(api, job, range(0, 300), 1)
    _post(api, job, range(300, 1000), 2)
    _roll_up_all(api, job, retention.Window(keep_iterations=200, keep_running_s=0))
    with transaction(context_of(api.client.app).sessions) as s:  # type: ignore[arg-type]
        tracker, j = Tracker(), s.get(Job, job)
        assert j is not None
        tracker.absorb(s, j, NewRows().read(s, j))
    assert tracker.first_of_version[2] == 300 and tracker.first_of_version[1] == 0


def test_placement_priors_count_rolled_up_history(api: Api) -> None:
    job = _job(api)
    _post(api, job, range(0, 1000), 1)
    with transaction(context_of(api.client.app).sessions) as s:  # type: ignore[arg-type]
        workload = s.get(Job, job).spec["workload"]  # type: ignore[union-attr]
        before = scheduler.measured_speeds(s, workload)
    _roll_up_all(api, job, retention.Window(keep_iterations=100, keep_running_s=0))
    with transaction(context_of(api.client.app).sessions) as s:  # type: ignore[arg-type]
        after = scheduler.measured_speeds(s, workload)
    assert before and after.keys() == before.keys()
    for device, speed in before.items():
        assert after[device] == pytest.approx(speed, rel=1e-9)


def test_controller_rolls_up_in_its_rounds(tmp_path: Any) -> None:
    from fastapi.testclient import TestClient

    from server.app import create_app

    settings = make_settings(f"sqlite:///{tmp_path / 'r.db'}", telemetry_keep_iterations=100)
    with TestClient(create_app(settings)) as client:
        api = Api(client)
        job = _job(api)
        _post(api, job, range(0, 450), 1)
        ctx = context_of(client.app)  # type: ignore[arg-type]
        controller = Controller(settings, engine=ctx.engine, sessions=ctx.sessions)
        assert controller.roll_up_telemetry() == 300 * 2
        assert controller.roll_up_telemetry() == 0
        assert _count(api, T.job_id == job) == 150 * 2


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    iterations=st.integers(1, 450),
    keep=st.integers(100, 400),
    ranks=st.integers(1, 3),
    values=st.lists(st.floats(0.0, 1000.0), min_size=1, max_size=50),
)
def test_every_iteration_is_counted_exactly_once(
    sqlite_api: Api, iterations: int, keep: int, ranks: int, values: list[float]
) -> None:
    """Whatever the window, raw rows plus rollups hold each rank's count and timing sums."""
    api = sqlite_api
    api.register(f"h{uuid.uuid4().hex[:8]}", devices=ranks)
    job = int(api.submit(workers=ranks, global_batch=64)["id"])  # type: ignore[call-overload]
    records = [
        {
            "rank": r,
            "iteration": it,
            "plan_version": 1,
            "batch_size": 1 + (it + r) % 5,
            "data_ms": 1.0,
            "compute_ms": values[(it * ranks + r) % len(values)],
            "sync_ms": 0.5,
            "ts": 1000.0 + it,
        }
        for it in range(iterations)
        for r in range(ranks)
    ]
    r = api.client.post(
        f"/api/v1/jobs/{job}/telemetry", json={"records": records}, headers=api.headers()
    )
    assert r.status_code == 200, r.text
    _roll_up_all(api, job, retention.Window(keep_iterations=keep, keep_running_s=0))
    with transaction(context_of(api.client.app).sessions) as s:  # type: ignore[arg-type]
        for rank in range(ranks):
            raw_n, raw_c = s.execute(
                select(func.count(), func.coalesce(func.sum(T.compute_ms), 0.0)).where(
                    T.job_id == job, T.rank == rank
                )
            ).one()
            old_n, old_c = s.execute(
                select(
                    func.coalesce(func.sum(R.count), 0),
                    func.coalesce(func.sum(R.compute_ms * R.count), 0.0),
                ).where(R.job_id == job, R.rank == rank)
            ).one()
            mine = [x["compute_ms"] for x in records if x["rank"] == rank]
            assert raw_n + old_n == len(mine)
            assert raw_c + old_c == pytest.approx(sum(mine), rel=1e-9, abs=1e-6)
            newest = iterations - 1
            kept_from = s.scalar(
                select(func.min(T.iteration)).where(T.job_id == job, T.rank == rank)
            )
            assert kept_from is not None and kept_from <= max(0, newest - keep + 1)
            assert kept_from % retention.BUCKET == 0


def test_a_fresh_control_loop_reads_a_long_jobs_recent_iterations_not_its_history(
    api: Api,
) -> None:
    """A controller starting (or taking over) reads each job's last ``FIRST_READ_ITERATIONS``,
    not the raw history retention keeps; its fit window, progress and straggler watch start
    from them, and later reads take only the new rows."""
    job = _job(api)
    _post(api, job, range(0, 700), 1)
    _post(api, job, range(700, 1500), 2)
    state = control_loop.LoopState()
    with transaction(context_of(api.client.app).sessions) as s:  # type: ignore[arg-type]
        j = s.get(Job, job)
        assert j is not None
        j.plan_version = 2  # as if the controller had planned it (the tests' apps do not)
        progress = control_loop.take_in(s, state, j)
    recent = rebalancer.FIRST_READ_ITERATIONS
    assert state.readers[job].last_id > 0
    assert progress.complete_through == 1499
    assert state.trackers[job].first_of_version == {2: 1500 - recent}  # from the window on
    window = state.windows[job].observations()
    assert {o.iteration for obs in window.values() for o in obs} == set(
        range(1500 - rebalancer.FIT_WINDOW, 1500)
    )
    assert int(state.watches[job].pending.iteration.min()) == 1500 - recent
    _post(api, job, range(1500, 1510), 2)
    with transaction(context_of(api.client.app).sessions) as s:  # type: ignore[arg-type]
        j = s.get(Job, job)
        assert j is not None
        rows = state.readers[job].read(s, j)
    assert sorted({r[2] for r in rows}) == list(range(1500, 1510))  # (id, rank, iteration, ...)


def test_the_kept_speed_history_reads_what_the_whole_history_says(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``SpeedHistory`` (the placement thread's, across passes) gives the speeds that summing
    every recent job's whole history gives: after a first use over rolled-up history, new
    rows, rows rolled up once counted, new jobs, and jobs leaving the recent window; and after
    the first use it reads neither the roll-ups nor rows it has read."""
    monkeypatch.setattr(scheduler, "HISTORY_JOBS", 2)
    ctx = context_of(api.client.app)  # type: ignore[arg-type]
    history = scheduler.SpeedHistory()

    def job(name: str) -> int:
        api.register(name, devices=2)
        return int(api.submit(workers=2, global_batch=64)["id"])  # type: ignore[call-overload]

    read: list[str] = []

    def same() -> dict[int, float]:
        with transaction(ctx.sessions) as s:
            workload = s.get(Job, first).spec["workload"]  # type: ignore[union-attr]
            with statements(ctx.engine) as sql:
                kept = history.speeds(s, workload)
            read[:] = sql
            whole = scheduler.measured_speeds(s, workload)
        assert kept.keys() == whole.keys()
        for device, speed in whole.items():
            assert kept[device] == pytest.approx(speed, rel=1e-9)
        return kept

    first = job("h1")
    _post(api, first, range(0, 400), 1)
    _roll_up_all(api, first, retention.Window(keep_iterations=100, keep_running_s=0))
    assert len(same()) == 2  # the first use: raw rows and roll-ups
    _post(api, first, range(400, 600), 2)  # other batch sizes: the speeds move
    moved = same()
    assert not any("telemetry_rollups" in q for q in read)
    sums = [q for q in read if "sum(iteration_telemetry" in q]
    assert len(sums) == 1 and "iteration_telemetry.id >" in sums[0]  # only the rows since
    _roll_up_all(api, first, retention.Window(keep_iterations=50, keep_running_s=0))
    assert same() == pytest.approx(moved)  # rolled up after being counted: the same speeds
    second = job("h2")
    _post(api, second, range(0, 300), 1)
    assert len(same()) == 4
    third = job("h3")  # the first job leaves the recent window (2 jobs here)
    _post(api, third, range(0, 50), 2)
    speeds = same()
    assert len(speeds) == 4 and all(k[0] != first for k in history.sums)
