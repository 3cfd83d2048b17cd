"""Property-based API fuzzing: schemathesis generates requests from the app's own OpenAPI and
checks that none gets a server error and every response matches the documented schema.
It runs against SQLite and PostgreSQL (which refuses more than SQLite: NUL bytes, int overflow)."""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error, response_schema_conformance
from sqlalchemy import create_engine, text

from server.app import create_app
from tests.harness import ADMIN_TOKEN, IN_CI, PG_ADMIN_URL, make_settings, pg_database_url

CHECKS = [not_a_server_error, response_schema_conformance]
HEADERS = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
TIMEOUT_S = 120
"""How long a fuzzed request may take. This checks errors and schemas, not speed (benchmarks
measure that, in bench/): schemathesis's default of 10 s failed runs on a slow day of the 2-core
machine, once on a 5,000-record telemetry post, once on a model fit (while a second suite ran
beside it)."""

sqlite_app = create_app(
    make_settings(f"sqlite:///{Path(tempfile.mkdtemp(prefix='evenflow-fuzz-')) / 'f.db'}")
)
PG_DB = f"evenflow_fuzz_{uuid.uuid4().hex[:8]}"
pg_app = create_app(make_settings(pg_database_url(PG_DB)))


def _schema(app: FastAPI) -> schemathesis.schemas.BaseSchema:
    """The app's schema, loaded without starting the app (its database may not exist yet)."""
    schema = schemathesis.openapi.from_dict(app.openapi())
    schema.app = app
    return schema


sqlite_schema = _schema(sqlite_app)
pg_schema = _schema(pg_app)


def _serve(app: FastAPI) -> Iterator[None]:
    with TestClient(app):  # start-up: migrations and the admin token
        yield


@pytest.fixture(scope="module")
def sqlite_started() -> Iterator[None]:
    yield from _serve(sqlite_app)


@pytest.fixture(scope="module")
def pg_started() -> Iterator[None]:
    try:
        admin = create_engine(
            PG_ADMIN_URL, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3}
        )
        with admin.connect() as c:
            c.execute(text(f'CREATE DATABASE "{PG_DB}"'))
    except Exception as exc:
        if IN_CI:
            pytest.fail(f"CI=true but PostgreSQL is unreachable: {exc}")
        pytest.skip(f"PostgreSQL at {PG_ADMIN_URL} is unreachable: {exc}")
    yield from _serve(pg_app)
    pg_app.state.context.engine.dispose()
    with admin.connect() as c:
        c.execute(text(f'DROP DATABASE IF EXISTS "{PG_DB}" WITH (FORCE)'))
    admin.dispose()


@sqlite_schema.parametrize()
@FUZZ
def test_sqlite_api_never_500s_and_matches_its_schema(
    case: schemathesis.Case, sqlite_started: None
) -> None:
    case.call_and_validate(headers=HEADERS, checks=CHECKS, timeout=TIMEOUT_S)


@pytest.mark.postgres
@pg_schema.parametrize()
@FUZZ
def test_postgres_api_never_500s_and_matches_its_schema(
    case: schemathesis.Case, pg_started: None
) -> None:
    case.call_and_validate(headers=HEADERS, checks=CHECKS, timeout=TIMEOUT_S)
