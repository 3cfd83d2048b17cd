"""Heartbeats that queue while a group runs are worked out together, in one transaction, each
with its own answer or refusal (``server.scale.heartbeat_groups``)."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import event, select
from sqlalchemy.orm import Session

from contract.agent import Heartbeat, HeartbeatAck, WorkerReport
from contract.enums import HostStatus, JobStatus, WorkerState
from server.api.gate import authenticate
from server.context import AppContext, context_of
from server.errors import Conflict
from server.models import Host, Job
from server.scale.heartbeat_groups import Beat, HeartbeatGroups, Worked
from server.services import hosts
from server.services.hosts import Answered
from tests.harness import Api

PAST = datetime(2020, 1, 1, tzinfo=UTC)


def _together(context: AppContext, *beats: Beat) -> list[Worked | BaseException]:
    """``beats`` queued at once behind one group at a time: worked out as one group."""
    groups = HeartbeatGroups(context, at_once=1, max_size=len(beats))

    async def all_of_them() -> list[Worked | BaseException]:
        return await asyncio.gather(*map(groups.work_out, beats), return_exceptions=True)

    return asyncio.run(all_of_them())


def _beat(host_id: int, work: Callable[[Session], object], alone: bool = False) -> Beat:
    """A heartbeat of ``host_id`` whose work is ``work`` (its answer lists nothing)."""

    def answered(session: Session) -> Answered:
        work(session)
        return Answered(HeartbeatAck(host_id=host_id, status=HostStatus.ACTIVE), True)

    return Beat(host_id, answered, datetime.now(UTC), alone=alone)


def _seen(host_id: int, when: datetime) -> Callable[[Session], object]:
    def work(session: Session) -> None:
        host = session.get(Host, host_id)
        assert host is not None
        host.last_heartbeat = when

    return work


def _hosts(api: Api, n: int) -> list[dict[str, Any]]:
    return [api.register(f"h{i}", devices=1) for i in range(n)]


def _times(context: AppContext) -> dict[int, datetime]:
    with context.sessions() as session:
        rows = session.execute(select(Host.id, Host.last_heartbeat)).all()
    return {host_id: when.replace(tzinfo=when.tzinfo or UTC) for host_id, when in rows}


def test_heartbeats_of_a_group_commit_together_and_its_jobs_advance_once(api: Api) -> None:
    """Two hosts report their ranks of a job running in one group: one transaction for both
    reports and one for the job's start, which neither report alone could move."""
    context = context_of(api.client.app)  # type: ignore[arg-type]
    first, second = _hosts(api, 2)
    job_id = int(api.submit(workers=2, global_batch=8)["id"])
    ranks = {}
    for host in (first, second):
        ack = api.client.post(
            f"/api/v1/hosts/{host['id']}/heartbeat", json={}, headers=api.headers(host["_token"])
        ).json()
        ranks[host["id"]] = ack["assignments"][0]
        assert ack["assignments"][0]["job_id"] == job_id
    principals = {h["id"]: asyncio.run(authenticate(context, h["_token"])) for h in (first, second)}
    threads: set[int] = set()
    commits: list[int] = []

    def committed(_session: Session) -> None:
        commits.append(threading.get_ident())

    def beat(host_id: int) -> Beat:
        rank = ranks[host_id]
        report = WorkerReport(
            job_id=job_id, rank=rank["rank"], state=WorkerState.RUNNING, attempt=rank["attempt"]
        )

        def work(session: Session) -> Answered:
            threads.add(threading.get_ident())
            hb = Heartbeat(workers=[report])
            return hosts.heartbeat(session, host_id, hb, principals[host_id], datetime.now(UTC))

        return Beat(host_id, work, datetime.now(UTC))

    event.listen(context.sessions, "after_commit", committed)
    try:
        outcomes = _together(context, beat(first["id"]), beat(second["id"]))
    finally:
        event.remove(context.sessions, "after_commit", committed)
    for outcome, host in zip(outcomes, (first, second), strict=True):
        assert isinstance(outcome, Worked), outcome
        listed = [(a.job_id, a.rank, a.desired) for a in outcome.answered.ack.assignments]
        assert listed == [(job_id, ranks[host["id"]]["rank"], "run")]
        assert outcome.answered.to_advance == {job_id: ranks[host["id"]]["attempt"]}
    assert len(threads) == 1
    assert [t for t in commits if t in threads] == [*threads] * 2  # the reports, then the job
    with context.sessions() as session:
        job = session.get(Job, job_id)
        assert job is not None and job.status == JobStatus.RUNNING.value


def test_a_refused_heartbeat_fails_alone_and_the_rest_of_its_group_commits(api: Api) -> None:
    """The second heartbeat writes, then is refused: its write is undone, the others' are
    committed, each gets its own outcome."""
    context = context_of(api.client.app)  # type: ignore[arg-type]
    ids = [int(h["id"]) for h in _hosts(api, 3)]
    before = _times(context)
    when = datetime.now(UTC) + timedelta(hours=1)

    def refused(session: Session) -> None:
        _seen(ids[1], when)(session)
        session.flush()
        raise Conflict("this agent was replaced and must stop")

    outcomes = _together(
        context,
        _beat(ids[0], _seen(ids[0], when)),
        _beat(ids[1], refused),
        _beat(ids[2], _seen(ids[2], when)),
    )
    assert isinstance(outcomes[0], Worked) and isinstance(outcomes[2], Worked)
    assert isinstance(outcomes[1], Conflict)
    after = _times(context)
    assert (after[ids[0]], after[ids[1]], after[ids[2]]) == (when, before[ids[1]], when)


def test_an_answer_a_later_heartbeat_of_its_group_changed_is_not_kept(api: Api) -> None:
    """A heartbeat's answer was built before the changes of the ones after it in its group:
    kept only if none of them changed its host. One the heartbeats before it changed is kept
    (it saw those changes), and answers the next heartbeat like it from memory."""
    context = context_of(api.client.app)  # type: ignore[arg-type]
    a, b = (int(h["id"]) for h in _hosts(api, 2))

    def other_instance(name: str) -> Callable[[Session], object]:
        def work(session: Session) -> None:
            host = session.get(Host, a)
            assert host is not None
            host.agent_instance = name

        return work

    def nothing(_session: Session) -> None:
        return None

    first, changer = _together(context, _beat(a, nothing), _beat(b, other_instance("second")))
    assert isinstance(first, Worked) and isinstance(changer, Worked)
    assert first.own is None
    assert changer.own == {a}

    answers = context.host_answers
    generation = answers.generation(a)
    changer, after = _together(context, _beat(b, other_instance("third")), _beat(a, nothing))
    assert isinstance(changer, Worked) and isinstance(after, Worked)
    assert after.own == changer.own == {a}
    hb, principal = Heartbeat(), object()
    answers.put(a, hb, principal, b"answer", generation, own=after.own)
    assert answers.get(a, hb, principal) == b"answer"


def test_a_heartbeat_reporting_a_failure_is_worked_out_alone(api: Api) -> None:
    """Its transaction takes its jobs' report locks: never in a group's, which another group
    could deadlock against."""
    context = context_of(api.client.app)  # type: ignore[arg-type]
    ids = [int(h["id"]) for h in _hosts(api, 3)]
    sessions: dict[int, int] = {}
    count = itertools.count()

    def noted(host_id: int) -> Callable[[Session], object]:
        def work(session: Session) -> None:
            sessions[host_id] = session.info.setdefault("test.n", next(count))

        return work

    outcomes = _together(
        context,
        _beat(ids[0], noted(ids[0])),
        _beat(ids[1], noted(ids[1]), alone=True),
        _beat(ids[2], noted(ids[2])),
    )
    assert all(isinstance(o, Worked) for o in outcomes)
    assert sessions[ids[0]] == sessions[ids[2]] != sessions[ids[1]]
