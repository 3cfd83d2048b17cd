"""Telemetry posts stored in groups (``server.scale.telemetry_writer``, ``telemetry.ingest_many``):
each post of a group is answered and stored exactly as it would be alone, one after another."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Connection, Engine, text

from contract.agent import TelemetryBatch, TelemetryRecord
from contract.enums import Role
from server.context import context_of
from server.errors import EvenflowError, NotFound
from server.scale.telemetry_writer import TelemetryWriter
from server.services import telemetry
from server.services.telemetry import Outcome, Post
from server.services.tokens import Principal
from tests.harness import Api, statements

ADMIN = Principal(0, "admin", Role.ADMIN)
VIEWER = Principal(0, "viewer", Role.VIEWER)


def _agent(host: str) -> Principal:
    return Principal(0, f"agent-{host}", Role.AGENT, host=host)


@dataclass
class Jobs:
    running: int
    pending: int
    ended: int
    principals: list[Principal]
    agent_of: dict[int, Principal]
    """The running job's ranks' agents."""
    examples: int = 0
    """Examples run against these jobs: each posts later iterations than the last, overlapping
    the last's a little (duplicates of stored rows)."""


@pytest.fixture
def jobs(api: Api) -> Jobs:
    """A 4-rank job on two hosts (two ranks each), a pending and a cancelled one."""
    api.register("h0", devices=2)
    api.register("h1", devices=2)
    running = int(api.submit(workers=4, global_batch=32)["id"])  # type: ignore[call-overload]
    pending = int(api.submit(workers=4, global_batch=32)["id"])  # type: ignore[call-overload]
    ended = int(api.submit(workers=1, global_batch=8)["id"])  # type: ignore[call-overload]
    r = api.client.post(f"/api/v1/jobs/{ended}/cancel", headers=api.headers())
    assert r.status_code == 200, r.text
    workers = [Principal(0, f"worker-{r}", Role.WORKER, job_id=running, rank=r) for r in (0, 3)]
    principals = [ADMIN, VIEWER, _agent("h0"), _agent("h1"), *workers]
    engine = context_of(api.client.app).engine  # type: ignore[arg-type]
    with engine.connect() as conn:
        sql = "SELECT w.rank, h.name FROM workers w JOIN hosts h ON h.id = w.host_id WHERE job_id = :j"
        placed = {r: h for r, h in conn.execute(text(sql), {"j": running})}
    assert sorted(placed) == [0, 1, 2, 3] and sorted(placed.values()) == ["h0", "h0", "h1", "h1"]
    return Jobs(running, pending, ended, principals, {r: _agent(h) for r, h in placed.items()})


def _batch(rows: list[tuple[int, int]], mark: float, columns: bool) -> TelemetryBatch:
    records = [
        TelemetryRecord(
            rank=rank,
            iteration=iteration,
            plan_version=1,
            batch_size=8,
            data_ms=1.0,
            compute_ms=mark,  # which post a stored row came from
            sync_ms=2.0,
            ts=1.7e9 + iteration,
        )
        for rank, iteration in rows
    ]
    batch = TelemetryBatch(records=records)
    if columns:
        return TelemetryBatch.model_validate_json(batch.wire_json())
    return batch


post_shapes = st.lists(
    st.tuples(
        st.sampled_from([0, 0, 0, 0, 1, 2, 3]),  # mostly the running job; pending, ended, missing
        st.sampled_from([0, 0, 0, 1, 2, 3, 4, 5]),  # who posts: mostly the admin
        st.lists(st.tuples(st.integers(0, 4), st.integers(0, 5)), min_size=1, max_size=6),
        st.booleans(),  # as columns
    ),
    min_size=1,
    max_size=8,
)


def _posts(jobs: Jobs, shapes: list[tuple[int, int, list[tuple[int, int]], bool]]) -> list[Post]:
    ids = [jobs.running, jobs.pending, jobs.ended, 10_000]
    first = 4 * jobs.examples
    jobs.examples += 1
    return [
        Post(
            ids[job],
            _batch([(r, first + it) for r, it in rows], float(i + 1), columns),
            jobs.principals[who],
        )
        for i, (job, who, rows, columns) in enumerate(shapes)
    ]


def _seen(outcomes: list[Outcome]) -> list[Any]:
    return [
        (type(o).__name__, o.message, o.field) if isinstance(o, EvenflowError) else o
        for o in outcomes
    ]


def _stored(conn: Connection) -> list[tuple[Any, ...]]:
    sql = "SELECT job_id, rank, iteration, compute_ms FROM iteration_telemetry"
    return sorted(tuple(r) for r in conn.execute(text(sql)))


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(shapes=post_shapes)
def test_a_group_is_answered_and_stored_as_its_posts_one_by_one(
    api: Api, jobs: Jobs, shapes: list[tuple[int, int, list[tuple[int, int]], bool]]
) -> None:
    """Refusals (a missing, pending or ended job, a rank out of range, another host's rank or
    another worker's, a viewer), duplicates against stored rows and within the group, and
    which post a repeated key is credited to: all as if each post came alone, in order."""
    posts = _posts(jobs, shapes)
    engine = context_of(api.client.app).engine  # type: ignore[arg-type]
    with engine.connect() as conn:
        with conn.begin() as alone:
            one_by_one = [telemetry.ingest_many(conn, [post])[0] for post in posts]
            expected = _stored(conn)
            alone.rollback()
        with conn.begin():
            together = telemetry.ingest_many(conn, posts)
            assert _seen(together) == _seen(one_by_one)
            assert _stored(conn) == expected
    # the group committed: the same posts again are all duplicates, or refused as before
    with engine.begin() as conn:
        again = telemetry.ingest_many(conn, posts)
    for before, after, post in zip(together, again, posts, strict=True):
        if isinstance(before, EvenflowError):
            assert _seen([after]) == _seen([before])
        else:
            assert after == (0, len(post.batch.arrays()[0]))


def test_a_group_is_one_transaction_and_its_statements_do_not_grow_with_it(
    api: Api, jobs: Jobs
) -> None:
    posts = [
        Post(jobs.running, _batch([(r, it)], 1.0, True), jobs.agent_of[r])
        for r in range(4)
        for it in range(8)
    ]
    engine = context_of(api.client.app).engine  # type: ignore[arg-type]
    with statements(engine) as sql, engine.begin() as conn:
        outcomes = telemetry.ingest_many(conn, posts)
    assert outcomes == [(1, 0)] * 32
    # the jobs' states, the agents' ranks, one insert (SQLite: one executemany per post);
    # on PostgreSQL the id-order lock before the insert
    pg = engine.dialect.name == "postgresql"
    inserts = [s for s in sql if "INSERT INTO iteration_telemetry" in s]
    locks = [s for s in sql if "pg_advisory_xact_lock" in s]
    assert len(locks) == (1 if pg else 0)
    assert len(sql) - len(inserts) - len(locks) == 2
    assert len(inserts) == (1 if pg else 32)
    if pg:
        assert sql.index(locks[0]) == sql.index(inserts[0]) - 1


@pytest.mark.parametrize(
    "db_url", [pytest.param("postgresql", marks=pytest.mark.postgres)], indirect=True
)
def test_groups_of_two_writers_commit_in_the_order_of_their_ids(api: Api, jobs: Jobs) -> None:
    """Two processes' writers (two connections here): while one group is inserted and not yet
    committed, the other's insert waits for that commit, so no reader by id ever sees a group
    before one with smaller ids (``telemetry._PG_ID_ORDER``). Without the lock the second
    committed at once, ids above the first's, and a reader moved its mark past the first's
    rows while they were still invisible to it (``NewRows``)."""
    engine = context_of(api.client.app).engine  # type: ignore[arg-type]
    first = [
        Post(jobs.running, _batch([(r, it) for it in range(50)], 1.0, True), ADMIN)
        for r in range(2)
    ]
    second = [
        Post(jobs.running, _batch([(r, it) for it in range(50)], 2.0, True), ADMIN)
        for r in range(2, 4)
    ]
    inserted, commit = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def write_first() -> None:
        try:
            with engine.begin() as conn:
                assert telemetry.ingest_many(conn, first) == [(50, 0), (50, 0)]
                inserted.set()
                commit.wait(30)
        except BaseException as exc:
            errors.append(exc)
            inserted.set()

    def write_second() -> None:
        try:
            with engine.begin() as conn:
                assert telemetry.ingest_many(conn, second) == [(50, 0), (50, 0)]
        except BaseException as exc:
            errors.append(exc)

    one = threading.Thread(target=write_first)
    one.start()
    assert inserted.wait(30)
    two = threading.Thread(target=write_second)
    two.start()
    try:
        waiting = _waits_for_advisory_lock(engine)
        committed_meanwhile = _by_mark(engine).get(2.0)
    finally:
        commit.set()
        one.join(30)
        two.join(30)
    assert not errors, errors
    assert waiting, "the second writer's insert did not wait for the first's commit"
    assert committed_meanwhile is None, "the second group committed before the first"
    spans = _by_mark(engine)
    assert spans[1.0][1] < spans[2.0][0]  # the first group's ids all below the second's


def _waits_for_advisory_lock(engine: Engine, timeout_s: float = 10.0) -> bool:
    """Whether a session of this database comes to wait for an advisory lock."""
    sql = text(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND wait_event_type = 'Lock' AND wait_event = 'advisory'"
    )
    deadline = time.monotonic() + timeout_s
    with engine.connect() as conn:
        while time.monotonic() < deadline:
            if conn.execute(sql).scalar_one():
                return True
            conn.rollback()
            time.sleep(0.02)
    return False


def _by_mark(engine: Engine) -> dict[float, tuple[int, int]]:
    """The (min, max) ids of the committed rows of each post mark (their ``compute_ms``)."""
    with engine.connect() as conn:
        sql = "SELECT compute_ms, min(id), max(id) FROM iteration_telemetry GROUP BY compute_ms"
        return {float(m): (int(lo), int(hi)) for m, lo, hi in conn.execute(text(sql))}


# ------------------------------------------------------------------ the writer and its thread


class Held:
    """A write lock the test holds: the writer's thread waits in it with the first post."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entered = threading.Event()

    def __enter__(self) -> None:
        self.entered.set()
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def _rows(engine: Engine, job_id: int) -> int:
    with engine.connect() as conn:
        sql = text("SELECT count(*) FROM iteration_telemetry WHERE job_id = :j")
        return int(conn.execute(sql, {"j": job_id}).scalar_one())


def test_posts_that_arrive_while_one_is_written_share_the_next_transaction(
    api: Api, jobs: Jobs
) -> None:
    engine = context_of(api.client.app).engine  # type: ignore[arg-type]
    held, groups = Held(), list[int]()
    writer = TelemetryWriter(engine, held, groups.append)
    posts = [
        Post(jobs.running, _batch([(r, it)], 1.0, True), jobs.agent_of[r])
        for it in range(5)
        for r in range(4)
    ]
    posts.insert(7, Post(10_000, _batch([(0, 0)], 1.0, True), ADMIN))  # refused alone
    posts.insert(3, Post(jobs.running, _batch([(0, 0)], 1.0, True), ADMIN))  # a duplicate

    async def post_all() -> list[Any]:
        first = asyncio.ensure_future(writer.store(posts[0]))
        await asyncio.to_thread(held.entered.wait, 10)  # the writer has taken the first
        rest = [asyncio.ensure_future(writer.store(p)) for p in posts[1:]]
        await asyncio.sleep(0.2)
        assert not any(f.done() for f in [first, *rest])  # nothing answered before its commit
        held.lock.release()
        answers = await asyncio.gather(first, *rest, return_exceptions=True)
        held.lock.acquire()
        return answers

    held.lock.acquire()
    try:
        answers = asyncio.run(post_all())
    finally:
        held.lock.release()
        writer.close()
    refused = answers.pop(8)
    assert isinstance(refused, NotFound) and refused.message == "job 10000 not found"
    assert answers.pop(3) == (0, 1)  # rank 0's iteration 0 came with the first post
    assert answers == [(1, 0)] * 20
    assert _rows(engine, jobs.running) == 20
    assert groups == [1, 21]  # the first alone, the rest queued behind it together


def test_an_urgent_post_is_written_ahead_of_the_posts_queued_before_it(
    api: Api, jobs: Jobs
) -> None:
    """The writer's next transaction after the one under way is the urgent posts' alone (a
    straggler's onset), then the others in the order they came."""
    engine = context_of(api.client.app).engine  # type: ignore[arg-type]
    held, groups = Held(), list[int]()
    writer = TelemetryWriter(engine, held, groups.append)
    first = Post(jobs.running, _batch([(0, 0)], 1.0, True), ADMIN)
    regular = [Post(jobs.running, _batch([(r, 1)], 2.0, True), ADMIN) for r in range(4)]
    urgent = [Post(jobs.running, _urgent(_batch([(r, 2)], 3.0, True)), ADMIN) for r in (1, 2)]
    queued = [*regular[:2], urgent[0], *regular[2:], urgent[1]]

    async def post_all() -> list[Any]:
        answers = [asyncio.ensure_future(writer.store(first))]
        await asyncio.to_thread(held.entered.wait, 10)  # the writer has taken the first
        answers += [asyncio.ensure_future(writer.store(p)) for p in queued]
        await asyncio.sleep(0.2)
        held.lock.release()
        return await asyncio.gather(*answers)

    held.lock.acquire()
    try:
        answers = asyncio.run(post_all())
    finally:
        writer.close()
    assert answers == [(1, 0)] * 7
    assert groups == [1, 2, 4]  # the one under way; the urgent two; the rest
    with engine.connect() as conn:
        marks = conn.execute(
            text("SELECT compute_ms FROM iteration_telemetry WHERE job_id = :j ORDER BY id"),
            {"j": jobs.running},
        ).scalars()
        assert list(marks) == [1.0, 3.0, 3.0, 2.0, 2.0, 2.0, 2.0]


def _urgent(batch: TelemetryBatch) -> TelemetryBatch:
    return batch.model_copy(update={"urgent": True})


def test_a_group_that_fails_is_written_post_by_post(
    api: Api, jobs: Jobs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure of the group's transaction as a whole (not a refusal of one post) does not
    fail its other posts: each is tried again alone, and only the one that fails alone fails."""
    engine = context_of(api.client.app).engine  # type: ignore[arg-type]
    real = telemetry.ingest_many
    poison = Post(jobs.running, _batch([(3, 99)], 1.0, True), ADMIN)

    def failing(conn: Connection, posts: list[Post]) -> list[Outcome]:
        if poison in posts:
            raise RuntimeError("the database went away")
        return real(conn, posts)

    monkeypatch.setattr(telemetry, "ingest_many", failing)
    held = Held()
    writer = TelemetryWriter(engine, held)
    posts = [Post(jobs.running, _batch([(r, 0)], 1.0, True), ADMIN) for r in range(3)]

    async def post_all() -> list[Any]:
        first = asyncio.ensure_future(writer.store(posts[0]))
        await asyncio.to_thread(held.entered.wait, 10)
        rest = [asyncio.ensure_future(writer.store(p)) for p in [posts[1], poison, posts[2]]]
        await asyncio.sleep(0.1)
        held.lock.release()
        return await asyncio.gather(first, *rest, return_exceptions=True)

    held.lock.acquire()
    try:
        answers = asyncio.run(post_all())
    finally:
        writer.close()
    failed = answers.pop(2)
    assert isinstance(failed, RuntimeError)
    assert answers == [(1, 0)] * 3
    assert _rows(engine, jobs.running) == 3


def test_closing_the_writer_writes_what_is_queued_first_and_a_later_post_reopens_it(
    api: Api, jobs: Jobs
) -> None:
    engine = context_of(api.client.app).engine  # type: ignore[arg-type]
    held = Held()
    writer = TelemetryWriter(engine, held)
    posts = [Post(jobs.running, _batch([(0, it)], 1.0, True), ADMIN) for it in range(4)]

    async def post_all() -> list[Any]:
        answers = [asyncio.ensure_future(writer.store(p)) for p in posts]
        await asyncio.to_thread(held.entered.wait, 10)
        closing = asyncio.ensure_future(asyncio.to_thread(writer.close))
        await asyncio.sleep(0.1)
        held.lock.release()
        await closing
        return await asyncio.gather(*answers)

    held.lock.acquire()
    assert asyncio.run(post_all()) == [(1, 0)] * 4
    assert _rows(engine, jobs.running) == 4
    # the app's next lifespan (a test client's): a post after the close starts a new thread
    later = Post(jobs.running, _batch([(0, 9)], 1.0, True), ADMIN)
    assert asyncio.run(writer.store(later)) == (1, 0)
    writer.close()
    assert _rows(engine, jobs.running) == 5
