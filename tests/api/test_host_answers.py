"""Steady heartbeats answered from memory (``server.scale.host_answers``): never a stale answer."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import event, insert, select, text, update

from contract.agent import Heartbeat
from contract.enums import Role
from server.api.slots import DbSlots
from server.app import _flush_liveness, _write_liveness, create_app
from server.context import AppContext, context_of
from server.db import transaction
from server.models import Host, Worker
from server.services import hosts, rank_reports
from server.services.tokens import Principal
from tests.harness import (
    ADMIN_TOKEN,
    FLEET_HOSTS,
    ROOT,
    Api,
    driven,
    host_histories,
    make_settings,
    placement_rows,
    statements,
)


def _context(api: Api) -> AppContext:
    return context_of(api.client.app)  # type: ignore[arg-type]


def _beat(
    api: Api,
    host: dict[str, Any],
    workers: list[dict[str, Any]],
    *,
    token: str | None = None,
    instance: str | None = None,
) -> Any:
    body: dict[str, Any] = {"workers": workers}
    if instance is not None:
        body["instance"] = instance
    headers = api.headers(token or host["_token"])
    return api.client.post(f"/api/v1/hosts/{host['id']}/heartbeat", json=body, headers=headers)


def _running(answer: dict[str, Any]) -> list[dict[str, Any]]:
    """The report of an agent running every rank it was told to run."""
    return [
        {"job_id": a["job_id"], "rank": a["rank"], "state": "running", "attempt": a["attempt"]}
        for a in answer["assignments"]
        if a["desired"] == "run"
    ]


def _steady(api: Api, host: dict[str, Any]) -> list[dict[str, Any]]:
    """Heartbeat until the host's answer is kept in memory; returns the report that gets it."""
    answers = _context(api).host_answers
    report: list[dict[str, Any]] = []
    for _ in range(5):
        r = _beat(api, host, report)
        assert r.status_code == 200, r.text
        report = _running(r.json())
        if answers._answers.get(int(host["id"])) is not None:
            return report
    raise AssertionError("the answer was never kept")


def test_a_repeated_heartbeat_is_answered_without_the_database(api: Api) -> None:
    host = api.register("h", devices=2)
    api.submit(workers=2)
    report = _steady(api, host)
    kept = _beat(api, host, report).json()
    with statements(_context(api).engine) as sql:
        again = _beat(api, host, report)
    assert again.status_code == 200
    assert again.json() == kept
    assert [a["desired"] for a in kept["assignments"]] == ["run", "run"]
    assert sql == []


def test_a_byte_for_byte_repeat_is_answered_before_the_route(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gate answers a heartbeat whose body repeats the last one's bytes (the route, its
    dependencies and its parsing never run); the same report worded otherwise goes to the
    route, which still answers it from memory; another credential is checked again."""
    host = api.register("h", devices=2)
    api.submit(workers=2)
    report = _steady(api, host)
    answers = _context(api).host_answers
    kept = _beat(api, host, report).json()  # answered by the route: now kept with its bytes
    gets = []
    monkeypatch.setattr(answers, "get", lambda *a: gets.append(a))  # the route's lookup
    with statements(_context(api).engine) as sql:
        again = _beat(api, host, report)
    assert again.status_code == 200 and again.json() == kept
    assert again.headers["content-type"] == "application/json"
    assert gets == [] and sql == []
    monkeypatch.undo()
    hits = answers.hits
    reworded = api.client.post(
        f"/api/v1/hosts/{host['id']}/heartbeat",
        content=json.dumps({"workers": report}, indent=2),
        headers={**api.headers(host["_token"]), "Content-Type": "application/json"},
    )
    assert reworded.status_code == 200 and reworded.json() == kept
    assert answers.hits == hits + 1  # from memory, through the route
    admin = _beat(api, host, report, token=ADMIN_TOKEN)
    assert admin.status_code == 200 and admin.json() == kept
    assert answers.hits == hits + 1  # another credential: worked out again


def test_the_heartbeat_that_reports_a_change_keeps_its_answer(api: Api) -> None:
    """A heartbeat reporting its ranks running changes them (worked out in the database); the
    answer it gets already says what follows from that, so it is kept and the next heartbeat
    like it is answered from memory, with what the database would answer."""
    host = api.register("h", devices=2)
    api.submit(workers=2)
    answers = _context(api).host_answers
    launch = _beat(api, host, []).json()  # the launch credentials: never kept
    assert answers._answers.get(int(host["id"])) is None
    report = _running(launch)
    changed = _beat(api, host, report)
    assert changed.status_code == 200, changed.text
    assert answers._answers.get(int(host["id"])) is not None
    hits = answers.hits
    with statements(_context(api).engine) as sql:
        again = _beat(api, host, report)
    assert answers.hits == hits + 1 and sql == []
    assert again.json() == changed.json() == _worked_out(api, int(host["id"]), report)


def test_a_heartbeat_with_fewer_reports_is_answered_from_memory(api: Api) -> None:
    """The real agent reports a rank's new state once, then nothing more of it: the heartbeat
    after a change, with none (or some) of its reports, is answered from memory, and its bytes
    repeated are answered before the route."""
    host = api.register("h", devices=2)
    api.submit(workers=2)
    answers = _context(api).host_answers
    report = _running(_beat(api, host, []).json())
    changed = _beat(api, host, report).json()  # worked out: the ranks run now
    hits = answers.hits
    with statements(_context(api).engine) as sql:
        some = _beat(api, host, report[1:])
        quiet = _beat(api, host, [])
        again = _beat(api, host, [])
    assert sql == [] and answers.hits == hits + 3
    assert some.json() == quiet.json() == again.json() == changed
    assert changed == _worked_out(api, int(host["id"]), [], unchanged=True)
    other = _beat(api, host, [{**report[0], "state": "succeeded"}])  # a new report: worked out
    assert answers.hits == hits + 3
    assert [a["rank"] for a in other.json()["assignments"]] == [report[1]["rank"]]


def test_a_job_ending_after_its_ranks_reported_their_ends_keeps_its_hosts_answers(
    api: Api,
) -> None:
    """A host told nothing more of a job (its rank reported succeeded) keeps its answer when
    the job ends on another host's report and its devices are released."""
    a, b = api.register("a", devices=1), api.register("b", devices=1)
    job = api.submit(workers=2)
    answers = _context(api).host_answers
    reports = {}
    for host in (a, b):
        reports[host["name"]] = _running(_beat(api, host, []).json())
        _beat(api, host, reports[host["name"]])
    ended_a = [{**reports["a"][0], "state": "succeeded"}]
    assert _beat(api, a, ended_a).json()["assignments"] == []
    assert _beat(api, a, []).json()["assignments"] == []  # the agent's next: from memory
    assert answers._answers.get(int(a["id"])) is not None
    _beat(api, b, [{**reports["b"][0], "state": "succeeded"}])
    status = api.client.get(f"/api/v1/jobs/{job['id']}", headers=api.headers()).json()["status"]
    assert status == "succeeded"
    assert answers._answers.get(int(a["id"])) is not None
    hits = answers.hits
    assert _beat(api, a, []).json() == _worked_out(api, int(a["id"]), [], unchanged=True)
    assert answers.hits == hits + 1


def test_a_job_starting_to_run_leaves_its_hosts_answers_kept(api: Api) -> None:
    """A job's status going from starting to running (its last rank reports running) changes
    no answer: its other hosts keep theirs. Its end changes every one."""
    a, b = api.register("a", devices=1), api.register("b", devices=1)
    job = api.submit(workers=2)
    answers = _context(api).host_answers
    report_a = _running(_beat(api, a, []).json())
    _beat(api, a, report_a)  # kept: its rank runs, the job still starts (b's has not)
    assert answers._answers.get(int(a["id"])) is not None
    _beat(api, b, _running(_beat(api, b, []).json()))
    status = api.client.get(f"/api/v1/jobs/{job['id']}", headers=api.headers()).json()["status"]
    assert status == "running"
    assert answers._answers.get(int(a["id"])) is not None
    assert _beat(api, a, report_a).json() == _worked_out(api, int(a["id"]), report_a)
    api.client.post(f"/api/v1/jobs/{job['id']}/cancel", headers=api.headers())
    assert answers._answers.get(int(a["id"])) is None
    stop = _beat(api, a, report_a).json()
    assert [x["desired"] for x in stop["assignments"]] == ["stop"]


def test_liveness_is_written_in_a_batch_and_never_moves_back(api: Api) -> None:
    host = api.register("h", devices=1)
    report = _steady(api, host)
    context = _context(api)

    def last_heartbeat() -> datetime:
        with transaction(context.sessions) as s:
            return s.scalars(select(Host.last_heartbeat)).one()

    before = last_heartbeat()
    time.sleep(0.01)
    assert _beat(api, host, report).status_code == 200
    _flush_liveness(context)
    written = last_heartbeat()
    assert written > before
    context.liveness.seen(int(host["id"]), written - timedelta(seconds=5))
    _flush_liveness(context)
    assert last_heartbeat() == written


def test_a_flush_writes_every_hosts_liveness_in_one_statement(api: Api) -> None:
    """One statement on PostgreSQL whatever the number of hosts (the flush holds their rows for
    as long as it runs); each host gets its own time, never an older one."""
    context = _context(api)
    ids = [int(api.register(f"h{i}", devices=1)["id"]) for i in range(5)]
    with transaction(context.sessions) as s:
        before = {h: t for h, t in s.execute(select(Host.id, Host.last_heartbeat))}
    later = datetime.now(UTC) + timedelta(seconds=60)
    for i, host_id in enumerate(ids[1:], start=1):
        context.liveness.seen(host_id, later + timedelta(seconds=i))
        context.liveness.seen(host_id, later)  # an earlier heartbeat's, answered after: kept out
    context.liveness.seen(ids[0], before[ids[0]] - timedelta(seconds=60))  # older: not written
    writes: list[tuple[str, bool]] = []

    def note(_c: Any, _cur: Any, sql: str, _p: Any, _ctx: Any, many: bool) -> None:
        if "UPDATE HOSTS" in sql.upper():  # on its own, or in a WITH (PostgreSQL)
            writes.append((sql, many))

    event.listen(context.engine, "before_cursor_execute", note)
    try:
        _flush_liveness(context)
    finally:
        event.remove(context.engine, "before_cursor_execute", note)
    if context.engine.dialect.name == "postgresql":
        assert [many for _, many in writes] == [False]  # one statement, not one per host
    with transaction(context.sessions) as s:
        after = {h: t for h, t in s.execute(select(Host.id, Host.last_heartbeat))}
    assert after[ids[0]] == before[ids[0]]
    assert [after[h] for h in ids[1:]] == [later + timedelta(seconds=i) for i in range(1, 5)]


def test_a_cancelled_job_reaches_the_agent_at_once(api: Api) -> None:
    host = api.register("h", devices=2)
    job = api.submit(workers=2)
    report = _steady(api, host)
    r = api.client.post(f"/api/v1/jobs/{job['id']}/cancel", headers=api.headers())
    assert r.status_code == 200, r.text
    answer = _beat(api, host, report).json()
    assert [a["desired"] for a in answer["assignments"]] == ["stop", "stop"]


def test_a_job_placed_on_the_host_reaches_its_agent_at_once(api: Api) -> None:
    host = api.register("h", devices=2)
    first = api.submit(workers=1)
    report = _steady(api, host)
    second = api.submit(workers=1)
    answer = _beat(api, host, report).json()
    assert {a["job_id"] for a in answer["assignments"]} == {first["id"], second["id"]}


def test_another_token_goes_through_the_checks_again(api: Api) -> None:
    host = api.register("h", devices=1)
    report = _steady(api, host)
    other = api.token(Role.AGENT, host="another-host")
    r = _beat(api, host, report, token=other)
    assert r.status_code == 403
    assert "another-host" in r.json()["detail"]


def test_a_replaced_agent_is_told_at_once(api: Api) -> None:
    host = api.register("h", devices=1)
    report = _steady(api, host)
    kept = _beat(api, host, report, instance="agent-a")
    assert kept.status_code == 200
    assert _beat(api, host, report, instance="agent-a").json() == kept.json()
    body = {
        "protocol_version": 2,
        "name": "h",
        "address": "127.0.0.1",
        "devices": [{"index": 0, "kind": "cpu", "model": "CPU", "memory_mb": 1024}],
        "instance": "agent-b",
        "replace": True,
    }
    r = api.client.post("/api/v1/hosts/register", json=body, headers=api.headers(host["_token"]))
    assert r.status_code == 201, r.text
    stale = _beat(api, host, report, instance="agent-a")
    assert stale.status_code == 409
    assert "agent-b" in stale.json()["detail"]


# The controller's reaper, in a process of its own wired as the controller process is: the host
# is taken for lost and its job restarted there; the answer must change here at once.
OTHER_PROCESS = """
import sys
from datetime import UTC, datetime, timedelta
from server.controller import connect
from server.db import transaction
from server.services import hosts, jobs

engine, sessions, buses = connect(sys.argv[1])
with transaction(sessions) as s:
    lost = hosts.mark_lost(s, datetime.now(UTC) + timedelta(seconds=600), after_s=30).lost
    assert [h.name for h in lost] == ["h"], lost
for bus in buses:
    bus.close()
engine.dispose()
"""


def test_a_change_committed_by_another_process_reaches_the_agent(api: Api, db_url: str) -> None:
    host = api.register("h", devices=2)
    job = api.submit(workers=2, max_restarts=3)
    report = _steady(api, host)
    kept = _beat(api, host, report).json()
    assert {a["attempt"] for a in kept["assignments"]} == {0}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", OTHER_PROCESS, db_url], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    answers = _context(api).host_answers
    deadline = time.monotonic() + 5
    while answers._answers.get(int(host["id"])) is not None:
        assert time.monotonic() < deadline, "the other process's change never arrived"
        time.sleep(0.01)
    answer = _beat(api, host, report).json()
    assert answer != kept
    restarted = api.client.get(f"/api/v1/jobs/{job['id']}", headers=api.headers()).json()
    assert restarted["attempt"] == 1


# ------------------------------------------------------------------------- the invariant

HOSTS = FLEET_HOSTS
OPS = host_histories(max_size=14)
"""What happens, and (for reports and beats) on which host's agent."""


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, order=st.permutations(HOSTS))
def test_an_answer_from_memory_is_what_the_database_answers(
    ops: list[tuple[str, Any, str]], order: list[str]
) -> None:
    """Whatever happens between two heartbeats (jobs placed over two hosts, cancelled, ended by
    a report, restarted when the hosts are taken for lost), a heartbeat answered from memory,
    its report repeated or with only some of it (the real agent's after a change), gets exactly
    what working it out in the database gives, and working it out would change nothing."""
    with tempfile.TemporaryDirectory() as tmp:
        db = f"sqlite:///{Path(tmp) / 'e.db'}"
        with TestClient(create_app(make_settings(db))) as client:
            api = driven(client)
            _invariant(api, ops, order)


def _invariant(api: Api, ops: list[tuple[str, Any, str]], order: list[str]) -> None:
    context = _context(api)
    answers = context.host_answers
    hosts_ = {name: api.register(name, devices=2) for name in HOSTS}
    jobs: list[int] = []
    reports: dict[str, list[dict[str, Any]]] = {name: [] for name in HOSTS}
    for op, arg, on in ops:
        report = reports[on]
        if op == "submit":
            jobs.append(int(api.submit(workers=arg, max_restarts=5)["id"]))
        elif op == "cancel" and arg < len(jobs):
            api.client.post(f"/api/v1/jobs/{jobs[arg]}/cancel", headers=api.headers())
        elif op == "report" and report:
            reports[on] = [{**report[0], "state": arg}, *report[1:]]
        elif op == "fewer":
            reports[on] = report[1:]
        elif op == "quiet":
            reports[on] = []
        elif op == "lost":
            with context.write_lock, transaction(context.sessions) as s:
                hosts.mark_lost(s, datetime.now(UTC) + timedelta(seconds=600), after_s=30)
        for name in order if op != "beat" else [on]:
            host, sent = hosts_[name], reports[name]
            hits = answers.hits
            r = _beat(api, host, sent)
            assert r.status_code == 200, r.text
            if answers.hits > hits:  # from memory: the database must say the same
                assert r.json() == _worked_out(api, int(host["id"]), sent, unchanged=True)
            reports[name] = _running(r.json()) or sent


def _worked_out(
    api: Api, host_id: int, report: list[dict[str, Any]], unchanged: bool = False
) -> dict[str, Any]:
    """The heartbeat's answer as the database gives it now, in a transaction rolled back;
    ``unchanged``: and it changes no rank, job or device."""
    context = _context(api)
    hb = Heartbeat.model_validate({"workers": report})
    principal = Principal(token_id=0, name="test", role=Role.ADMIN)
    with context.write_lock, context.sessions() as s:
        before = placement_rows(s)
        ack = hosts.heartbeat(s, host_id, hb, principal, datetime.now(UTC)).ack
        s.flush()
        if unchanged:
            assert placement_rows(s) == before, (
                "answered from memory, but the database changes things"
            )
        s.rollback()
    return ack.model_dump(mode="json")


def test_liveness_not_written_is_written_by_the_next_flush(api: Api) -> None:
    """A flush whose transaction fails (the database away) loses no heartbeat time."""
    host = api.register("h", devices=1)
    context = _context(api)
    host_id = int(host["id"])
    later = datetime.now(UTC) + timedelta(seconds=30)
    context.liveness.seen(host_id, later)
    with context.sessions() as s:
        context.liveness.flush(s.connection())
        s.rollback()  # as when the commit fails
    context.liveness.restore()
    assert context.liveness.pending() == 1
    _flush_liveness(context)
    with transaction(context.sessions) as s:
        assert s.scalars(select(Host.last_heartbeat)).one() == later


def _last_heartbeat(context: AppContext, host_id: int) -> datetime:
    with context.sessions() as s:
        host = s.get(Host, host_id)
        assert host is not None
        return host.last_heartbeat.replace(tzinfo=UTC)


def test_a_heartbeat_waiting_for_the_database_keeps_its_host_alive_meanwhile(
    sqlite_api: Api,
) -> None:
    """Its liveness is noted when it arrives, not when its transaction commits, and again at
    each flush while it waits for its answer: a host whose heartbeats queue behind a busy
    server is not marked lost for it, however long they wait."""
    api, context = sqlite_api, _context(sqlite_api)
    host = api.register("h", devices=1)
    host_id = int(host["id"])
    assert _beat(api, host, []).status_code == 200  # answered by the database: its credential
    _flush_liveness(context)
    context.host_answers.invalidate([host_id])  # the next one goes to the database again
    answered: list[int] = []
    with context.write_lock:  # the database is busy: the heartbeat's transaction waits
        sent = datetime.now(UTC)
        beat = threading.Thread(target=lambda: answered.append(_beat(api, host, []).status_code))
        beat.start()
        deadline = time.monotonic() + 10
        while not context.liveness.pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        with context.sessions() as s, s.begin():  # the API's next liveness flush
            assert context.liveness.flush(s.connection()) == 1
        first = _last_heartbeat(context, host_id)
        assert first >= sent
        time.sleep(0.05)
        with context.sessions() as s, s.begin():  # and the one after: still waiting, alive
            assert context.liveness.flush(s.connection()) == 1
        assert _last_heartbeat(context, host_id) > first
        assert not answered  # still waiting
    beat.join(10)
    assert answered == [200]
    _flush_liveness(context)
    assert context.liveness.pending() == 0  # answered: nothing more to note until the next


def test_a_heartbeat_with_another_hosts_credential_keeps_nothing_alive(api: Api) -> None:
    context = _context(api)
    host, other = api.register("h", devices=1), api.register("h2", devices=1)
    assert _beat(api, host, []).status_code == 200
    _flush_liveness(context)
    assert _beat(api, host, [], token=other["_token"]).status_code == 403
    assert context.liveness.pending() == 0
    assert _beat(api, host, []).status_code == 200  # its own: noted (and from memory)
    assert context.liveness.pending() == 1


def test_liveness_is_written_while_every_database_slot_is_taken(sqlite_api: Api) -> None:
    """The flush does not queue behind the heartbeats waiting for slots: a busy server is
    exactly when hosts would otherwise look silent to the reaper."""
    api, context = sqlite_api, _context(sqlite_api)
    host_id = int(api.register("h", devices=1)["id"])  # type: ignore[call-overload]
    _flush_liveness(context)
    later = _last_heartbeat(context, host_id) + timedelta(seconds=5)

    async def busy() -> None:
        slots = DbSlots(1)
        context.db_slots = slots
        async with slots:  # every slot taken
            context.liveness.seen(host_id, later)
            writer = asyncio.ensure_future(_write_liveness(context))
            deadline = time.monotonic() + 10
            while context.liveness.pending() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            writer.cancel()

    asyncio.run(busy())
    assert _last_heartbeat(context, host_id) == later


@pytest.mark.postgres
def test_the_liveness_flush_skips_a_row_another_transaction_holds_and_writes_it_next(
    pg_url: str,
) -> None:
    """On PostgreSQL the flush never waits for a host's row that another transaction holds (a
    heartbeat worked out in the database, writing its own time at its commit): the others
    are written at once, and the held one with the next flush. Waiting, it held the rows it had
    written, heartbeats queued behind it in their database slots, and at 1,250 hosts
    (bench/fleet.py) no liveness was written for seconds at a time."""
    with TestClient(create_app(make_settings(pg_url))) as client:
        api = driven(client)
        context = _context(api)
        ids = [int(api.register(f"h{i}", devices=1)["id"]) for i in range(3)]  # type: ignore[call-overload]
        _flush_liveness(context)
        before = {h: _last_heartbeat(context, h) for h in ids}
        later = max(before.values()) + timedelta(seconds=5)
        with context.engine.connect() as holder:  # another transaction holds the first row
            holder.execute(update(Host).where(Host.id == ids[0]).values(address=Host.address))
            for h in ids:
                context.liveness.seen(h, later)
            done = threading.Event()
            flush = threading.Thread(target=lambda: (_flush_liveness(context), done.set()))
            flush.start()
            assert done.wait(10), "the flush waited for the held row"
            assert [_last_heartbeat(context, h) for h in ids] == [before[ids[0]], later, later]
            assert context.liveness.pending() == 1  # the held one, for the next flush
            holder.rollback()
        _flush_liveness(context)
        assert _last_heartbeat(context, ids[0]) == later
        assert context.liveness.pending() == 0


@pytest.mark.postgres
def test_the_liveness_flush_writes_a_host_that_ranks_are_being_placed_on(pg_url: str) -> None:
    """A row inserted that references the host (a rank placed there, by the controller's
    placement pass) holds a ``KEY SHARE`` lock on the host's row to its commit: the flush,
    which changes no key, writes the host's time anyway, and does not wait for it."""
    with TestClient(create_app(make_settings(pg_url))) as client:
        api = driven(client)
        context = _context(api)
        host_id = int(api.register("h", devices=1)["id"])  # type: ignore[call-overload]
        job_id = int(api.submit(workers=1, global_batch=8, place=False)["id"])  # type: ignore[call-overload]
        _flush_liveness(context)
        later = _last_heartbeat(context, host_id) + timedelta(seconds=5)
        with context.engine.connect() as placing:  # a placement inserting a rank on the host
            placing.execute(
                insert(Worker).values(job_id=job_id, rank=0, host_id=host_id, state="assigned")
            )
            locks = (
                "SELECT count(*) FROM pg_locks WHERE locktype = 'tuple' OR mode = 'RowShareLock'"
            )
            assert placing.execute(text(locks)).scalar_one() >= 1
            context.liveness.seen(host_id, later)
            done = threading.Event()
            flush = threading.Thread(target=lambda: (_flush_liveness(context), done.set()))
            flush.start()
            assert done.wait(10), "the flush waited for the placement"
            assert _last_heartbeat(context, host_id) == later
            assert context.liveness.pending() == 0
            placing.rollback()


def test_a_registered_hosts_first_heartbeats_are_noted_on_arrival_and_answered_time_kept(
    sqlite_api: Api,
) -> None:
    """From its registration on, not only once the database has answered one of its heartbeats
    (a fleet registering together queues its first heartbeats for slots: at 1,250 hosts hosts
    were marked lost so); and once answered, the host was alive until the answer, which the
    next flush writes (its own transaction wrote its time of arrival, maybe seconds older)."""
    api, context = sqlite_api, _context(sqlite_api)
    host = api.register("h", devices=1)
    host_id = int(host["id"])
    _flush_liveness(context)
    answered: list[int] = []
    with context.write_lock:  # the database is busy: its first heartbeat's transaction waits
        beat = threading.Thread(target=lambda: answered.append(_beat(api, host, []).status_code))
        beat.start()
        deadline = time.monotonic() + 10
        while not context.liveness.pending() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert context.liveness.pending() == 1, "noted on arrival"
        time.sleep(0.3)
        released = datetime.now(UTC)
    beat.join(10)
    assert answered == [200]
    _flush_liveness(context)
    assert _last_heartbeat(context, host_id) >= released


def _reasons(api: Api) -> dict[str, float]:
    """``evenflow_heartbeat_database_reasons_total`` by reason, as /metrics says."""
    text = api.client.get("/metrics", headers=api.headers()).text
    out = {}
    for line in text.splitlines():
        if line.startswith("evenflow_heartbeat_database_reasons_total{"):
            reason = line.split('reason="')[1].split('"')[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def test_metrics_say_why_each_heartbeat_went_to_the_database(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """None held (the first, or dropped by a change), the answer expired, another credential,
    or a new report: and a repeat within the TTL goes nowhere."""
    host = api.register("h", devices=2)
    answers = _context(api).host_answers
    assert _beat(api, host, []).status_code == 200  # the first: none held
    assert _reasons(api) == {"none": 1.0}
    assert _beat(api, host, []).status_code == 200  # kept: from memory
    assert _reasons(api) == {"none": 1.0}
    now = time.monotonic()
    monkeypatch.setattr(answers, "clock", lambda: now + answers.ttl_s + 1)
    assert _beat(api, host, []).status_code == 200  # past its TTL (and kept again)
    assert _reasons(api) == {"none": 1.0, "expired": 1.0}
    assert _beat(api, host, [], instance="agent-2").status_code == 200  # another report
    assert _reasons(api) == {"none": 1.0, "expired": 1.0, "report": 1.0}
    assert _beat(api, host, [], token=ADMIN_TOKEN, instance="agent-2").status_code == 200
    assert _reasons(api) == {"none": 1.0, "expired": 1.0, "report": 1.0, "token": 1.0}


def test_the_heartbeat_after_a_launch_says_why_it_went_to_the_database(api: Api) -> None:
    """The answer that hands out launch credentials is never repeated, so the host's next
    heartbeat goes to the database: for ``launch``, not ``none`` as if a change had dropped
    its answer (at a job's start that is half of its hosts' database heartbeats)."""
    host = api.register("h", devices=1)
    assert _beat(api, host, []).status_code == 200
    assert _reasons(api) == {"none": 1.0}
    api.submit(workers=1)
    answer = _beat(api, host, []).json()  # the placement dropped the host's answer
    assert [a["worker_token"] is not None for a in answer["assignments"]] == [True]
    assert _reasons(api) == {"none": 2.0}
    assert _beat(api, host, _running(answer)).status_code == 200
    assert _reasons(api) == {"none": 2.0, "launch": 1.0}
    assert _beat(api, host, _running(answer)).status_code == 200  # kept: from memory
    assert _reasons(api) == {"none": 2.0, "launch": 1.0}


def test_an_answer_is_kept_ten_minutes_by_default() -> None:
    """Its TTL is a backstop only (a lost notification is told, ``server.notify.LOST``): at
    60 s it sent a third of a fleet's database heartbeats there (bench/fleet.py)."""
    assert make_settings("sqlite://").heartbeat_answer_ttl_s == 600.0


def test_a_heartbeat_the_database_works_out_writes_no_time_unless_its_host_comes_back(
    api: Api,
) -> None:
    """Its time goes out with the liveness batch, as one answered from memory's does, so its
    transaction holds no host row; a host that was lost has its status and time written
    together, so the reaper never finds it active at the time it was lost at."""
    host = api.register("h", devices=1)
    host_id = int(host["id"])
    context = _context(api)
    _flush_liveness(context)
    context.host_answers.invalidate([host_id])  # the next one goes to the database
    before = _last_heartbeat(context, host_id)
    with statements(context.engine) as sql:
        assert _beat(api, host, []).status_code == 200
    assert sql and not [s for s in sql if s.lstrip().upper().startswith(("UPDATE", "INSERT"))]
    assert _last_heartbeat(context, host_id) == before
    _flush_liveness(context)
    assert _last_heartbeat(context, host_id) > before
    lost_at = datetime.now(UTC) - timedelta(hours=1)
    with transaction(context.sessions) as s:
        s.execute(update(Host).values(status="lost", last_heartbeat=lost_at))
    context.host_answers.invalidate([host_id])  # (as the reaper's own change does)
    assert _beat(api, host, []).status_code == 200  # comes back: no flush needed
    with transaction(context.sessions) as s:
        status, at = s.execute(select(Host.status, Host.last_heartbeat)).one()
    assert status == "active" and at.replace(tzinfo=UTC) > lost_at + timedelta(minutes=59)


def _phases(api: Api) -> dict[str, tuple[float, float]]:
    """``evenflow_heartbeat_database_seconds`` by phase, as /metrics says: (count, sum)."""
    text = api.client.get("/metrics", headers=api.headers()).text
    out: dict[str, tuple[float, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "evenflow_heartbeat_database_seconds":
            for s in family.samples:
                count, total = out.get(s.labels.get("phase", ""), (0.0, 0.0))
                if s.name.endswith("_count"):
                    count = s.value
                elif s.name.endswith("_sum"):
                    total = s.value
                else:
                    continue
                out[s.labels["phase"]] = (count, total)
    return out


def test_metrics_say_where_a_database_heartbeats_time_went(sqlite_api: Api) -> None:
    """Each heartbeat worked out in the database is timed once per phase; one waiting for the
    database (its write lock held) has that wait in its transaction, not in its slot or its
    thread hop; one answered from memory is timed in none."""
    api, context = sqlite_api, _context(sqlite_api)
    host = api.register("h", devices=1)
    assert _phases(api) == {}
    with context.write_lock:
        beat = threading.Thread(target=lambda: _beat(api, host, []))
        beat.start()
        time.sleep(0.3)
    beat.join(10)
    phases = _phases(api)
    assert {p: n for p, (n, _) in phases.items()} == {"slot": 1, "thread": 1, "transaction": 1}
    assert phases["transaction"][1] >= 0.3
    assert phases["slot"][1] < 0.3 and phases["thread"][1] < 0.3
    assert _beat(api, host, []).status_code == 200  # the same again: from memory
    assert _phases(api) == phases


@pytest.mark.postgres
def test_metrics_time_a_heartbeats_wait_for_its_jobs_report_lock(pg_url: str) -> None:
    """A rank's running report that may start its job takes the job's report lock; the wait
    for it, while another transaction holds it, is its own phase (within the transaction).
    A heartbeat that takes no lock (a launch) is timed in no such phase."""
    with TestClient(create_app(make_settings(pg_url))) as client:
        api = driven(client)
        host = api.register("h", devices=1)
        job = api.submit(workers=1, global_batch=8)
        report = _running(_beat(api, host, []).json())  # the launch: no report lock
        assert "report_lock" not in _phases(api)
        lock = text("SELECT pg_advisory_xact_lock(:cls, :job_id)")
        with _context(api).engine.connect() as holder:
            holder.execute(lock, {"cls": rank_reports.REPORTS_LOCK_CLASS, "job_id": int(job["id"])})
            beat = threading.Thread(target=lambda: _beat(api, host, report))
            beat.start()
            time.sleep(0.6)  # (its own way to the lock takes some of that)
            holder.rollback()
        beat.join(10)
        waited = _phases(api)
        assert waited["report_lock"][0] == 1 and waited["report_lock"][1] >= 0.3
        assert waited["transaction"][1] >= waited["report_lock"][1]
        got = api.client.get(f"/api/v1/jobs/{job['id']}", headers=api.headers()).json()
        assert got["status"] == "running"


@pytest.mark.postgres
def test_metrics_count_the_hosts_each_liveness_flush_wrote_and_left(pg_url: str) -> None:
    """Each flush is timed, and the hosts it wrote and those it left for the next (a row
    another transaction held) are counted: what says, at load, whether heartbeating hosts
    were written in time for the reaper."""
    with TestClient(create_app(make_settings(pg_url))) as client:
        api = driven(client)
        context = _context(api)
        ids = [int(api.register(f"h{i}", devices=1)["id"]) for i in range(2)]  # type: ignore[call-overload]
        _flush_liveness(context)
        before = _liveness_metrics(api)
        later = datetime.now(UTC) + timedelta(seconds=5)
        with context.engine.connect() as holder:  # another transaction holds the first row
            holder.execute(update(Host).where(Host.id == ids[0]).values(address=Host.address))
            for h in ids:
                context.liveness.seen(h, later)
            _flush_liveness(context)
            after = _liveness_metrics(api)  # (the app's own flushes, once a second, may add
            holder.rollback()  # to the held and the flushes, never to the one written)
        assert after["written"] - before["written"] == 1
        assert after["held"] - before.get("held", 0.0) >= 1
        assert after["flushes"] - before["flushes"] >= 1


def _liveness_metrics(api: Api) -> dict[str, float]:
    text = api.client.get("/metrics", headers=api.headers()).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "evenflow_liveness_hosts_total":
                out[s.labels["outcome"]] = s.value
            elif s.name == "evenflow_liveness_flush_seconds_count":
                out["flushes"] = s.value
    return out
