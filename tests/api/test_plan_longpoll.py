"""Plan long-polls: `GET /jobs/{id}/plan?known_version=V&wait_s=W` answers when a newer plan is
committed anywhere (this process, another process on the same database), or 304 after W."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest
from sqlalchemy import create_engine, text

from contract.enums import PlanSource
from server.api.routes import plans as plan_routes
from server.db import session_factory, transaction
from server.errors import NotFound
from server.models import Job
from server.services import plans
from tests.harness import ROOT, Api, statements

# A plan made in a process of its own, wired the way the controller process is.
OTHER_PROCESS = """
import sys
from contract.enums import PlanSource
from server.controller import connect
from server.db import transaction
from server.models import Job
from server.services import plans

engine, sessions, buses = connect(sys.argv[1])
with transaction(sessions) as s:
    job = s.get(Job, int(sys.argv[2]))
    plans.create(s, job, [10, 20, 30], PlanSource.MANUAL, "from another process", by="test")
for bus in buses:
    bus.close()
engine.dispose()
"""


def _live_job(api: Api) -> int:
    api.register("h", devices=3)
    return int(api.submit(workers=3, global_batch=60)["id"])  # type: ignore[call-overload]


def _long_poll(api: Api, job: int, known: int, wait_s: float) -> Future[httpx.Response]:
    pool = ThreadPoolExecutor(1)
    future = pool.submit(
        api.client.get,
        f"/api/v1/jobs/{job}/plan",
        params={"known_version": known, "wait_s": wait_s},
        headers=api.headers(),
    )
    pool.shutdown(wait=False)
    return future


def _until_waiting(api: Api, job: int) -> None:
    """Until the long-poll has registered (so the plan is committed while it waits)."""
    waiters = api.client.app.state.context.plan_waiters  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while job not in waiters._events:
        assert time.monotonic() < deadline, "the long-poll never started waiting"
        time.sleep(0.01)


def test_unchanged_plan_is_304_after_the_wait(api: Api) -> None:
    job = _live_job(api)
    t0 = time.monotonic()
    r = api.client.get(
        f"/api/v1/jobs/{job}/plan",
        params={"known_version": 1, "wait_s": 0.3},
        headers=api.headers(),
    )
    assert r.status_code == 304 and r.content == b""
    assert time.monotonic() - t0 >= 0.3  # it held the request for the whole wait


def test_a_different_version_answers_at_once(api: Api) -> None:
    job = _live_job(api)
    r = api.client.get(
        f"/api/v1/jobs/{job}/plan", params={"known_version": 7, "wait_s": 30}, headers=api.headers()
    )
    assert r.status_code == 200 and r.json()["version"] == 1


def test_an_override_wakes_the_waiter(api: Api) -> None:
    job = _live_job(api)
    waiting = _long_poll(api, job, known=1, wait_s=30)
    _until_waiting(api, job)
    body = {"kind": "set_batches", "batch_sizes": [30, 20, 10], "reason": "busy node"}
    r = api.client.post(f"/api/v1/jobs/{job}/overrides", json=body, headers=api.headers())
    assert r.status_code == 201, r.text
    answer = waiting.result(timeout=10)  # far less than the 30 s it may wait
    assert answer.status_code == 200
    assert answer.json()["version"] == 2 and answer.json()["batch_sizes"] == [30, 20, 10]


def test_a_stopping_server_answers_its_long_polls_at_once(api: Api) -> None:
    """Closing the waiters (the server is stopping) answers held long-polls with 304 now,
    rather than leaving them to be cancelled at the graceful-shutdown timeout with an error
    and a traceback each (`make demo` printed one as it exited)."""
    job = _live_job(api)
    waiting = _long_poll(api, job, known=1, wait_s=30)
    _until_waiting(api, job)
    api.client.app.state.context.plan_waiters.close()  # type: ignore[attr-defined]
    answer = waiting.result(timeout=10)  # far less than the 30 s it may wait
    assert answer.status_code == 304
    started = time.monotonic()
    again = api.client.get(
        f"/api/v1/jobs/{job}/plan", params={"known_version": 1, "wait_s": 30}, headers=api.headers()
    )
    assert again.status_code == 304 and time.monotonic() - started < 5  # none waits any more


def test_a_plan_made_in_another_process_wakes_the_waiter(api: Api, db_url: str) -> None:
    job = _live_job(api)
    # Cached now, so only the notification (not the cache's TTL) can make the waiter see v2.
    assert api.client.get(f"/api/v1/jobs/{job}/plan", headers=api.headers()).status_code == 200
    waiting = _long_poll(api, job, known=1, wait_s=30)
    _until_waiting(api, job)
    subprocess.run(
        [sys.executable, "-c", OTHER_PROCESS, db_url, str(job)], cwd=ROOT, check=True, timeout=60
    )
    answer = waiting.result(timeout=10)
    assert answer.status_code == 200
    assert answer.json()["version"] == 2 and answer.json()["reason"] == "from another process"
    # The cache was cleared by the same notification: a plain read sees v2 at once.
    plan = api.client.get(f"/api/v1/jobs/{job}/plan", headers=api.headers()).json()
    assert plan["version"] == 2


def test_waiters_of_other_jobs_keep_waiting(api: Api) -> None:
    job = _live_job(api)
    api.register("h2", devices=3)
    other = int(api.submit(workers=3, global_batch=60)["id"])  # type: ignore[call-overload]
    waiting = _long_poll(api, other, known=1, wait_s=1.0)
    _until_waiting(api, other)
    body = {"kind": "set_batches", "batch_sizes": [30, 20, 10], "reason": "x"}
    assert (
        api.client.post(f"/api/v1/jobs/{job}/overrides", json=body, headers=api.headers())
    ).status_code == 201
    assert waiting.result(timeout=10).status_code == 304


@pytest.mark.parametrize("wait_s", ["31", "-1", "soon"])
def test_bad_wait_is_422_naming_it(api: Api, wait_s: str) -> None:
    job = _live_job(api)
    r = api.client.get(
        f"/api/v1/jobs/{job}/plan?known_version=1&wait_s={wait_s}", headers=api.headers()
    )
    assert r.status_code == 422 and r.json()["field"] == "wait_s"


def test_long_poll_of_an_unknown_job_is_404_at_once(api: Api) -> None:
    r = api.client.get(
        "/api/v1/jobs/999/plan", params={"known_version": 1, "wait_s": 30}, headers=api.headers()
    )
    assert r.status_code == 404


def test_concurrent_misses_all_get_the_plan(api: Api) -> None:
    job = _live_job(api)
    answers: list[int] = []

    def get() -> None:
        r = api.client.get(f"/api/v1/jobs/{job}/plan", headers=api.headers())
        answers.append(r.json()["version"])

    threads = [threading.Thread(target=get) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == [1] * 16


@pytest.mark.postgres
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_plan_whose_notification_was_lost_is_seen_when_the_listen_comes_back(
    api: Api, db_url: str
) -> None:
    """Notifications sent while the plan bus's LISTEN connection was down are lost; when it
    listens again, every cached plan goes and every long-poll reads its plan again, well
    before the cache's TTL (``PLAN_TTL_S``) would have let it."""
    job = _live_job(api)
    context = api.client.app.state.context  # type: ignore[attr-defined]
    cached_at = time.monotonic()
    assert api.client.get(f"/api/v1/jobs/{job}/plan", headers=api.headers()).status_code == 200
    waiting = _long_poll(api, job, known=1, wait_s=30)
    _until_waiting(api, job)
    silent = session_factory(context.engine)  # no cache hooks, no bus: nobody is told
    with transaction(silent) as s:
        plans.create(s, s.get(Job, job), [10, 20, 30], PlanSource.MANUAL, "unannounced", by="t")
    admin = create_engine(db_url)
    try:
        with admin.connect() as c:
            killed = c.execute(
                text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND query = 'LISTEN evenflow_plans'"
                )
            ).scalar()
        assert killed == 1
    finally:
        admin.dispose()
    answer = waiting.result(timeout=10)
    assert answer.status_code == 200 and answer.json()["reason"] == "unannounced"
    assert time.monotonic() - cached_at < 4.0, "seen only when the cached plan expired"


def test_current_many_says_for_each_job_what_current_says(api: Api) -> None:
    """The batched read of plans answers each job as the one-job read does: its plan, or the
    same refusal (no such job, no plan yet)."""
    api.register("h", devices=3)
    placed = int(api.submit(workers=3, global_batch=60)["id"])  # type: ignore[call-overload]
    waiting = int(api.submit(workers=3, global_batch=60)["id"])  # type: ignore[call-overload]
    sessions = session_factory(api.client.app.state.context.engine)  # type: ignore[attr-defined]
    with transaction(sessions) as s:
        job = s.get(Job, placed)
        assert job is not None
        plans.create(s, job, [10, 20, 30], PlanSource.MANUAL, "a newer one", by="test")
    ids = [placed, waiting, 10_000]
    with sessions() as s:
        many = plans.current_many(s, ids)
        assert sorted(many) == sorted(ids)
        for job_id in ids:
            try:
                one: object = plans.current(s, job_id)
            except NotFound as refused:
                got = many[job_id]
                assert isinstance(got, NotFound) and got.message == refused.message
            else:
                got = many[job_id]
                assert not isinstance(got, NotFound)
                assert (got.id, got.version, got.batch_sizes) == (
                    one.id,  # type: ignore[attr-defined]
                    one.version,  # type: ignore[attr-defined]
                    one.batch_sizes,  # type: ignore[attr-defined]
                )


def test_plans_missed_together_are_read_in_one_query(api: Api) -> None:
    """Jobs whose cached plans are gone (a fleet's plans change together) are read in one
    statement, however many there are, not one each; each poll still gets its own job's plan,
    and a job without one its 404."""
    api.register("h", devices=6)
    jobs = [int(api.submit(workers=1, global_batch=8)["id"]) for _ in range(5)]  # type: ignore[call-overload]
    context = api.client.app.state.context  # type: ignore[attr-defined]
    expected = {
        j: api.client.get(f"/api/v1/jobs/{j}/plan", headers=api.headers()).json() for j in jobs
    }
    context.caches.plans.clear()

    async def poll_all() -> list[object]:
        return await asyncio.gather(
            *(plan_routes._current(context, j) for j in [*jobs, 10_000]), return_exceptions=True
        )

    with statements(context.engine) as sql:
        got = asyncio.run(poll_all())
    plan_reads = [s for s in sql if "FROM jobs" in s and "plans" in s]
    assert len(plan_reads) == 1, sql
    for job_id, answer in zip(jobs, got[:-1], strict=True):
        assert isinstance(answer, tuple)
        assert json.loads(answer[1]) == expected[job_id]
    assert isinstance(got[-1], NotFound) and "job 10000 not found" in got[-1].message


def test_a_refresh_reencodes_only_the_plans_whose_version_moved(api: Api) -> None:
    """A refresh of cached plans reads the jobs' versions, and the plan rows of those whose
    version is not the cached one only: the others keep their bodies. What each job gets is
    what a read without the cache gives."""
    api.register("h", devices=6)
    jobs = [int(api.submit(workers=2, global_batch=16)["id"]) for _ in range(3)]  # type: ignore[call-overload]
    context = api.client.app.state.context  # type: ignore[attr-defined]
    sessions = context.sessions
    first = plan_routes._load_current(sessions, [*jobs, 10_000])
    held = {j: v for j, v in first.items() if isinstance(v, tuple)}
    assert sorted(held) == jobs and isinstance(first[10_000], NotFound)

    with statements(context.engine) as sql:
        again = plan_routes._load_current(sessions, jobs, held.get)
    assert again == held
    assert len(sql) == 1 and "plans" not in sql[0].split("FROM")[1], sql

    with transaction(sessions) as s:
        job = s.get(Job, jobs[1])
        assert job is not None
        plans.create(s, job, [4, 12], PlanSource.MANUAL, "moved", by="test")
    with statements(context.engine) as sql:
        moved = plan_routes._load_current(sessions, [*jobs, 10_000], held.get)
    uncached = plan_routes._load_current(sessions, [*jobs, 10_000])
    assert [moved[j] for j in jobs] == [uncached[j] for j in jobs]  # as without the cache
    assert str(moved[10_000]) == str(uncached[10_000]) == "job 10000 not found"
    new_version, body = moved[jobs[1]]  # type: ignore[misc]
    assert new_version == held[jobs[1]][0] + 1 and json.loads(body)["batch_sizes"] == [4, 12]
    assert moved[jobs[0]] is held[jobs[0]] and moved[jobs[2]] is held[jobs[2]]
    plan_reads = [s for s in sql if "plans" in s.split("FROM")[1]]
    assert len(sql) == 2 and len(plan_reads) == 1, sql
