"""Host registration, heartbeats and lost hosts."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import delete, insert, text, update

from contract.base import PROTOCOL_VERSION
from contract.enums import Role
from server.app import create_app
from server.db import transaction
from server.models import Device, Worker
from server.services import hosts
from tests.harness import Api, driven, make_settings


def test_register_lists_devices_and_refresh_keeps_ids(api: Api) -> None:
    first = api.register("gpu-1", devices=2)
    ids = [d["id"] for d in first["devices"]]  # type: ignore[union-attr]
    again = api.register("gpu-1", devices=3, token=str(first["_token"]))
    assert [d["id"] for d in again["devices"]][:2] == ids  # type: ignore[union-attr]
    assert len(again["devices"]) == 3  # type: ignore[arg-type]
    listed = api.client.get("/api/v1/hosts", headers=api.headers()).json()["items"]
    assert [h["name"] for h in listed] == ["gpu-1"]
    assert all(d["status"] == "free" for d in listed[0]["devices"])


def test_protocol_mismatch_is_refused_with_409(api: Api) -> None:
    tok = api.token(Role.AGENT, host="old")
    body = {
        "protocol_version": 99,
        "name": "old",
        "address": "127.0.0.1",
        "devices": [{"index": 0, "kind": "cpu", "model": "CPU", "memory_mb": 1}],
    }
    r = api.client.post("/api/v1/hosts/register", json=body, headers=api.headers(tok))
    assert r.status_code == 409
    assert r.json()["field"] == "protocol_version"
    assert "99" in r.json()["detail"]
    assert api.client.get("/api/v1/hosts", headers=api.headers()).json()["items"] == []


def test_duplicate_device_is_422_naming_field(api: Api) -> None:
    tok = api.token(Role.AGENT, host="dup")
    body = {
        "protocol_version": PROTOCOL_VERSION,
        "name": "dup",
        "address": "127.0.0.1",
        "devices": [{"index": 0, "kind": "cpu", "model": "CPU", "memory_mb": 1}] * 2,
    }
    r = api.client.post("/api/v1/hosts/register", json=body, headers=api.headers(tok))
    assert r.status_code == 422
    assert r.json()["field"] == "devices"


def test_silent_host_is_lost_and_its_job_fails_then_recovers(api: Api) -> None:
    host = api.register("h", devices=2)
    job = api.submit(workers=2, max_restarts=0)
    sessions = api.client.app.state.context.sessions  # type: ignore[attr-defined]
    later = datetime.now(UTC) + timedelta(seconds=120)
    with transaction(sessions) as s:
        assert [h.name for h in hosts.mark_lost(s, later, after_s=30).lost] == ["h"]
    got = api.client.get(f"/api/v1/hosts/{host['id']}", headers=api.headers()).json()
    assert got["status"] == "lost"
    assert all(d["status"] == "offline" for d in got["devices"])
    j = api.client.get(f"/api/v1/jobs/{job['id']}", headers=api.headers()).json()
    assert j["status"] == "failed"
    assert "lost" in j["error"]
    # A heartbeat brings it back, devices free again.
    r = api.client.post(
        f"/api/v1/hosts/{host['id']}/heartbeat", json={}, headers=api.headers(str(host["_token"]))
    )
    assert r.status_code == 200
    assert r.json()["status"] == "active"
    got = api.client.get(f"/api/v1/hosts/{host['id']}", headers=api.headers()).json()
    assert all(d["status"] == "free" for d in got["devices"])


def test_a_job_restarted_after_its_host_was_lost_waits_and_gets_its_devices_back(
    api: Api,
) -> None:
    host = api.register("h", devices=2)
    job = api.submit(workers=2)
    before = api.client.get(f"/api/v1/jobs/{job['id']}", headers=api.headers()).json()
    sessions = api.client.app.state.context.sessions  # type: ignore[attr-defined]
    later = datetime.now(UTC) + timedelta(seconds=120)
    with transaction(sessions) as s:
        hosts.mark_lost(s, later, after_s=30)
    j = api.client.get(f"/api/v1/jobs/{job['id']}", headers=api.headers()).json()
    assert (j["status"], j["attempt"], j["workers"]) == ("pending", 1, [])  # nowhere to go
    r = api.client.post(
        f"/api/v1/hosts/{host['id']}/heartbeat", json={}, headers=api.headers(str(host["_token"]))
    )
    assert r.status_code == 200
    api.place()  # the controller's next placement round
    r = api.client.post(
        f"/api/v1/hosts/{host['id']}/heartbeat", json={}, headers=api.headers(str(host["_token"]))
    )
    assert [(a["rank"], a["attempt"]) for a in r.json()["assignments"]] == [(0, 1), (1, 1)]
    j = api.client.get(f"/api/v1/jobs/{job['id']}", headers=api.headers()).json()
    assert j["status"] == "starting"
    same = [w["device_id"] for w in before["workers"]]
    assert [w["device_id"] for w in j["workers"]] == same  # the same devices, back


def test_recent_heartbeat_is_not_lost(api: Api) -> None:
    api.register("h", devices=1)
    sessions = api.client.app.state.context.sessions  # type: ignore[attr-defined]
    with transaction(sessions) as s:
        assert hosts.mark_lost(s, datetime.now(UTC) + timedelta(seconds=5), after_s=30).lost == []


def test_heartbeat_returns_assignments_and_unknown_host_is_404(api: Api) -> None:
    host = api.register("h", devices=2)
    job = api.submit(workers=2, global_batch=10)
    tok = str(host["_token"])
    ack = api.client.post(
        f"/api/v1/hosts/{host['id']}/heartbeat", json={}, headers=api.headers(tok)
    ).json()
    assigned = sorted(
        (a["job_id"], a["rank"], a["desired"], a["backend"]) for a in ack["assignments"]
    )
    assert assigned == [(job["id"], 0, "run", "gloo"), (job["id"], 1, "run", "gloo")]
    assert all(a["world_size"] == 2 and a["spec"]["global_batch"] == 10 for a in ack["assignments"])
    assert (
        api.client.post("/api/v1/hosts/999/heartbeat", json={}, headers=api.headers()).status_code
        == 404
    )


def _heartbeat(api: Api, host: dict[str, object], *reports: tuple[object, int, str]) -> Any:
    body = {"workers": [{"job_id": j, "rank": r, "state": s} for j, r, s in reports]}
    r = api.client.post(
        f"/api/v1/hosts/{host['id']}/heartbeat", json=body, headers=api.headers(str(host["_token"]))
    )
    assert r.status_code == 200, r.text
    return r.json()


def _devices(api: Api) -> list[tuple[str, int | None]]:
    listed = api.client.get("/api/v1/hosts", headers=api.headers()).json()["items"]
    return [(d["status"], d["job_id"]) for h in listed for d in h["devices"]]


def test_devices_of_an_ended_job_stay_busy_until_their_ranks_are_reported_ended(
    api: Api,
) -> None:
    host = api.register("h", devices=2)
    job = api.submit(workers=2)
    _heartbeat(api, host)  # the ranks are handed to the agent (credentials minted)
    _heartbeat(api, host, (job["id"], 0, "running"), (job["id"], 1, "running"))
    waiting = api.submit(workers=2)
    assert api.client.post(f"/api/v1/jobs/{job['id']}/cancel", headers=api.headers()).is_success
    assert _devices(api) == [("busy", job["id"]), ("busy", job["id"])]
    ack = _heartbeat(api, host, (job["id"], 0, "stopped"))
    assert _devices(api) == [("free", None), ("busy", job["id"])]
    assert {a["job_id"] for a in ack["assignments"]} == {job["id"]}  # nothing new placed yet
    _heartbeat(api, host, (job["id"], 1, "stopped"))
    api.place()  # the controller's next placement round
    ack = _heartbeat(api, host)
    assert _devices(api) == [("busy", waiting["id"]), ("busy", waiting["id"])]
    assert [(a["job_id"], a["desired"]) for a in ack["assignments"]] == [
        (waiting["id"], "run"),
        (waiting["id"], "run"),
    ]


def test_a_silent_hosts_devices_are_released_only_once_its_workers_have_surely_exited(
    api: Api,
) -> None:
    host = api.register("h", devices=2)
    job = api.submit(workers=2, max_restarts=0)  # the job ends with its host
    _heartbeat(api, host)
    _heartbeat(api, host, (job["id"], 0, "running"), (job["id"], 1, "running"))
    sessions = api.client.app.state.context.sessions  # type: ignore[attr-defined]
    with transaction(sessions) as s:
        last = hosts.get(s, int(host["id"])).last_heartbeat  # type: ignore[call-overload]
        assert [h.name for h in hosts.mark_lost(s, last + timedelta(seconds=31), after_s=30).lost]
    assert _devices(api) == [("offline", job["id"]), ("offline", job["id"])]
    # The agent is taken for dead after 30 s; its workers exit within 10 s of its death.
    with transaction(sessions) as s:
        assert hosts.release_silent(s, last + timedelta(seconds=39), after_s=30) == []
    assert _devices(api) == [("offline", job["id"]), ("offline", job["id"])]
    with transaction(sessions) as s:
        assert len(hosts.release_silent(s, last + timedelta(seconds=41), after_s=30)) == 2
    assert _devices(api) == [("offline", None), ("offline", None)]
    # Should its agent have been only cut off, it comes back still running those workers:
    # busy again until it reports them stopped.
    ack = _heartbeat(api, host)
    assert _devices(api) == [("busy", job["id"]), ("busy", job["id"])]
    assert {a["desired"] for a in ack["assignments"]} == {"stop"}
    _heartbeat(api, host, (job["id"], 0, "stopped"), (job["id"], 1, "stopped"))
    assert _devices(api) == [("free", None), ("free", None)]


def test_a_lost_host_that_returns_keeps_its_devices_busy_until_its_agent_reports(
    api: Api,
) -> None:
    host = api.register("h", devices=2)
    job = api.submit(workers=2, max_restarts=0)  # the job ends with its host
    _heartbeat(api, host)
    _heartbeat(api, host, (job["id"], 0, "running"), (job["id"], 1, "running"))
    sessions = api.client.app.state.context.sessions  # type: ignore[attr-defined]
    with transaction(sessions) as s:
        hosts.mark_lost(s, datetime.now(UTC) + timedelta(seconds=31), after_s=30)
    ack = _heartbeat(api, host)  # back before its workers could be taken for gone
    assert _devices(api) == [("busy", job["id"]), ("busy", job["id"])]
    assert {a["desired"] for a in ack["assignments"]} == {"stop"}
    _heartbeat(api, host, (job["id"], 0, "stopped"), (job["id"], 1, "stopped"))
    assert _devices(api) == [("free", None), ("free", None)]


def test_ranks_deleted_between_a_heartbeats_reads_make_it_read_again(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank read as still to be launched, then gone when read again to mint its credential
    (another transaction restarted its job between the two statements: bench/fleet.py saw it
    at 1,250 hosts as a 500 with a KeyError): the heartbeat is worked out again from the
    start, and answered with what is there then."""
    host = api.register("h", devices=2)
    job = api.submit(workers=2, global_batch=10)
    real = hosts._placed_here
    calls: list[int] = []

    def placed_then_deleted(session: Any, *args: Any) -> Any:
        placed = real(session, *args)
        calls.append(len(placed))
        if len(calls) == 1:  # as another transaction's commit would, between two statements
            session.execute(delete(Worker).where(Worker.job_id == job["id"]))
        return placed

    monkeypatch.setattr(hosts, "_placed_here", placed_then_deleted)
    ack = _heartbeat(api, host)
    assert calls == [2, 2], "read again, in a transaction of its own"
    launched = sorted((a["rank"], a["worker_token"] is not None) for a in ack["assignments"])
    assert launched == [(0, True), (1, True)]  # the first try's delete was rolled back


@pytest.mark.postgres
def test_the_lost_host_sweep_leaves_a_host_being_placed_on_and_blocks_no_placement(
    pg_url: str,
) -> None:
    """A placement pass midway on a silent host (it took the host's free device and is about
    to insert its rank there, whose reference to the host takes a ``KEY SHARE`` lock): the
    sweep neither waits for the device nor makes the pass wait for the host's row; it marks
    the other silent host lost and leaves this one for the next sweep. Each waiting for the
    other, they deadlocked at 1,250 hosts (bench/fleet.py), and PostgreSQL aborted the sweep
    three times running."""
    with TestClient(create_app(make_settings(pg_url, controller="none"))) as client:
        api = driven(client)
        sessions = client.app.state.context.sessions  # type: ignore[attr-defined]
        engine = client.app.state.context.engine  # type: ignore[attr-defined]
        placed_on = api.register("a", devices=2)
        api.register("b", devices=2)
        device = int(placed_on["devices"][0]["id"])  # type: ignore[index]
        job_id = int(api.submit(workers=1, global_batch=8, place=False)["id"])  # type: ignore[call-overload]
        later = datetime.now(UTC) + timedelta(seconds=600)
        with engine.connect() as placing:
            placing.execute(text("SET LOCAL lock_timeout = '5s'"))
            placing.execute(
                update(Device).where(Device.id == device).values(status="busy", job_id=job_id)
            )
            with sessions() as s:
                s.execute(text("SET LOCAL lock_timeout = '5s'"))  # waiting would fail the test
                sweep = hosts.mark_lost(s, later, after_s=30)
                assert [h.name for h in sweep.lost] == ["b"]
                assert (sweep.silent, sweep.paused) == (2, False)
                placing.execute(  # the pass goes on while the sweep holds its rows
                    insert(Worker).values(
                        job_id=job_id,
                        rank=0,
                        host_id=int(placed_on["id"]),  # type: ignore[call-overload]
                        device_id=device,
                        state="assigned",
                    )
                )
                s.commit()
            placing.rollback()
        with transaction(sessions) as s:
            assert [h.name for h in hosts.mark_lost(s, later, after_s=30).lost] == ["a"]
        got = api.client.get(f"/api/v1/hosts/{placed_on['id']}", headers=api.headers()).json()
        assert [d["status"] for d in got["devices"]] == ["offline", "offline"]
