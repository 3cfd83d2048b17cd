"""A heartbeat's rank reports are applied together (``rank_reports.apply_worker_reports``): a job
starting on a host costs a fixed number of statements, and batching changes no outcome."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, event, select
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from contract.agent import WORKER_EXIT_FATAL, WorkerReport
from server.app import create_app
from server.context import context_of
from server.db import session_factory, transaction
from server.models import Device, Host, Job, Worker
from server.services import rank_reports
from tests.harness import Api, driven, make_settings, statements


def _engine(api: Api) -> Engine:
    return context_of(api.client.app).engine  # type: ignore[arg-type]


def _beat(api: Api, host: dict[str, Any], workers: list[dict[str, Any]]) -> dict[str, Any]:
    r = api.client.post(
        f"/api/v1/hosts/{host['id']}/heartbeat",
        json={"workers": workers},
        headers=api.headers(host["_token"]),
    )
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def _reports(answer: dict[str, Any], state: str) -> list[dict[str, Any]]:
    return [
        {"job_id": a["job_id"], "rank": a["rank"], "state": state, "attempt": a["attempt"]}
        for a in answer["assignments"]
    ]


def test_a_job_starting_on_a_host_costs_the_same_statements_for_one_rank_or_eight(
    api: Api,
) -> None:
    """Launch, launching and running: one rank or eight on the host, the same statements."""
    cost: dict[int, list[int]] = {}
    for size in (1, 8):
        host = api.register(f"h{size}", devices=size)
        api.submit(workers=size)
        steps = []
        with statements(_engine(api)) as sql:
            answer = _beat(api, host, [])  # the launch: a credential minted per rank
        assert [a["worker_token"] is not None for a in answer["assignments"]] == [True] * size
        steps.append(len(sql))
        for state in ("launching", "running"):
            with statements(_engine(api)) as sql:
                _beat(api, host, _reports(answer, state))
            steps.append(len(sql))
        cost[size] = steps
    assert cost[8] == cost[1]
    job = api.client.get("/api/v1/jobs?limit=5", headers=api.headers()).json()["items"]
    assert {j["status"] for j in job} == {"running"}


# ------------------------------------------------------------------------- the invariant

STARTED = st.sampled_from(["launching", "running"])
EVENTS = st.lists(
    st.tuples(
        st.integers(0, 1),  # which of the host's two jobs
        st.integers(0, 1),  # which rank
        st.sampled_from(["running", "succeeded", "failed", "fatal", "stopped"]),
    ),
    max_size=4,
    unique_by=lambda e: (e[0], e[1]),
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(started=STARTED, events=EVENTS)
def test_reports_in_one_heartbeat_end_as_when_sent_one_heartbeat_at_a_time(
    started: str, events: list[tuple[int, int, str]]
) -> None:
    """Two hosts run two 2-rank jobs each, alike. One host's agent sends the rank ``events``
    one heartbeat at a time, the other's all in one heartbeat (each heartbeat lists every rank,
    as an agent does): the jobs and their ranks and devices end the same (jobs finishing,
    failing, restarting with later reports of the old attempt ignored)."""
    with tempfile.TemporaryDirectory() as tmp:
        db = f"sqlite:///{Path(tmp) / 'r.db'}"
        with TestClient(create_app(make_settings(db))) as client:
            api = driven(client)
            one_at_a_time, together = _host_with_two_jobs(api, "a"), _host_with_two_jobs(api, "b")
            for host, _ in (one_at_a_time, together):
                answer = _beat(api, host, [])
                _beat(api, host, _reports(answer, started))
            host, job_ids = one_at_a_time
            for k in range(1, len(events) + 1):
                _beat(api, host, _agent_report(job_ids, started, events[:k]))
            host, job_ids = together
            _beat(api, host, _agent_report(job_ids, started, events))
            assert _outcome(api, one_at_a_time[1]) == _outcome(api, together[1])


def _host_with_two_jobs(api: Api, name: str) -> tuple[dict[str, Any], list[int]]:
    host = api.register(name, devices=4)
    job_ids = [int(api.submit(workers=2, max_restarts=1)["id"]) for _ in range(2)]
    return host, job_ids


def _agent_report(
    job_ids: list[int], started: str, events: list[tuple[int, int, str]]
) -> list[dict[str, Any]]:
    """What the agent lists after ``events``: its other ranks as ``started``, then the events
    in order."""
    changed = {(job, rank) for job, rank, _ in events}
    steady = [(j, r, started) for j in (0, 1) for r in (0, 1) if (j, r) not in changed]
    return [_report(job_ids, e) for e in [*steady, *events]]


def _report(job_ids: list[int], event_: tuple[int, int, str]) -> dict[str, Any]:
    job, rank, state = event_
    report: dict[str, Any] = {"job_id": job_ids[job], "rank": rank, "attempt": 0}
    if state == "fatal":
        return {**report, "state": "failed", "exit_code": WORKER_EXIT_FATAL}
    if state == "failed":
        return {**report, "state": "failed", "exit_code": 1}
    return {**report, "state": state, "exit_code": 0 if state == "succeeded" else None}


def _outcome(api: Api, job_ids: list[int]) -> list[Any]:
    """Each job's status, attempt and reason; its ranks' states; the devices it holds."""
    context = context_of(api.client.app)  # type: ignore[arg-type]
    out: list[Any] = []
    with transaction(context.sessions) as s:
        for job_id in job_ids:
            job = s.get(Job, job_id)
            assert job is not None
            workers = s.scalars(select(Worker).where(Worker.job_id == job_id)).all()
            held = s.scalars(select(Device.index).where(Device.job_id == job_id)).all()
            out.append(
                (
                    job.status,
                    job.attempt,
                    job.error,
                    sorted((w.rank, w.state, w.exit_code) for w in workers),
                    sorted(held),
                )
            )
    return out


# ------------------------------------------------------- hosts starting one job at once


def _started_on_hosts(api: Api, n: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """A job of ``n`` ranks on ``n`` new 1-device hosts, each rank reported launching:
    (hosts, their first answers, the job's id)."""
    hosts = [api.register(f"h{i}-{_names.pop()}", devices=1) for i in range(n)]
    job_id = int(api.submit(workers=n)["id"])
    answers = [_beat(api, host, []) for host in hosts]
    for host, answer in zip(hosts, answers, strict=True):
        _beat(api, host, _reports(answer, "launching"))
    return hosts, answers, job_id


_names = list(range(10_000))


def _schedules(n: int) -> st.SearchStrategy[list[tuple[int, str]]]:
    """Every interleaving of ``n`` hosts' heartbeats, each host's steps in its own order: its
    ranks written in an open transaction, that committed, then its job looked at (and advanced
    if ready) in a transaction of its own."""
    steps = ("write", "commit", "advance")

    @st.composite
    def draw(data: st.DrawFn) -> list[tuple[int, str]]:
        left = {k: list(steps) for k in range(n)}
        out = []
        while left:
            k = data(st.sampled_from(sorted(left)))
            out.append((k, left[k].pop(0)))
            if not left[k]:
                del left[k]
        return out

    return draw()


@pytest.mark.postgres
def test_hosts_reporting_a_jobs_last_ranks_at_once_start_it_in_any_order(pg_url: str) -> None:
    """Each heartbeat writes its ranks, commits, and only then looks at its job, without a
    lock: in every interleaving of three hosts' heartbeats the job runs, since the host that
    commits last looks after every commit. A host that looked before another's commit found
    the job not ready and took no lock. (Looked at inside the reports' own transaction, each
    could count the others' ranks as not running, in its snapshot, and leave the job STARTING
    for good; so the count was made under the job's lock, and a fleet job's 32 hosts queued.)"""
    with TestClient(create_app(make_settings(pg_url, controller="none"))) as client:
        api = driven(client)
        sessions = session_factory(_engine(api))

        @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
        @given(schedule=_schedules(3))
        def check(schedule: list[tuple[int, str]]) -> None:
            hosts, answers, job_id = _started_on_hosts(api, 3)
            now = datetime.now(UTC)
            open_: dict[int, Session] = {}
            pending: dict[int, dict[int, int]] = {}
            locked = []
            committed: set[int] = set()
            for k, step in schedule:
                if step == "write":
                    session = open_[k] = sessions()
                    session.begin()
                    host = session.get(Host, hosts[k]["id"])
                    assert host is not None
                    reports = [
                        WorkerReport.model_validate(r) for r in _reports(answers[k], "running")
                    ]
                    pending[k] = rank_reports.apply_worker_reports(
                        session, host, reports, now
                    ).to_advance
                    session.flush()
                elif step == "commit":
                    open_.pop(k).commit()
                    committed.add(k)
                else:
                    with transaction(sessions) as session:
                        ready = rank_reports.ready_to_advance(session, pending[k])
                        rank_reports.advance_jobs(session, ready, now)
                        if rank_reports.REPORT_LOCK_WAIT in session.info:
                            locked.append(k)
                    if len(committed) < 3:
                        assert ready == {}, "ready before every rank was committed"
            with transaction(sessions) as session:
                job = session.get(Job, job_id)
                assert job is not None
                assert (job.status, job.started_at is not None) == ("running", True), schedule
            assert 1 <= len(locked) <= 3

        check()


@contextmanager
def _heartbeat_sql(engine: Engine) -> Iterator[list[str]]:
    """The statements and commits (``COMMIT``) of the thread that writes a heartbeat's ranks,
    in order: the API's other threads (liveness flushes, token checks) left out."""
    seen: list[tuple[int, str]] = []

    def statement(_conn: Any, _cursor: Any, sql: str, *_: Any) -> None:
        seen.append((threading.get_ident(), sql))

    def commit(_conn: Any) -> None:
        seen.append((threading.get_ident(), "COMMIT"))

    out: list[str] = []
    event.listen(engine, "before_cursor_execute", statement)
    event.listen(engine, "commit", commit)
    try:
        yield out
    finally:
        event.remove(engine, "before_cursor_execute", statement)
        event.remove(engine, "commit", commit)
    writer = next(t for t, sql in seen if sql.startswith("UPDATE workers"))
    out.extend(sql for t, sql in seen if t == writer)


@pytest.mark.postgres
def test_only_the_heartbeat_that_finds_its_job_ready_takes_its_report_lock(pg_url: str) -> None:
    """The first host's running report commits and then finds the job not ready: no lock. The
    last one's commits, then finds it ready and takes the lock, under which the job is read
    as committed, its ranks counted again and its start written."""
    with TestClient(create_app(make_settings(pg_url))) as client:
        api = driven(client)
        hosts, answers, job_id = _started_on_hosts(api, 2)
        sql: dict[int, list[str]] = {}
        for k in (0, 1):
            with _heartbeat_sql(_engine(api)) as sql[k]:
                _beat(api, hosts[k], _reports(answers[k], "running"))
        status = api.client.get(f"/api/v1/jobs/{job_id}", headers=api.headers()).json()["status"]
    assert status == "running"
    for k in (0, 1):  # the job looked at in a transaction of its own, after the reports'
        write = sql[k].index(next(s for s in sql[k] if s.startswith("UPDATE workers")))
        look = sql[k].index(next(s for s in sql[k] if "GROUP BY workers.state" in s))
        assert "COMMIT" in sql[k][write:look]
    assert not [s for s in sql[0] if "pg_advisory_xact_lock" in s]
    locks = [i for i, s in enumerate(sql[1]) if "pg_advisory_xact_lock" in s]
    assert len(locks) == 1 and locks[0] > look
    held = [" ".join(s.split()[:2]) for s in sql[1][locks[0] + 1 :]]
    assert held == ["SELECT jobs.id,", "SELECT workers.state", "UPDATE jobs", "COMMIT"]


def test_reports_whose_jobs_advance_failed_advance_them_when_sent_again(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last rank's running report commits, then the database goes away before its job
    is looked at: the heartbeat is answered 503, so the agent sends the same report again,
    and that one (the rank already running) starts the job."""
    host = api.register("h", devices=1)
    job_id = int(api.submit(workers=1)["id"])
    answer = _beat(api, host, [])
    _beat(api, host, _reports(answer, "launching"))
    looked = rank_reports.ready_to_advance

    def gone(*_: Any) -> dict[int, int]:
        raise sa_exc.OperationalError("SELECT", {}, Exception("server closed the connection"))

    monkeypatch.setattr(rank_reports, "ready_to_advance", gone)
    running = _reports(answer, "running")
    r = api.client.post(
        f"/api/v1/hosts/{host['id']}/heartbeat",
        json={"workers": running},
        headers=api.headers(host["_token"]),
    )
    assert r.status_code == 503, r.text
    with transaction(session_factory(_engine(api))) as session:
        job = session.get(Job, job_id)
        assert job is not None and job.status == "starting"
        assert {w.state for w in job.workers} == {"running"}  # the reports committed
    monkeypatch.setattr(rank_reports, "ready_to_advance", looked)
    _beat(api, host, running)
    status = api.client.get(f"/api/v1/jobs/{job_id}", headers=api.headers()).json()["status"]
    assert status == "running"
