"""The ORM mapping's typed columns: statuses come back as enum members, and a job's spec as a
``JobSpec``, on both backends."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, insert, select, text
from sqlalchemy.exc import StatementError

from contract.enums import HostStatus, JobStatus
from contract.spec import JobSpec
from server.db import make_engine, migrate, session_factory, transaction
from server.models import Host, Job

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
