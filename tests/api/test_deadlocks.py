"""A heartbeat's transaction (alone or its group's) that PostgreSQL aborts to break a deadlock,
or whose rows another transaction deleted meanwhile, is run again, not answered 500
(bench/fleet.py at 1,250 hosts: a heartbeat's rank reports against the controller's restart of
their job, each holding rows the other wanted)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import delete, select, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from contract.agent import HeartbeatAck
from contract.enums import HostStatus
from server.context import AppContext, context_of
from server.db import retryable
from server.models import Worker
from server.scale import heartbeat_groups as heartbeats
from server.scale.heartbeat_groups import Beat, HeartbeatGroups, Worked
from server.services.hosts import Answered
from tests.harness import Api

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.parametrize("db_url", ["postgresql"], indirect=True),
]

TOUCH = text("UPDATE hosts SET address = address WHERE id = :id")


def _worked_out(context: AppContext, *works: Callable[[Session], object]) -> list[Worked]:
    """``works`` as heartbeats of one group (host ids 1, 2, ...): their outcomes, in order."""
    groups = HeartbeatGroups(context, at_once=1, max_size=len(works))

    def beat(host_id: int, work: Callable[[Session], object]) -> Beat:
        def answered(session: Session) -> Answered:
            work(session)
            return Answered(HeartbeatAck(host_id=host_id, status=HostStatus.ACTIVE), True)

        return Beat(host_id, answered, datetime.now(UTC))

    async def all_of_them() -> list[Worked]:
        return await asyncio.gather(
            *(groups.work_out(beat(i, w)) for i, w in enumerate(works, start=1))
        )

    return asyncio.run(all_of_them())


def _deadlocked(
    context: AppContext, first: int, second: int, grouped: bool = False
) -> tuple[Any, list[int], list[str]]:
    """A heartbeat's work that locks host ``first`` then ``second`` while another transaction
    locks them the other way round; the work's transaction is made the one PostgreSQL aborts
    (it checks for the deadlock first). ``grouped``: with another heartbeat's work before it,
    in its group. Returns the attempts it saw when its heartbeat was answered (or what that
    raised) and how the other transaction ended."""
    ours_holds, theirs_holds = threading.Event(), threading.Event()
    attempts: list[int] = []
    theirs: list[str] = []
    together: list[bool] = []

    def work(session: Session) -> None:
        attempts.append(len(attempts) + 1)
        together.append(session.info.get("before", False))
        if len(attempts) == 1:
            session.execute(text("SET LOCAL deadlock_timeout = '50ms'"))
        session.execute(TOUCH, {"id": first})
        if len(attempts) == 1:
            ours_holds.set()
            assert theirs_holds.wait(10)
        session.execute(TOUCH, {"id": second})

    def other() -> None:
        try:
            with context.engine.begin() as conn:
                conn.execute(text("SET LOCAL deadlock_timeout = '10s'"))
                conn.execute(TOUCH, {"id": second})
                theirs_holds.set()
                assert ours_holds.wait(10)
                conn.execute(TOUCH, {"id": first})
            theirs.append("committed")
        except OperationalError as exc:
            theirs.append(type(exc.orig).__name__)

    thread = threading.Thread(target=other)
    thread.start()
    before: list[Callable[[Session], object]] = [lambda s: s.info.update(before=True)]
    try:
        result: Any = together if _worked_out(context, *before * grouped, work) else None
    except OperationalError as exc:
        result = exc
    thread.join(30)
    return result, attempts, theirs


def _hosts(api: Api) -> tuple[int, int]:
    a = int(api.register("h0", devices=1)["id"])  # type: ignore[call-overload]
    b = int(api.register("h1", devices=1)["id"])  # type: ignore[call-overload]
    return a, b


@pytest.mark.parametrize(
    ("grouped", "tries", "together"),
    [(False, 3, [False, False]), (True, 3, [True, True]), (True, 1, [True, False])],
    ids=["alone", "group-again-together", "group-then-each-alone"],
)
def test_work_aborted_by_a_deadlock_runs_again_and_commits(
    api: Api, monkeypatch: pytest.MonkeyPatch, grouped: bool, tries: int, together: list[bool]
) -> None:
    """Alone, or in a group, which runs again together; with a single try the group's
    transaction fails, each heartbeat then gets a transaction of its own, and the one that
    deadlocked commits there."""
    monkeypatch.setattr(heartbeats, "TRANSACTION_ATTEMPTS", tries)
    context = context_of(api.client.app)  # type: ignore[arg-type]
    result, attempts, theirs = _deadlocked(context, *_hosts(api), grouped=grouped)
    assert result == together
    assert attempts == [1, 2]
    assert theirs == ["committed"]


def test_without_another_try_the_deadlock_is_what_the_caller_gets(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test above can fail: alone, with a single attempt, the same interleaving raises."""
    monkeypatch.setattr(heartbeats, "TRANSACTION_ATTEMPTS", 1)
    context = context_of(api.client.app)  # type: ignore[arg-type]
    result, attempts, theirs = _deadlocked(context, *_hosts(api))
    assert isinstance(result, OperationalError) and retryable(result)
    assert type(result.orig).__name__ == "DeadlockDetected"
    assert attempts == [1]
    assert theirs == ["committed"]


def test_work_whose_rows_another_transaction_deleted_runs_again(api: Api) -> None:
    """A heartbeat's rank reports against a restart that deleted the job's ranks between the
    heartbeat's read and its write: the ORM's ``StaleDataError``, then a second try that finds
    them gone."""
    api.register("h0", devices=2)
    job_id = int(api.submit(workers=2, global_batch=16)["id"])  # type: ignore[call-overload]
    context = context_of(api.client.app)  # type: ignore[arg-type]
    attempts: list[int] = []

    found: list[int] = []

    def work(session: Session) -> None:
        attempts.append(len(attempts) + 1)
        ranks = list(session.scalars(select(Worker).where(Worker.job_id == job_id)))
        if len(attempts) == 1:
            with context.engine.begin() as conn:  # the restart, committed meanwhile
                conn.execute(delete(Worker).where(Worker.job_id == job_id))
        for worker in ranks:
            worker.exit_code = 0
        session.flush()
        found.append(len(ranks))

    assert len(_worked_out(context, work)) == 1
    assert attempts == [1, 2]
    assert found == [0]  # (the first try failed at its flush)
