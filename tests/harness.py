"""What tests share: the admin token, settings for a test app, the ``Api`` helper around a
``TestClient`` (tokens, hosts, jobs, a placement round), a live uvicorn server, and the
PostgreSQL URLs. Fixtures that build these live in ``conftest.py``; tests import from here.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import strategies as st
from sqlalchemy import Engine, event, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from contract.agent import TelemetryRecord
from contract.base import PROTOCOL_VERSION
from contract.enums import Role
from server.config import Settings
from server.context import context_of
from server.controller import CONTROLLER_THREAD, PLACEMENT_THREAD
from server.db import ReadChanged, transaction
from server.models import Device, Job, Worker
from server.services import scheduler

ROOT = Path(__file__).resolve().parents[1]
ADMIN_TOKEN = "ef_test-admin-token-0123456789"
SAME_ORIGIN = {"Origin": "http://testserver"}
"""What a browser on the dashboard sends with a write: the TestClient's own origin."""
PG_ADMIN_URL = os.environ.get(
    "EVENFLOW_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
IN_CI = os.environ.get("CI", "").lower() == "true"


def pg_database_url(dbname: str) -> str:
    return PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + dbname


def make_settings(url: str, **kw: object) -> Settings:
    kw = {"reaper_interval_s": 3600, "rebalance_interval_s": 3600, **kw}
    return Settings(database_url=url, admin_token=ADMIN_TOKEN, **kw)  # type: ignore[arg-type]


@dataclass
class Api:
    """A TestClient on a fresh app plus helpers to mint tokens and register hosts."""

    client: TestClient

    def headers(self, token: str = ADMIN_TOKEN) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}

    def token(self, role: Role, host: str | None = None, name: str | None = None) -> str:
        body: dict[str, object] = {
            "name": name or f"{role.value}-{uuid.uuid4().hex[:6]}",
            "role": role.value,
        }
        if host is not None:
            body["host"] = host
        r = self.client.post("/api/v1/tokens", json=body, headers=self.headers())
        assert r.status_code == 201, r.text
        return str(r.json()["token"])

    def register(
        self, name: str = "host-a", devices: int = 2, token: str | None = None, kind: str = "cpu"
    ) -> dict[str, object]:
        tok = token or self.token(Role.AGENT, host=name)
        body = {
            "protocol_version": PROTOCOL_VERSION,
            "name": name,
            "address": "127.0.0.1",
            "devices": [
                {"index": i, "kind": kind, "model": "CPU", "memory_mb": 1024}
                for i in range(devices)
            ],
        }
        r = self.client.post("/api/v1/hosts/register", json=body, headers=self.headers(tok))
        assert r.status_code == 201, r.text
        data: dict[str, object] = r.json()
        data["_token"] = tok
        self.place()  # its devices are free: pending jobs may start
        return data

    def submit(
        self,
        workers: int | None = 2,
        global_batch: int = 64,
        *,
        place: bool = True,
        **extra: object,
    ) -> dict[str, object]:
        """Submit a job; with ``place``, then run a placement round (as the controller would
        next) and return the job as it is after it."""
        spec = {
            "name": "job",
            "workload": {"builtin": "mlp"},
            "global_batch": global_batch,
            "iterations": 100,
            "workers": workers,
            **extra,
        }
        spec = {k: v for k, v in spec.items() if v is not None}
        r = self.client.post("/api/v1/jobs", json=spec, headers=self.headers())
        assert r.status_code == 201, r.text
        data: dict[str, object] = r.json()
        if not place:
            return data
        self.place()
        job = self.client.get(f"/api/v1/jobs/{data['id']}", headers=self.headers())
        assert job.status_code == 200, job.text
        placed: dict[str, object] = job.json()
        return placed

    def place(self) -> list[int]:
        """One placement round, as the controller runs it (``Controller.place``): requests do
        not poke a driven app's controller, so a job is placed when the test says (or at the
        controller's own pass every few seconds, which this round may race)."""
        try:
            return self._place_once()
        except (IntegrityError, ReadChanged):
            # The app's controller thread still places on its own every few seconds
            # (``controller.PLACE_EVERY_S``): on PostgreSQL its pass may have placed the same
            # job meanwhile (one controller per database places alone; this round is the
            # test's, beside it), or taken the devices this round chose (``ReadChanged``).
            # Once more: what is still pending.
            return self._place_once()

    def _place_once(self) -> list[int]:
        context = context_of(self.client.app)  # type: ignore[arg-type]
        with context.write_lock, transaction(context.sessions) as s:
            hold = context.settings.queue_hold
            return [j.id for j in scheduler.place_pending(s, datetime.now(UTC), hold=hold)]


def driven(client: TestClient) -> Api:
    """An ``Api`` whose app's controller runs only when a test drives it: requests do not poke
    it (placement: ``Api.place``; rounds: ``control_loop.sweep``), so tests are deterministic."""
    context_of(client.app).wake_controller = lambda _job_id: None  # type: ignore[arg-type]
    return Api(client)


def until(check: Callable[[], Any], timeout_s: float = 10.0) -> None:
    """Wait until ``check()`` is true, failing the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LiveServer:
    url: str
    admin_token: str


@contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """Serve ``app`` with a real uvicorn on a free port, in a thread; yields its URL."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=3
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60  # a loaded CI machine took over 20 s once
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/api/v1/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.05)
    else:
        raise RuntimeError("live server did not start")
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def register_host(url: str, token: str, name: str = "h", devices: int = 1) -> None:
    """Register a host of CPU devices with a live server (as an admin may), so jobs fit."""
    body = {
        "protocol_version": PROTOCOL_VERSION,
        "name": name,
        "address": "127.0.0.1",
        "devices": [
            {"index": i, "kind": "cpu", "model": "CPU", "memory_mb": 1024} for i in range(devices)
        ],
    }
    r = httpx.post(
        f"{url}/api/v1/hosts/register", json=body, headers={"Authorization": f"Bearer {token}"}
    )
    assert r.status_code == 201, r.text


def wait_placed(http: httpx.Client | None, url: str, job_id: int, timeout: float = 30.0) -> None:
    """Wait until the controller has placed a submitted job (``POST /jobs`` answers before it
    is placed; the controller places it in its next round)."""
    get = http.get if http is not None else httpx.get
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = get(url).json()["status"]
        if status != "pending":
            return
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} was not placed within {timeout} s")


def telemetry_record(rank: int, iteration: int) -> TelemetryRecord:
    """One rank's timings of one iteration (fixed, small figures)."""
    return TelemetryRecord(
        rank=rank,
        iteration=iteration,
        plan_version=1,
        batch_size=8,
        data_ms=1.0,
        compute_ms=2.0,
        sync_ms=0.5,
        ts=1.0,
    )


_CONTROLLER_THREADS = frozenset({CONTROLLER_THREAD, PLACEMENT_THREAD})


@contextmanager
def statements(engine: Engine, *, credentials: bool = False) -> Iterator[list[str]]:
    """The SQL ``engine`` runs meanwhile, the API tokens' look-ups left out unless
    ``credentials``, and so are those of the app's own controller threads: their rounds run
    every half second and were counted with the work measured when one came in the middle
    (a heartbeat's 8 statements read as 10 in CI)."""
    seen: list[str] = []

    def note(_conn: Any, _cursor: Any, sql: str, *_: Any) -> None:
        if threading.current_thread().name in _CONTROLLER_THREADS:
            return
        if credentials or "api_tokens" not in sql:
            seen.append(sql)

    event.listen(engine, "before_cursor_execute", note)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", note)


def job_with_plan(base: str) -> int:
    """A 2-rank job on a new CPU host ``h`` of the real server at ``base`` (its root URL),
    once it has its first plan."""
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    token = httpx.post(
        f"{base}/api/v1/tokens",
        json={"name": "agent-h", "role": "agent", "host": "h"},
        headers=auth,
    ).json()["token"]
    host = {
        "protocol_version": PROTOCOL_VERSION,
        "name": "h",
        "address": "127.0.0.1",
        "devices": [{"index": i, "kind": "cpu", "model": "CPU", "memory_mb": 1024} for i in (0, 1)],
    }
    r = httpx.post(
        f"{base}/api/v1/hosts/register", json=host, headers={"Authorization": f"Bearer {token}"}
    )
    assert r.status_code == 201, r.text
    spec = {
        "name": "shared",
        "workload": {"builtin": "mlp"},
        "global_batch": 64,
        "iterations": 100,
        "workers": 2,
    }
    r = httpx.post(f"{base}/api/v1/jobs", json=spec, headers=auth)
    assert r.status_code == 201, r.text
    job = int(r.json()["id"])
    deadline = time.monotonic() + 20
    while httpx.get(f"{base}/api/v1/jobs/{job}/plan", headers=auth).status_code != 200:
        assert time.monotonic() < deadline, "the job never got its first plan"
        time.sleep(0.1)
    return job


def placement_rows(s: Session) -> tuple[list[tuple[Any, ...]], ...]:
    """What a heartbeat may change: ranks (state, device), jobs (status, attempt) and devices
    (job, status), each by id."""
    return (
        [
            tuple(r)
            for r in s.execute(
                select(Worker.id, Worker.state, Worker.device_id).order_by(Worker.id)
            )
        ],
        [tuple(r) for r in s.execute(select(Job.id, Job.status, Job.attempt).order_by(Job.id))],
        [
            tuple(r)
            for r in s.execute(select(Device.id, Device.job_id, Device.status).order_by(Device.id))
        ],
    )


FLEET_HOSTS = ("a", "b")
HOST_EVENTS = (
    st.tuples(st.just("submit"), st.integers(1, 4)),
    st.tuples(st.just("cancel"), st.integers(0, 3)),
    st.tuples(st.just("report"), st.sampled_from(["running", "succeeded", "failed"])),
    st.tuples(st.just("fewer"), st.just(0)),
    st.tuples(st.just("quiet"), st.just(0)),
    st.tuples(st.just("lost"), st.just(0)),
    st.tuples(st.just("beat"), st.just(0)),
)
"""What may happen between two hosts' heartbeats (jobs submitted and cancelled, a rank's report
changed, fewer or no reports, the hosts taken for lost, one host beating), for the heartbeat
oracles' property tests; each test adds its own."""


def host_histories(*more: Any, max_size: int) -> Any:
    """Lists of (event, argument, host) drawn from ``HOST_EVENTS`` and ``more``."""
    event = st.one_of(*HOST_EVENTS, *more)
    return st.lists(
        st.tuples(event, st.sampled_from(FLEET_HOSTS)).map(lambda t: (*t[0], t[1])),
        min_size=1,
        max_size=max_size,
    )
