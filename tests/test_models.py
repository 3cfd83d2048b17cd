"""The ORM mapping's typed columns: statuses come back as enum members, and a job's spec as a
``JobSpec``, on both backends."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import Engine, insert, select, text
from sqlalchemy.dialects import sqlite
from sqlalchemy.exc import StatementError

from contract.enums import HostStatus, JobStatus
from contract.spec import JobSpec
from server.db import make_engine, migrate, session_factory, transaction
from server.models import Base, Host, Job, StrEnumColumn

SPEC = {
    "name": "typed",
    "workload": {"builtin": "mlp"},
    "global_batch": 96,
    "workers": 3,
    "iterations": 10,
}


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    engine = make_engine(db_url)
    migrate(engine)
    yield engine
    engine.dispose()


def test_statuses_are_stored_as_their_values_and_read_as_members(engine: Engine) -> None:
    sessions = session_factory(engine)
    with transaction(sessions) as s:
        s.add(Job(name="a", owner="t", spec=SPEC, status=JobStatus.RUNNING))
    with engine.begin() as conn:  # Core inserts pass plain strings
        conn.execute(insert(Host).values(name="h", address="x", status="lost", protocol_version=1))
        assert conn.execute(text("SELECT status FROM jobs")).scalar() == "running"
    with sessions() as s:
        job = s.scalars(select(Job)).one()
        host = s.scalars(select(Host)).one()
        assert job.status is JobStatus.RUNNING
        assert host.status is HostStatus.LOST


def test_an_unknown_status_is_refused_before_it_is_stored(engine: Engine) -> None:
    sessions = session_factory(engine)
    refused = pytest.raises(StatementError, match="'sleeping' is not a valid JobStatus")
    with refused, transaction(sessions) as s:
        s.add(Job(name="a", owner="t", spec=SPEC, status="sleeping"))
    with sessions() as s:
        assert s.scalars(select(Job)).all() == []


def test_job_spec_reads_the_stored_json_as_a_job_spec() -> None:
    spec = Job(spec=SPEC).job_spec
    assert isinstance(spec, JobSpec)
    assert (spec.global_batch, spec.workers, spec.policy.granularity) == (96, 3, 1)


ENUM_COLUMNS = [
    c.type
    for table in Base.metadata.tables.values()
    for c in table.columns
    if isinstance(c.type, StrEnumColumn)
]


@given(data=st.data())
def test_an_enum_column_converts_as_its_enum_class_would(data: st.DataObject) -> None:
    """Reads and binds look members up in a table, not through the enum class: the same
    member for every value and member, and the same refusal of anything else."""
    column = data.draw(st.sampled_from(ENUM_COLUMNS))
    enum = column.enum
    members = list(enum)
    value = data.draw(
        st.one_of(st.sampled_from(members), st.sampled_from([m.value for m in members]), st.text())
    )
    dialect = sqlite.dialect()
    for convert, expected in (
        (column.process_result_value, lambda v: enum(v)),
        (column.process_bind_param, lambda v: enum(v).value),
    ):
        try:
            want = expected(value)
        except ValueError:
            with pytest.raises(ValueError, match="is not a valid"):
                convert(value, dialect)
            continue
        got = convert(value, dialect)
        assert got == want and type(got) is type(want)
        if convert == column.process_result_value:
            assert got is want
        assert convert(None, dialect) is None


def test_every_enum_column_is_covered() -> None:
    assert {c.enum for c in ENUM_COLUMNS} >= {HostStatus, JobStatus}
    assert len(ENUM_COLUMNS) >= 8
