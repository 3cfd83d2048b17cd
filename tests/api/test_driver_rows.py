"""``db.driver_rows``: a statement's rows straight from the DBAPI driver, as plain tuples, on
SQLite and PostgreSQL alike (named bind parameters, positional on SQLite)."""

from __future__ import annotations

import threading
from typing import Any

from psycopg import pq
from sqlalchemy import BigInteger, Float, Integer, bindparam, event, literal, null, select

from server.context import context_of
from server.db import driver_rows, transaction
from server.models import Device, Host
from tests.harness import Api

HOSTS_AFTER = (
    select(Host.id, Host.name, Device.index, Device.memory_mb)
    .join(Device, Device.host_id == Host.id)
    .where(Host.id > bindparam("after"), Device.memory_mb >= bindparam("memory"))
    .order_by(Host.id, Device.index)
)


def test_driver_rows_are_the_statements_rows_as_tuples(api: Api) -> None:
    ids = [int(api.register(f"h{i}", devices=i + 1)["id"]) for i in range(3)]
    context = context_of(api.client.app)
    for after in (0, ids[0], ids[2]):
        params = {"after": after, "memory": 1}
        with transaction(context.sessions) as session:
            expected = [tuple(r) for r in session.execute(HOSTS_AFTER, params)]
            got = driver_rows(session, HOSTS_AFTER, params)
        assert got == expected
        assert all(type(row) is tuple for row in got)
    assert len(expected) == 0 and len(got) == 0  # after the last host: nothing
    with transaction(context.sessions) as session:
        assert [r[1] for r in driver_rows(session, HOSTS_AFTER, {"after": 0, "memory": 1})] == [
            "h0",
            "h1",
            "h1",
            "h2",
            "h2",
            "h2",
        ]


def test_on_postgresql_driver_rows_come_in_binary_with_the_same_values(api: Api) -> None:
    """Binary results (``db.BINARY_RESULTS``) only for ``driver_rows``' statement, with the
    values a text result has: ints, floats to the last bit, booleans and NULLs."""
    context = context_of(api.client.app)
    if context.engine.dialect.name != "postgresql":
        with transaction(context.sessions) as session:  # SQLite: the option is ignored
            assert driver_rows(session, select(literal(1.5)), {}) == [(1.5,)]
        return
    formats: list[tuple[str, object]] = []
    me = threading.get_ident()

    def note(_c: Any, cursor: Any, statement: str, *_: Any) -> None:
        if threading.get_ident() == me:  # not the app's own threads' statements meanwhile
            formats.append((statement, cursor.format))

    values = select(
        literal(7, Integer),
        literal(2**40, BigInteger),
        literal(0.1 + 0.2, Float),
        literal(1e-300, Float),
        literal(True),
        null().cast(Integer),
        literal("text"),
    )
    with transaction(context.sessions) as session:
        expected = [tuple(r) for r in session.execute(values)]
        event.listen(context.engine, "after_cursor_execute", note)
        try:
            got = driver_rows(session, values, {})
            after = [tuple(r) for r in session.execute(values)]
        finally:
            event.remove(context.engine, "after_cursor_execute", note)
    assert got == expected == after == [(7, 2**40, 0.1 + 0.2, 1e-300, True, None, "text")]
    assert [type(v) for v in got[0]] == [type(v) for v in expected[0]]
    assert [f for _, f in formats] == [pq.Format.BINARY, pq.Format.TEXT]
