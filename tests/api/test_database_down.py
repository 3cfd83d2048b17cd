"""The database down under a running server: every request that needs it is answered 503 with
``Retry-After`` and a reason naming the database, never a 500 (the agents and the relay retry
what is not refused for good), and the server answers as before once it is back. PostgreSQL:
the database stops accepting connections and every connection to it is ended."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from server.app import create_app
from tests.harness import PG_ADMIN_URL, driven, make_settings, telemetry_record

pytestmark = pytest.mark.postgres


@contextmanager
def database_down(url: str) -> Iterator[None]:
    """No connection to the database of ``url`` while inside (as a stopped server refuses them):
    new ones are refused, open ones are ended; allowed again on the way out."""
    name = url.rsplit("/", 1)[1]
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as c:
            c.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'))
            c.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :d AND pid <> pg_backend_pid()"
                ),
                {"d": name},
            )
        yield
    finally:
        with admin.connect() as c:
            c.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
        admin.dispose()


def _unavailable(r: Any) -> None:
    assert r.status_code == 503, r.text
    assert "database" in r.json()["detail"]
    assert int(r.headers["Retry-After"]) > 0


def test_requests_while_the_database_is_down_get_503_and_work_again_after(pg_url: str) -> None:
    app = create_app(make_settings(pg_url))
    with TestClient(app, raise_server_exceptions=False) as client:
        api = driven(client)
        host = api.register("h", devices=2)
        job = api.submit(workers=2)["id"]
        agent = api.headers(str(host["_token"]))
        beat = f"/api/v1/hosts/{host['id']}/heartbeat"
        assert client.post(beat, json={"workers": []}, headers=agent).status_code == 200
        posted = f"/api/v1/jobs/{job}/telemetry"
        rows = {"records": [telemetry_record(0, 0).model_dump(mode="json")]}
        with database_down(pg_url):
            _unavailable(client.get("/api/v1/jobs", headers=api.headers()))
            _unavailable(client.get(f"/api/v1/jobs/{job}", headers=api.headers()))
            running = {"workers": [{"job_id": job, "rank": 0, "state": "running"}]}
            _unavailable(client.post(beat, json=running, headers=agent))  # a change: stored
            _unavailable(client.post(posted, json=rows, headers=agent))
            spec = {"name": "j", "workload": {"builtin": "mlp"}, "global_batch": 8}
            spec |= {"iterations": 1, "workers": 1}
            _unavailable(client.post("/api/v1/jobs", json=spec, headers=api.headers()))
        assert client.post(posted, json=rows, headers=agent).json()["accepted"] == 1
        assert client.get("/api/v1/jobs", headers=api.headers()).json()["total"] == 1
        assert client.post(beat, json={"workers": []}, headers=agent).status_code == 200
