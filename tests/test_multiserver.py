"""A control plane on several machines: servers that share one PostgreSQL database and nothing
else (each its own runtime directory, so no Unix socket bus joins them) hear each other's plans
by LISTEN/NOTIFY, and the controller fails over from one to the other."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, make_url, text

from evenflow.local_cluster import server_process
from server.db import make_engine
from server.locks import CONTROLLER_LOCK_KEY
from server.notify import PG_PAYLOAD_BYTES, PgNotifyBus, PlanBus, Received, open_bus
from tests.harness import ADMIN_TOKEN, ROOT, job_with_plan

POSTGRES_ONLY = pytest.mark.parametrize(
    "db_url", [pytest.param("postgresql", marks=pytest.mark.postgres)], indirect=True
)


class Inbox:
    """What a subscriber heard, with a way to wait for it."""

    def __init__(self) -> None:
        self.ids: set[int] = set()
        self.calls = 0
        self._cond = threading.Condition()

    def __call__(self, ids: set[int]) -> None:
        with self._cond:
            self.ids |= ids
            self.calls += 1
            self._cond.notify_all()

    def wait_for(self, expected: set[int], timeout: float = 10.0) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: expected <= self.ids, timeout), (
                f"heard {sorted(self.ids)[:10]}..., not all of the expected ids"
            )


def test_open_bus_picks_notify_on_postgresql_and_sockets_on_sqlite(tmp_path: Path) -> None:
    assert isinstance(open_bus("postgresql+psycopg://u@h/db"), PgNotifyBus)
    assert not isinstance(open_bus(f"sqlite:///{tmp_path / 'x.db'}"), PgNotifyBus)


@POSTGRES_ONLY
def test_notify_reaches_a_listener_of_another_connection(db_url: str) -> None:
    listener, publisher = open_bus(db_url), open_bus(db_url)
    other_channel = open_bus(db_url, "wake")
    inbox, wake_inbox = Inbox(), Inbox()
    assert isinstance(listener, PgNotifyBus) and isinstance(other_channel, PgNotifyBus)
    try:
        listener.subscribe(inbox)
        other_channel.subscribe(wake_inbox)
        _until_listening(db_url, 2)
        publisher.publish([3, 1, 2, 2])
        inbox.wait_for({1, 2, 3})
        many = list(range(1, 5_001))  # about 24 kB of ids: more than one NOTIFY payload
        publisher.publish(many)
        inbox.wait_for(set(many))
        assert inbox.calls >= 1 + len(str(many)) // PG_PAYLOAD_BYTES
        assert wake_inbox.ids == set()  # the wake channel heard none of the plan ids
    finally:
        for bus in (listener, publisher, other_channel):
            bus.close()


@POSTGRES_ONLY
def test_a_bus_does_not_hear_what_it_published_itself(db_url: str) -> None:
    """As the socket bus skips its own socket: the publisher acted on its ids already (an echo
    dropped the heartbeat answer its own commit had just kept, ``server.scale.host_answers``)."""
    one, other = open_bus(db_url, "hosts"), open_bus(db_url, "hosts")
    heard_by_one, heard_by_other = Inbox(), Inbox()
    try:
        one.subscribe(heard_by_one)
        other.subscribe(heard_by_other)
        _until_listening(db_url, 2)
        one.publish([7])
        assert one.flush(10.0)  # sent before 8 (each bus sends from a thread of its own)
        other.publish([8])
        heard_by_other.wait_for({7})
        heard_by_one.wait_for({8})  # sent after 7, on the same server: 7 was not for it
        assert heard_by_one.ids == {8} and heard_by_other.ids == {7}
    finally:
        one.close()
        other.close()


@POSTGRES_ONLY
def test_a_commit_publishing_waits_for_no_round_trip_and_what_comes_meanwhile_goes_together(
    db_url: str,
) -> None:
    """Commits publish from the threads that made them (a heartbeat's, inside its database
    slot): none waits for the bus's connection, and the ids of the commits that came while it
    was busy go out together."""
    listener, publisher = open_bus(db_url), open_bus(db_url)
    assert isinstance(publisher, PgNotifyBus)
    inbox, published = Inbox(), threading.Event()

    def commits() -> None:
        for i in range(1, 51):
            publisher.publish([i])
        published.set()

    try:
        listener.subscribe(inbox)
        _until_listening(db_url, 1)
        with publisher._lock:  # the bus's connection busy, as with a slow round trip
            threading.Thread(target=commits).start()
            assert published.wait(5.0)  # ... all 50 committers went on meanwhile
        inbox.wait_for(set(range(1, 51)))
        assert inbox.calls <= 2  # the first alone at most (taken before the wait), then the rest
    finally:
        listener.close()
        publisher.close()


@POSTGRES_ONLY
def test_closing_a_bus_sends_what_was_published_first(db_url: str) -> None:
    listener, publisher = open_bus(db_url), open_bus(db_url)
    inbox = Inbox()
    try:
        listener.subscribe(inbox)
        _until_listening(db_url, 1)
        publisher.publish([5, 6])
        publisher.close()
        inbox.wait_for({5, 6})
        publisher.publish([7])  # a closed bus sends nothing more, and does not raise
    finally:
        listener.close()


@POSTGRES_ONLY
def test_a_listener_reconnects_after_its_connection_is_killed(db_url: str) -> None:
    listener, publisher = open_bus(db_url), open_bus(db_url)
    inbox = Inbox()
    assert isinstance(listener, PgNotifyBus)
    try:
        listener.subscribe(inbox)
        _until_listening(db_url, 1)
        engine = create_engine(db_url, isolation_level="AUTOCOMMIT")
        with engine.connect() as c:  # what a database fail-over or an idle-session reaper does
            killed = c.scalars(
                text(
                    "SELECT pid FROM pg_stat_activity "
                    "WHERE datname = current_database() AND query LIKE 'LISTEN%'"
                )
            ).all()
            for pid in killed:
                assert c.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid}).scalar()
        engine.dispose()
        assert len(killed) == 1
        publisher.publish([41])  # the publisher's own connection survives; nobody listens yet
        # A terminated backend stays listed until it has exited: only a new one is listening.
        _until_listening(db_url, 1, besides=killed)
        publisher.publish([42])
        inbox.wait_for({42})
    finally:
        listener.close()
        publisher.close()


@POSTGRES_ONLY
def test_a_publisher_that_failed_to_send_says_so_once_it_can(db_url: str) -> None:
    """Ids a publisher could not send (its NOTIFY connection down twice over) are not lost
    silently: once it can send again it says so (``LOST``), with nothing else to send, and the
    listener runs ``on_lost`` (what its caches drop everything on)."""
    listener, publisher = open_bus(db_url, "hosts"), open_bus(db_url, "hosts")
    assert isinstance(listener, PgNotifyBus) and isinstance(publisher, PgNotifyBus)
    inbox, lost = Inbox(), threading.Event()
    connects = 0

    def on_lost() -> None:
        nonlocal connects
        connects += 1
        if connects > 1:  # the first call is the LISTEN starting
            lost.set()

    good = publisher.conninfo
    try:
        listener.subscribe(inbox, on_lost)
        _until_listening(db_url, 1)
        publisher.conninfo = good.replace(f"@{_host_port(db_url)}", "@127.0.0.1:9")  # refused
        publisher.publish([5])
        assert publisher.flush(10.0)
        assert publisher._lost and not lost.wait(0.5)  # not sent: nobody heard anything
        publisher.conninfo = good  # the database is back: no new ids, yet it says so
        assert lost.wait(10.0), "the listener was never told"
        assert inbox.ids == set()
        publisher.publish([6])  # and goes on as before
        inbox.wait_for({6})
        assert connects == 2  # told once: not again before the 6
    finally:
        listener.close()
        publisher.close()


def _host_port(db_url: str) -> str:
    url = make_url(db_url)
    return f"{url.host}:{url.port or 5432}"


def test_a_socket_listener_whose_queue_filled_is_told_with_the_next_datagram(
    tmp_path: Path,
) -> None:
    """A datagram the socket bus could not send (the listener's queue full) is not lost
    silently: the next one that gets through is preceded by ``LOST``."""
    url = f"sqlite:///{tmp_path / 'x.db'}"
    listener, publisher = PlanBus.for_database(url, "hosts"), PlanBus.for_database(url, "hosts")
    try:
        sock = listener.listen()
        assert sock is not None
        sent = 0
        while not publisher._owed:  # a listener that does not read: its queue fills
            publisher.publish([1])
            sent += 1
            assert sent < 100_000, "the queue never filled"
        full = listener.read(sock)
        assert full.ids == {1} and not full.lost  # what was queued, before any loss
        publisher.publish([2])
        after = listener.read(sock)
        assert after == Received({2}, lost=True)
        publisher.publish([3])
        assert listener.read(sock) == Received({3}, lost=False)  # told once
    finally:
        listener.close()
        publisher.close()


def _until_listening(
    db_url: str, n: int, timeout: float = 10.0, besides: Sequence[int] = ()
) -> None:
    """Until ``n`` connections of the database are listening, not counting the backends
    ``besides``."""
    deadline = time.monotonic() + timeout
    while True:
        ((count,),) = _rows(
            db_url,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND query LIKE 'LISTEN%' AND NOT pid = ANY(:besides)",
            besides=list(besides),
        )
        if count == n:
            return
        assert time.monotonic() < deadline, f"{count} listeners, not {n}"
        time.sleep(0.05)


def _rows(db_url: str, sql: str, **params: object) -> list[tuple[Any, ...]]:
    """The rows of one query, on a connection of its own to the database of ``db_url``."""
    engine = create_engine(db_url)
    try:
        with engine.connect() as c:
            return [tuple(row) for row in c.execute(text(sql), params)]
    finally:
        engine.dispose()


# ------------------------------------------------------------------ two servers, one database


def _server_env(db_url: str, name: str, runtime: Path) -> dict[str, str]:
    runtime.mkdir()
    return {
        **os.environ,
        "EVENFLOW_DATABASE_URL": f"{db_url}?application_name={name}",
        "EVENFLOW_ADMIN_TOKEN": ADMIN_TOKEN,
        "TMPDIR": str(runtime),  # each its own bus directory: only the database joins them
        "PYTHONPATH": str(ROOT),
    }


@pytest.fixture
def two_servers(db_url: str, tmp_path: Path) -> Iterator[tuple[str, str, list[object]]]:
    with ExitStack() as stack:
        procs: list[object] = []
        bases = []
        for name in ("server-a", "server-b"):
            env = _server_env(db_url, name, tmp_path / name)
            base, proc = stack.enter_context(server_process(env))
            bases.append(base)
            procs.append(proc)
            if name == "server-a":  # a's controller is active before b's starts as a standby
                _until_controller(db_url, "server-a")
        yield bases[0], bases[1], procs


def _controller_holder(db_url: str) -> str | None:
    """The application name of the server whose controller holds the advisory lock."""
    key = CONTROLLER_LOCK_KEY & 0xFFFFFFFFFFFFFFFF  # a bigint key: classid high, objid low
    rows = _rows(
        db_url,
        "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a "
        "USING (pid) WHERE l.locktype = 'advisory' AND l.granted "
        "AND l.objsubid = 1 AND l.classid::bigint = :hi AND l.objid::bigint = :lo",
        hi=(key >> 32) & 0xFFFFFFFF,
        lo=key & 0xFFFFFFFF,
    )
    return str(rows[0][0]) if rows else None


def _until_controller(db_url: str, name: str, timeout: float = 20.0) -> float:
    t0 = time.monotonic()
    while _controller_holder(db_url) != name:
        assert time.monotonic() - t0 < timeout, f"the controller lock is not held by {name}"
        time.sleep(0.1)
    return time.monotonic() - t0


@POSTGRES_ONLY
def test_an_override_through_one_server_answers_a_long_poll_held_by_the_other(
    two_servers: tuple[str, str, list[object]],
) -> None:
    a, b, _ = two_servers
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    job = job_with_plan(a)
    known = httpx.get(f"{b}/api/v1/jobs/{job}/plan", headers=auth).json()["version"]
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(
            httpx.get,
            f"{b}/api/v1/jobs/{job}/plan",
            params={"known_version": known, "wait_s": 30},
            headers=auth,
            timeout=40,
        )
        time.sleep(0.5)  # the long-poll is held by b
        body = {"kind": "set_batches", "batch_sizes": [40, 24], "reason": "through a"}
        r = httpx.post(f"{a}/api/v1/jobs/{job}/overrides", json=body, headers=auth)
        assert r.status_code == 201, r.text
        answer = waiting.result(timeout=30)
    assert answer.status_code == 200
    assert answer.json()["version"] > known and answer.json()["batch_sizes"] == [40, 24]


@POSTGRES_ONLY
def test_killing_the_active_controllers_server_hands_the_controller_over(
    two_servers: tuple[str, str, list[object]], db_url: str
) -> None:
    _, b, procs = two_servers
    assert _controller_holder(db_url) == "server-a"
    procs[0].kill()  # type: ignore[attr-defined]  # SIGKILL: no clean release
    took = _until_controller(db_url, "server-b", timeout=10)
    assert took < 10
    assert httpx.get(f"{b}/api/v1/health").status_code == 200


@pytest.mark.postgres
def test_servers_starting_together_migrate_in_turn(pg_template: str, tmp_path: Path) -> None:
    """Replicas of a Deployment start at once against an empty database: each `evenflow
    migrate` waits for the other's migration instead of running Alembic beside it."""
    import subprocess
    import sys
    import uuid

    from tests.harness import PG_ADMIN_URL

    name = f"evenflow_t_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))  # empty: not the migrated template
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    env = {**os.environ, "EVENFLOW_DATABASE_URL": url, "EVENFLOW_ADMIN_TOKEN": ADMIN_TOKEN}
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "evenflow.cli", "migrate"],
                env=env,
                cwd=ROOT,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(3)
        ]
        results = [(p.wait(timeout=120), p.stderr.read() if p.stderr else "") for p in procs]
        assert [code for code, _ in results] == [0, 0, 0], results
        engine = create_engine(url)
        with engine.connect() as c:
            admins = c.execute(text("SELECT count(*) FROM api_tokens WHERE role = 'admin'"))
            assert admins.scalar() == 1
        engine.dispose()
    finally:
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


# ------------------------------------------------------------------ who a connection is


def _names_connected(db_url: str) -> dict[str, int]:
    """Application name -> connections to the database (this query's own left out)."""
    rows = _rows(
        db_url,
        "SELECT application_name, count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND pid <> pg_backend_pid() GROUP BY application_name",
    )
    return {str(name): int(n) for name, n in rows}


@POSTGRES_ONLY
def test_a_servers_connections_say_whose_they_are(db_url: str, tmp_path: Path) -> None:
    """``pg_stat_activity`` tells an `evenflow server`'s API backends from its controller's
    (which holds the controller lock) and from its buses' listeners."""
    env = {**_server_env(db_url, "unused", tmp_path / "s"), "EVENFLOW_DATABASE_URL": db_url}
    with server_process(env) as (base, _):
        job_with_plan(base)  # the API has used its pool; the controller has planned
        _until_controller(db_url, "evenflow-controller")
        names = _names_connected(db_url)
    assert names.get("evenflow-api", 0) >= 1, names
    assert names.get("evenflow-bus", 0) >= 2, names  # the API's and the controller's
    assert set(names) <= {"evenflow-api", "evenflow-controller", "evenflow-bus"}, names


@pytest.mark.postgres
def test_a_name_in_the_database_url_is_kept(pg_url: str) -> None:
    """An operator's own ``application_name`` wins over the process's."""
    named = f"{pg_url}?application_name=ops-chose-this"
    engine = make_engine(named, pool_size=1, name="evenflow-api")
    try:
        with engine.connect() as c:
            assert c.execute(text("SHOW application_name")).scalar() == "ops-chose-this"
    finally:
        engine.dispose()
    buses = [PgNotifyBus.for_database(named, "hosts"), PgNotifyBus.for_database(pg_url)]
    try:
        for bus in buses:
            bus.subscribe(Inbox())
            bus.publish([1])  # its publishing connection too
        expected = {"ops-chose-this": 2, "evenflow-bus": 2}  # each bus: listening, publishing
        deadline = time.monotonic() + 10
        while (names := _names_connected(pg_url)) != expected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert names == expected
    finally:
        for bus in buses:
            bus.close()
