"""Fixtures: an app per test on SQLite and on PostgreSQL, tokens of every role, a live server.

PostgreSQL tests use a fresh database per test, cloned from a template migrated once per run.
Without a reachable PostgreSQL they skip with the reason, except under CI=true, where they fail.
"""

from __future__ import annotations

import sys
import threading
import traceback
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from server.app import create_app
from server.db import make_engine, migrate
from tests.harness import (
    ADMIN_TOKEN,
    IN_CI,
    PG_ADMIN_URL,
    Api,
    LiveServer,
    driven,
    make_settings,
    pg_database_url,
    serving,
)


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str]:
    """A migrated template database; each test clones it."""
    try:
        admin = create_engine(
            PG_ADMIN_URL, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3}
        )
        with admin.connect() as c:
            c.execute(text("SELECT 1"))
    except Exception as exc:
        if IN_CI:
            pytest.fail(f"CI=true but PostgreSQL at {PG_ADMIN_URL} is unreachable: {exc}")
        pytest.skip(f"PostgreSQL at {PG_ADMIN_URL} is unreachable: {exc}")
    name = f"evenflow_tpl_{uuid.uuid4().hex[:8]}"
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    engine = make_engine(pg_database_url(name))
    migrate(engine)
    engine.dispose()
    yield name
    with admin.connect() as c:
        c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh database of each kind: a SQLite file, and a PostgreSQL one (``pg_url``)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'evenflow.db'}"
    return str(request.getfixturevalue("pg_url"))


@pytest.fixture
def pg_url(pg_template: str) -> Iterator[str]:
    """A fresh PostgreSQL database (a clone of the template) for tests of PostgreSQL only:
    what concurrent transactions see of each other's work, or connections killed under them."""
    name = f"evenflow_t_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}" TEMPLATE "{pg_template}"'))
    yield pg_database_url(name)
    with admin.connect() as c:
        c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def api(db_url: str) -> Iterator[Api]:
    with TestClient(create_app(make_settings(db_url))) as client:
        yield driven(client)


@pytest.fixture
def sqlite_api(tmp_path: Path) -> Iterator[Api]:
    with TestClient(create_app(make_settings(f"sqlite:///{tmp_path / 'e.db'}"))) as client:
        yield driven(client)


@pytest.fixture
def live_server(tmp_path: Path) -> Iterator[LiveServer]:
    """A real uvicorn server on a free port, in a thread, rebalancing like a real one."""
    app = create_app(make_settings(f"sqlite:///{tmp_path / 'live.db'}", rebalance_interval_s=0.2))
    with serving(app) as url:
        yield LiveServer(url, ADMIN_TOKEN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A test whose request to a server in this process timed out gets every thread's stack
    at that moment in its report: what the server was doing instead of answering (CI saw a
    heartbeat and a metrics post time out at 10 s, once each, in tests that pass alone)."""
    report = yield
    if call.when == "call" and call.excinfo and call.excinfo.errisinstance(httpx.TimeoutException):
        report.sections.append(("threads when the request timed out", thread_stacks()))
    return report


def thread_stacks() -> str:
    """Every thread's name and stack, the caller's own left out."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    return "\n".join(
        f"--- {names.get(ident, ident)}\n{''.join(traceback.format_stack(frame))}"
        for ident, frame in sys._current_frames().items()
        if ident != me
    )
