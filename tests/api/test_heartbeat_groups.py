"""Heartbeats that queue for a database slot share a transaction (``server.slot_groups``,
``server.api.heartbeats``): each is answered, and leaves the database, as it would alone, one
after another; only items waiting together are grouped, a failure report goes alone, and one
item's error is its own."""

from __future__ import annotations

import asyncio
import itertools
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from contract.agent import Heartbeat, WorkerReport
from contract.enums import Role
from server.api.heartbeats import Beat, Worked, work_heartbeats
from server.app import create_app
from server.context import AppContext, context_of
from server.db import transaction
from server.models import Device, Host, Job, Worker
from server.services.tokens import Principal
from server.slot_groups import SlotGroups
from tests.harness import Api, driven, make_settings, serving

ADMIN = Principal(0, "admin", Role.ADMIN)

# ------------------------------------------------------------------ the queue, on its own


def _groups(slots: anyio.Semaphore, seen: list[list[Any]]) -> SlotGroups[Any, Any]:
    def work(items: list[Any]) -> list[Any]:
        seen.append(list(items))
        return [ValueError(f"bad {i}") if i == "bad" else f"done {i}" for i in items]

    return SlotGroups(slots, work, max_group=4)


def test_items_waiting_together_share_a_group_and_one_alone_waits_its_own_turn() -> None:
    async def main() -> tuple[list[Any], list[list[Any]]]:
        slots, seen = anyio.Semaphore(1), []
        groups = _groups(slots, seen)
        async with slots:  # busy: every item queues
            runs = [
                asyncio.ensure_future(groups.run(item, alone=item == "c"))
                for item in ["a", "b", "c", "d", "bad", "f", "g"]
            ]
            await asyncio.sleep(0.05)
            assert seen == []
        results = await asyncio.gather(*runs, return_exceptions=True)
        return results, seen

    results, seen = asyncio.run(main())
    # the first free slot takes the first four that may share; "c" next, alone; then the rest
    assert seen == [["a", "b", "d", "bad"], ["c"], ["f", "g"]]
    assert [str(r) for r in results] == [
        "done a", "done b", "done c", "done d", "bad bad", "done f", "done g"
    ]  # fmt: skip
    assert isinstance(results[4], ValueError)  # its own error; the others of its group answered


def test_an_item_that_finds_a_slot_free_runs_at_once_alone() -> None:
    async def main() -> list[list[Any]]:
        slots, seen = anyio.Semaphore(2), []
        groups = _groups(slots, seen)
        for item in ["a", "b", "c"]:
            assert await groups.run(item) == f"done {item}"
        return seen

    assert asyncio.run(main()) == [["a"], ["b"], ["c"]]


def test_a_cancelled_request_leaves_its_group_answered() -> None:
    async def main() -> tuple[list[Any], list[list[Any]]]:
        slots, seen = anyio.Semaphore(1), []
        groups = _groups(slots, seen)
        async with slots:
            runs = [asyncio.ensure_future(groups.run(item)) for item in ["a", "b", "c"]]
            await asyncio.sleep(0.05)
            runs[0].cancel()  # its client went away while it waited
        results = await asyncio.gather(*runs[1:])
        return results, seen

    results, seen = asyncio.run(main())
    assert seen == [["a", "b", "c"]]  # worked out anyway, as a request cancelled mid-commit
    assert results == ["done b", "done c"]


def test_work_that_breaks_gives_every_item_of_its_group_the_error() -> None:
    async def main() -> list[Any]:
        slots = anyio.Semaphore(1)

        def work(items: list[Any]) -> list[Any]:
            raise RuntimeError("the database went away")

        groups: SlotGroups[Any, Any] = SlotGroups(slots, work)
        async with slots:
            runs = [asyncio.ensure_future(groups.run(item)) for item in ["a", "b"]]
            await asyncio.sleep(0.05)
        return await asyncio.gather(*runs, return_exceptions=True)

    assert [type(r) for r in asyncio.run(main())] == [RuntimeError, RuntimeError]


# ------------------------------------------------- together as one after another, property

STATES = ["launching", "running", "succeeded", "failed", "stopped"]
BEATS = st.lists(
    st.tuples(
        st.integers(0, 2),  # which host of the world
        st.lists(st.tuples(st.integers(0, 1), st.sampled_from(STATES)), max_size=4),
    ),
    min_size=1,
    max_size=8,
)


def _world(api: Api, name: str) -> list[int]:
    """Three hosts of two devices and three 2-rank jobs placed on them; the host ids."""
    ids = [int(api.register(f"{name}{i}", devices=2)["id"]) for i in range(3)]  # type: ignore[call-overload]
    for _ in range(3):
        api.submit(workers=2, global_batch=16, max_restarts=1)
    return ids


def _placed(context: AppContext, host_id: int) -> list[tuple[int, int, int]]:
    with transaction(context.sessions) as s:
        rows = s.execute(
            select(Worker.job_id, Worker.rank, Job.attempt)
            .join(Job, Job.id == Worker.job_id)
            .where(Worker.host_id == host_id)
            .order_by(Worker.job_id, Worker.rank)
        )
        return [tuple(r) for r in rows]  # type: ignore[misc]


def _beats(
    context: AppContext, hosts: list[int], drawn: list[tuple[int, list[tuple[int, str]]]]
) -> list[Beat]:
    """The drawn heartbeats: each reports the drawn states of the ranks now on its host (the
    k-th of them), as of its current attempt."""
    beats = []
    for host, reports in drawn:
        placed = _placed(context, hosts[host])
        workers = [
            WorkerReport(
                job_id=placed[k][0],
                rank=placed[k][1],
                attempt=placed[k][2],
                state=state,
                exit_code=1 if state == "failed" else 0 if state == "succeeded" else None,
            )
            for k, state in reports
            if k < len(placed)
        ]
        beats.append(Beat(hosts[host], Heartbeat(workers=workers), ADMIN, datetime.now(UTC)))
    return beats


def _world_state(context: AppContext, hosts: list[int]) -> list[Any]:
    """Each host's ranks (by the job's place in the world), their states and attempts, and its
    devices' holders and statuses: what the world ended as, ids aside."""
    with transaction(context.sessions) as s:
        jobs = sorted(
            {w.job_id for w in s.scalars(select(Worker).where(Worker.host_id.in_(hosts)))}
            | {d.job_id for d in s.scalars(select(Device).where(Device.host_id.in_(hosts)))}
            - {None}
        )
        place = {job_id: k for k, job_id in enumerate(jobs)}
        out: list[Any] = []
        for host_id in hosts:
            host = s.get(Host, host_id)
            assert host is not None
            workers = s.scalars(select(Worker).where(Worker.host_id == host_id)).all()
            out.append(
                (
                    sorted((place[w.job_id], w.rank, w.state, w.exit_code) for w in workers),
                    sorted(
                        (d.index, d.status, place.get(d.job_id) if d.job_id else None)
                        for d in host.devices
                    ),
                )
            )
        for job_id in jobs:
            job = s.get(Job, job_id)
            assert job is not None
            out.append((place[job_id], job.status, job.attempt, job.error))
        return out


def _said(worked: Worked | BaseException, hosts: list[int]) -> Any:
    """An answer as the agent reads it (credentials as whether one came), ids aside."""
    if isinstance(worked, BaseException):
        return type(worked).__name__
    ack = worked.answered.ack
    return [
        (a.rank, a.desired, a.world_size, a.attempt, a.worker_token is not None)
        for a in ack.assignments
    ]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(drawn=BEATS, cuts=st.lists(st.integers(1, 8), max_size=4))
def test_heartbeats_worked_out_together_answer_and_end_as_one_after_another(
    drawn: list[tuple[int, list[tuple[int, str]]]], cuts: list[int]
) -> None:
    """Two alike worlds (three hosts, three 2-rank jobs over them) take the same heartbeats in
    the same order: one each in its own transaction, the other in groups (cut where drawn).
    Every heartbeat gets the same answer, and the worlds end the same (ranks, devices, jobs
    finishing, failing and restarting)."""
    with tempfile.TemporaryDirectory() as tmp:
        db = f"sqlite:///{Path(tmp) / 'g.db'}"
        with TestClient(create_app(make_settings(db))) as client:
            api, context = driven(client), context_of(client.app)  # type: ignore[arg-type]
            alone, together = _world(api, "a"), _world(api, "b")
            answers_alone = [
                _said(work_heartbeats(context, [beat])[0], alone)
                for beat in _beats(context, alone, drawn)
            ]
            beats = _beats(context, together, drawn)
            bounds = sorted({0, len(beats), *(c for c in cuts if c < len(beats))})
            answers_together = []
            for lo, hi in itertools.pairwise(bounds):
                worked = work_heartbeats(context, beats[lo:hi])
                answers_together += [_said(w, together) for w in worked]
            assert answers_together == answers_alone
            assert _world_state(context, together) == _world_state(context, alone)


# ----------------------------------------------------------- what a group may keep in memory


def test_an_answer_a_later_heartbeat_of_its_group_changed_is_not_kept(api: Api) -> None:
    """One host's two heartbeats in one group (an agent that resent, say): the first answer
    was right when built, but the second's reports changed the host after it, so only the
    second may be kept; the commit invalidated the host either way (``own``)."""
    host_id = int(api.register("h", devices=2)["id"])  # type: ignore[call-overload]
    api.submit(workers=2, global_batch=16)
    context = context_of(api.client.app)  # type: ignore[arg-type]
    (launch,) = work_heartbeats(context, [Beat(host_id, Heartbeat(), ADMIN, datetime.now(UTC))])
    assert not isinstance(launch, BaseException)
    ranks = [(a.job_id, a.rank) for a in launch.answered.ack.assignments]

    def beat(state: str) -> Beat:
        reports = [WorkerReport(job_id=j, rank=r, state=state) for j, r in ranks]
        return Beat(host_id, Heartbeat(workers=reports), ADMIN, datetime.now(UTC))

    first, second = work_heartbeats(context, [beat("launching"), beat("running")])
    assert not isinstance(first, BaseException) and not isinstance(second, BaseException)
    assert (first.overtaken, second.overtaken) == (True, False)
    assert host_id in first.own == second.own
    job = api.client.get(f"/api/v1/jobs/{ranks[0][0]}", headers=api.headers()).json()
    assert job["status"] == "running"  # advanced once, after both, in the same transaction


def test_a_group_that_fails_is_worked_out_a_heartbeat_at_a_time(api: Api) -> None:
    """A heartbeat for a host that is gone fails its group's transaction; worked again one at
    a time, the others are answered and it alone gets its refusal."""
    hosts = [int(api.register(f"h{i}", devices=1)["id"]) for i in range(2)]  # type: ignore[call-overload]
    context = context_of(api.client.app)  # type: ignore[arg-type]
    now = datetime.now(UTC)
    beats = [Beat(h, Heartbeat(), ADMIN, now) for h in (hosts[0], 999_999, hosts[1])]
    worked = work_heartbeats(context, beats)
    assert [type(w).__name__ for w in worked] == ["Worked", "NotFound", "Worked"]


# ------------------------------------------------------------ over HTTP, against a real server


def test_heartbeats_that_queue_for_one_slot_are_answered_in_groups(tmp_path: Path) -> None:
    """A server with one database slot and 24 hosts heartbeating at once, each after a change
    (a job's ranks to launch): the heartbeats queued behind the first go in groups
    (``evenflow_heartbeat_group_size``), and every host gets its own answer."""
    app = create_app(make_settings(f"sqlite:///{tmp_path / 'q.db'}", db_concurrency=1))
    with serving(app) as url, _Http(base_url=url, timeout=60) as http:
        http.app = app
        context_of(app).wake_controller = lambda _job_id: None  # placed by the test, as driven
        api = Api(http)  # type: ignore[arg-type]
        hosts = [int(api.register(f"h{i}", devices=1)["id"]) for i in range(24)]  # type: ignore[call-overload]
        job = int(api.submit(workers=24, global_batch=24 * 8)["id"])  # type: ignore[call-overload]

        async def beat_all() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=url, headers=api.headers(), timeout=60) as h:
                return await asyncio.gather(
                    *(h.post(f"/api/v1/hosts/{host}/heartbeat", json={}) for host in hosts)
                )

        answers = asyncio.run(beat_all())
        assert [r.status_code for r in answers] == [200] * 24
        said = [a for r in answers for a in r.json()["assignments"]]
        assert sorted(a["rank"] for a in said) == list(range(24))  # each host its own rank
        assert all(a["job_id"] == job and a["worker_token"] for a in said)  # to launch
        metrics = http.get("/metrics", headers=api.headers()).text
    sizes = _histogram(metrics, "evenflow_heartbeat_group_size")
    assert sizes["count"] >= 1 and sizes["sum"] >= 24  # every heartbeat in some group
    assert sizes["count"] < sizes["sum"]  # and some groups of more than one


class _Http(httpx.Client):
    """A client of a served app that ``Api`` can drive (it places jobs through ``app``)."""

    app: Any


def _histogram(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        for part in ("count", "sum"):
            if line.startswith(f"{name}_{part} "):
                out[part] = float(line.split()[1])
    return out


@pytest.mark.parametrize("alone", [True, False])
def test_only_a_failure_report_goes_alone(alone: bool) -> None:
    state = "failed" if alone else "succeeded"
    beat = Beat(
        1,
        Heartbeat(workers=[WorkerReport(job_id=1, rank=0, state=state)]),
        ADMIN,
        datetime.now(UTC),
    )
    assert beat.alone is alone
