"""``db.driver_rows``: a statement's rows straight from the DBAPI driver, as plain tuples, on
SQLite and PostgreSQL alike (named bind parameters, positional on SQLite)."""

from __future__ import annotations

from sqlalchemy import bindparam, select

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
