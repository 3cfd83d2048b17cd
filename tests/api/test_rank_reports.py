"""A heartbeat's rank reports are applied together (``jobs.apply_worker_reports``): a job
starting on a host costs a fixed number of statements, and batching changes no outcome."""

from __future__ import annotations

import tempfile
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, select, text, update
from sqlalchemy.orm import Session

from contract.agent import WORKER_EXIT_FATAL, WorkerReport
from server.app import create_app
from server.context import context_of
from server.db import session_factory, transaction
from server.models import Device, Host, Job, Worker
from server.services import jobs
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


@pytest.mark.postgres
def test_hosts_starting_a_jobs_last_ranks_at_the_same_moment_start_the_job(pg_url: str) -> None:
    """Two hosts report a job's two ranks running in transactions that overlap: the second
    waits for the first's commit and counts its rank, so the job runs, while the job's row
    stays free for others to update. (Each counting the
    other's rank as not running yet, in its own snapshot, left the job STARTING for good.)"""
    with TestClient(create_app(make_settings(pg_url))) as client:
        api = driven(client)
        hosts = [api.register(f"h{i}", devices=1) for i in range(2)]
        job_id = int(api.submit(workers=2)["id"])
        answers = [_beat(api, host, []) for host in hosts]
        for host, answer in zip(hosts, answers, strict=True):
            _beat(api, host, _reports(answer, "launching"))
        sessions = session_factory(_engine(api))

        def report_running(session: Session, k: int) -> None:
            host = session.get(Host, hosts[k]["id"])
            assert host is not None
            reports = [WorkerReport.model_validate(r) for r in _reports(answers[k], "running")]
            now = datetime.now(UTC)
            jobs.advance_jobs(
                session, jobs.apply_worker_reports(session, host, reports, now).to_advance, now
            )

        first = sessions()
        first.begin()
        report_running(first, 0)
        first.flush()
        # The lock is the reports' own: the job's row stays free for the controller's sweeps
        with transaction(sessions) as other:
            other.execute(
                update(Job).where(Job.id == job_id).values(frozen=False),
                execution_options={"synchronize_session": False},
            )
        second_done = threading.Event()

        def second() -> None:
            with transaction(sessions) as session:
                report_running(session, 1)
            second_done.set()

        thread = threading.Thread(target=second)
        thread.start()
        # The second must wait for the first's commit (it would be done within this long)
        assert not second_done.wait(1.0)
        first.commit()
        first.close()
        thread.join(30)
        assert second_done.is_set()
        with transaction(sessions) as session:
            job = session.get(Job, job_id)
            assert job is not None
            assert (job.status, job.started_at is not None) == ("running", True)


def _started_on_two_hosts(api: Api) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """A 2-rank job on two 1-device hosts, each rank reported launching: (hosts, their first
    answers, the job's id)."""
    hosts = [api.register(f"h{i}", devices=1) for i in range(2)]
    job_id = int(api.submit(workers=2)["id"])
    answers = [_beat(api, host, []) for host in hosts]
    for host, answer in zip(hosts, answers, strict=True):
        _beat(api, host, _reports(answer, "launching"))
    return hosts, answers, job_id


@pytest.mark.postgres
@pytest.mark.parametrize("counts_first", [0, 1])
def test_hosts_that_write_their_ranks_before_either_counts_start_the_job(
    pg_url: str, counts_first: int
) -> None:
    """Each heartbeat writes its ranks unlocked and counts the job's ranks last, under the
    job's lock (``jobs.advance_jobs``): when both have written before either counts, the one
    that counts first sees the other's rank as not running yet (not committed), and the one
    that counts second sees the first's, committed before its lock was let go."""
    with TestClient(create_app(make_settings(pg_url))) as client:
        api = driven(client)
        hosts, answers, job_id = _started_on_two_hosts(api)
        sessions = session_factory(_engine(api))
        now = datetime.now(UTC)
        open_ = [sessions() for _ in hosts]
        pending = []
        for k, session in enumerate(open_):  # both write their ranks, neither has counted
            session.begin()
            session.execute(text("SET LOCAL lock_timeout = '10s'"))  # a regression fails, not hangs
            host = session.get(Host, hosts[k]["id"])
            assert host is not None
            reports = [WorkerReport.model_validate(r) for r in _reports(answers[k], "running")]
            pending.append(jobs.apply_worker_reports(session, host, reports, now).to_advance)
            session.flush()
        assert pending == [{job_id: 0}, {job_id: 0}]
        for k in (counts_first, 1 - counts_first):
            jobs.advance_jobs(open_[k], pending[k], now)
            open_[k].commit()
            open_[k].close()
            with transaction(sessions) as session:
                job = session.get(Job, job_id)
                assert job is not None
                status = job.status
            assert status == ("starting" if k == counts_first else "running")


@pytest.mark.postgres
def test_a_jobs_report_lock_is_held_only_from_the_count_to_the_commit(pg_url: str) -> None:
    """The heartbeat that starts the job takes its report lock after the answer is built, and
    runs three statements under it before the commit (the job as committed, its rank states
    counted, the job's start written: the host's time goes out with the liveness batch, not
    under the lock); a rank reported launching takes
    no lock and counts nothing. (Taken first, the lock was held for the whole heartbeat, and a
    fleet job's hosts queued behind it for seconds.)"""
    with TestClient(create_app(make_settings(pg_url))) as client:
        api = driven(client)
        hosts = [api.register(f"h{i}", devices=1) for i in range(2)]
        api.submit(workers=2)
        answers = [_beat(api, host, []) for host in hosts]
        with statements(_engine(api)) as launching:
            _beat(api, hosts[0], _reports(answers[0], "launching"))
        _beat(api, hosts[1], _reports(answers[1], "running"))
        with statements(_engine(api)) as starts:
            _beat(api, hosts[0], _reports(answers[0], "running"))
    assert not [s for s in launching if "pg_advisory_xact_lock" in s or "GROUP BY" in s]
    # nor are the jobs loaded whole, or the host's ranks read again, for ranks that only moved
    for heartbeat in (
        launching,
        starts[: starts.index(next(s for s in starts if "advisory" in s))],
    ):
        assert not [s for s in heartbeat if s.startswith("SELECT jobs.id, jobs.name")]
        assert len([s for s in heartbeat if s.startswith("SELECT workers.id, workers.job_id")]) == 2
    locks = [i for i, s in enumerate(starts) if "pg_advisory_xact_lock" in s]
    assert len(locks) == 1
    held = [" ".join(s.split()[:2]) for s in starts[locks[0] + 1 :]]
    assert held == ["SELECT jobs.id,", "SELECT workers.state", "UPDATE jobs"]
