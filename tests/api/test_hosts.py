"""Host registration, heartbeats and lost hosts."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from contract.enums import Role
from server.db import transaction
from server.services import hosts
from tests.conftest import Api


def test_register_lists_devices_and_refresh_keeps_ids(api: Api) -> None:
    first = api.register("gpu-1", devices=2)
    ids = [d["id"] for d in first["devices"]]  # type: ignore[union-attr]
    again = api.register("gpu-1", devices=3, token=str(first["_token"]))
    assert [d["id"] for d in again["devices"]][:2] == ids  # type: ignore[union-attr]
    assert len(again["devices"]) == 3  # type: ignore[arg-type]
    listed = api.client.get("/api/v1/hosts", headers=api.headers()).json()
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
    assert api.client.get("/api/v1/hosts", headers=api.headers()).json() == []


def test_duplicate_device_is_422_naming_field(api: Api) -> None:
    tok = api.token(Role.AGENT, host="dup")
    body = {
        "protocol_version": 1,
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
        assert [h.name for h in hosts.mark_lost(s, later, after_s=30)] == ["h"]
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
    assert [(a["rank"], a["attempt"]) for a in r.json()["assignments"]] == [(0, 1), (1, 1)]
    j = api.client.get(f"/api/v1/jobs/{job['id']}", headers=api.headers()).json()
    assert j["status"] == "starting"
    same = [w["device_id"] for w in before["workers"]]
    assert [w["device_id"] for w in j["workers"]] == same  # the same devices, back


def test_recent_heartbeat_is_not_lost(api: Api) -> None:
    api.register("h", devices=1)
    sessions = api.client.app.state.context.sessions  # type: ignore[attr-defined]
    with transaction(sessions) as s:
        assert hosts.mark_lost(s, datetime.now(UTC) + timedelta(seconds=5), after_s=30) == []


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
