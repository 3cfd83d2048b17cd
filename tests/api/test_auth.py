"""Tokens and roles: no write without a token of the right role."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from fastapi.testclient import TestClient
from pydantic import SecretStr

from contract.base import PROTOCOL_VERSION
from contract.enums import Role
from server.app import create_app
from server.context import context_of
from server.errors import Unauthorized
from server.services import tokens
from tests.harness import Api, make_settings, statements


def test_health_needs_no_token(api: Api) -> None:
    r = api.client.get("/api/v1/health")
    assert r.status_code == 200
    assert r.json()["status"] == "ok"


def test_missing_and_unknown_tokens_are_401_with_reason(api: Api) -> None:
    r = api.client.get("/api/v1/jobs")
    assert r.status_code == 401
    assert "missing bearer token" in r.json()["detail"]
    r = api.client.get("/api/v1/jobs", headers=api.headers("ef_nope"))
    assert r.status_code == 401
    assert r.json()["detail"] == "unknown token"


def test_roles_gate_writes(api: Api) -> None:
    api.register("h", devices=1)
    viewer, operator = api.token(Role.VIEWER), api.token(Role.OPERATOR)
    spec = {
        "name": "j",
        "workload": {"builtin": "mlp"},
        "global_batch": 8,
        "iterations": 1,
        "workers": 1,
    }
    r = api.client.post("/api/v1/jobs", json=spec, headers=api.headers(viewer))
    assert r.status_code == 403
    assert "operator" in r.json()["detail"]
    assert api.client.get("/api/v1/jobs", headers=api.headers(viewer)).status_code == 200
    assert (
        api.client.post("/api/v1/jobs", json=spec, headers=api.headers(operator)).status_code == 201
    )
    r = api.client.post(
        "/api/v1/tokens", json={"name": "x", "role": "viewer"}, headers=api.headers(operator)
    )
    assert r.status_code == 403
    assert "admin" in r.json()["detail"]


def test_revoked_token_stops_working_at_once(api: Api) -> None:
    tok = api.token(Role.VIEWER, name="soon-gone")
    assert api.client.get("/api/v1/jobs", headers=api.headers(tok)).status_code == 200
    listed = api.client.get("/api/v1/tokens", headers=api.headers()).json()["items"]
    tid = next(t["id"] for t in listed if t["name"] == "soon-gone")
    assert all("token" not in t and "token_hash" not in t for t in listed)
    assert api.client.delete(f"/api/v1/tokens/{tid}", headers=api.headers()).status_code == 200
    r = api.client.get("/api/v1/jobs", headers=api.headers(tok))
    assert r.status_code == 401
    assert "revoked" in r.json()["detail"]
    audit = api.client.get("/api/v1/audit", headers=api.headers()).json()["items"]
    assert any(a["action"] == "token.revoke" and a["target"] == f"token:{tid}" for a in audit)


def test_agent_token_acts_only_for_its_host(api: Api) -> None:
    tok_a = api.token(Role.AGENT, host="host-a")
    api.register("host-a", devices=1, token=tok_a)
    # Same token may not register another host.
    body = {
        "protocol_version": PROTOCOL_VERSION,
        "name": "host-b",
        "address": "10.0.0.2",
        "devices": [{"index": 0, "kind": "cpu", "model": "CPU", "memory_mb": 1}],
    }
    r = api.client.post("/api/v1/hosts/register", json=body, headers=api.headers(tok_a))
    assert r.status_code == 403
    assert "host-a" in r.json()["detail"]
    # An agent cannot submit jobs.
    spec = {
        "name": "j",
        "workload": {"builtin": "mlp"},
        "global_batch": 8,
        "iterations": 1,
        "workers": 1,
    }
    assert api.client.post("/api/v1/jobs", json=spec, headers=api.headers(tok_a)).status_code == 403


def test_agent_writes_telemetry_only_for_jobs_on_its_host(api: Api) -> None:
    a = api.register("host-a", devices=1)
    b = api.register("host-b", devices=1)
    job_a = api.submit(workers=1, global_batch=8)  # equal devices: the first host
    job_b = api.submit(workers=1, global_batch=8)  # then host-b
    rec = {
        "records": [
            {
                "rank": 0,
                "iteration": 0,
                "plan_version": 1,
                "batch_size": 8,
                "data_ms": 1.0,
                "compute_ms": 2.0,
                "sync_ms": 0.5,
                "ts": 1.0,
            }
        ]
    }
    ok = api.client.post(
        f"/api/v1/jobs/{job_a['id']}/telemetry", json=rec, headers=api.headers(str(a["_token"]))
    )
    assert ok.status_code == 200
    r = api.client.post(
        f"/api/v1/jobs/{job_b['id']}/telemetry", json=rec, headers=api.headers(str(a["_token"]))
    )
    assert r.status_code == 403
    assert "host-a" in r.json()["detail"]
    assert (
        api.client.post(
            f"/api/v1/jobs/{job_b['id']}/telemetry", json=rec, headers=api.headers(str(b["_token"]))
        ).status_code
        == 200
    )
    # A viewer may not write telemetry at all.
    viewer = api.token(Role.VIEWER)
    assert (
        api.client.post(
            f"/api/v1/jobs/{job_a['id']}/telemetry", json=rec, headers=api.headers(viewer)
        ).status_code
        == 403
    )


def test_agent_token_must_name_a_host(api: Api) -> None:
    r = api.client.post(
        "/api/v1/tokens", json={"name": "a", "role": "agent"}, headers=api.headers()
    )
    assert r.status_code == 409
    assert r.json()["field"] == "host"


def test_a_new_admin_token_revokes_the_old_bootstrap_one(db_url: str) -> None:
    new = "ef_rotated-admin-token-" + uuid.uuid4().hex
    with TestClient(create_app(make_settings(db_url))) as client:
        api = Api(client)
        operator = api.token(Role.OPERATOR)
    with TestClient(
        create_app(make_settings(db_url).model_copy(update={"admin_token": SecretStr(new)}))
    ) as client:
        api = Api(client)
        old = client.get("/api/v1/tokens", headers=api.headers())
        assert old.status_code == 401 and "revoked" in old.json()["detail"]
        listed = client.get("/api/v1/tokens", headers=api.headers(new)).json()["items"]
        admins = [t for t in listed if t["name"] == "bootstrap-admin"]
        assert [t["revoked_at"] is None for t in admins] == [False, True]
        # Tokens people made are untouched.
        assert client.get("/api/v1/jobs", headers=api.headers(operator)).status_code == 200
        audit = client.get("/api/v1/audit?limit=100", headers=api.headers(new)).json()["items"]
        assert any(a["action"] == "token.revoke" and a["actor"] == "system" for a in audit)
    # Starting again with the same token changes nothing.
    with TestClient(
        create_app(make_settings(db_url).model_copy(update={"admin_token": SecretStr(new)}))
    ) as client:
        assert client.get("/api/v1/tokens", headers=Api(client).headers(new)).status_code == 200


def test_setting_an_admin_token_revokes_a_generated_one(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'e.db'}"
    app = create_app(make_settings(url).model_copy(update={"admin_token": None}))
    with TestClient(app):
        generated = context_of(app).generated_admin_token
    assert generated is not None
    with TestClient(create_app(make_settings(url))) as client:
        r = client.get("/api/v1/tokens", headers={"Authorization": f"Bearer {generated}"})
        assert r.status_code == 401 and "revoked" in r.json()["detail"]
        assert client.get("/api/v1/tokens", headers=Api(client).headers()).status_code == 200


def test_a_revocation_through_one_server_reaches_another_at_once(db_url: str) -> None:
    """Another process caches principals for 10 s; the tokens bus (Unix sockets on SQLite,
    LISTEN/NOTIFY on PostgreSQL) drops a revoked one there within moments, not a TTL later."""
    with (
        TestClient(create_app(make_settings(db_url))) as a,
        TestClient(create_app(make_settings(db_url))) as b,
    ):
        api_a, api_b = Api(a), Api(b)
        tok, keep = api_a.token(Role.VIEWER, name="leaving"), api_a.token(Role.VIEWER)
        for t in (tok, keep):  # cached by b
            assert b.get("/api/v1/jobs", headers=api_b.headers(t)).status_code == 200
        cached = context_of(b.app).caches.tokens
        assert len(cached._data) >= 2
        listed = a.get("/api/v1/tokens", headers=api_a.headers()).json()["items"]
        tid = next(t["id"] for t in listed if t["name"] == "leaving")
        revoked_at = time.monotonic()
        assert a.delete(f"/api/v1/tokens/{tid}", headers=api_a.headers()).status_code == 200
        while (r := b.get("/api/v1/jobs", headers=api_b.headers(tok))).status_code == 200:
            assert time.monotonic() - revoked_at < 3.0, "b still takes the revoked token"
            time.sleep(0.02)
        assert r.status_code == 401 and "revoked" in r.json()["detail"]
        assert b.get("/api/v1/jobs", headers=api_b.headers(keep)).status_code == 200


def test_credentials_read_together_name_each_principal_or_refusal(api: Api) -> None:
    """The token cache's batched read (``tokens.authenticate_keys``): API tokens and worker
    credentials together in two statements, each key its own principal or refusal."""
    context = context_of(api.client.app)  # type: ignore[arg-type]
    host = api.register("h", devices=2)
    job = api.submit(workers=2)
    beat = api.client.post(
        f"/api/v1/hosts/{host['id']}/heartbeat",
        json={"workers": []},
        headers=api.headers(host["_token"]),
    ).json()
    rank0, rank1 = (a["worker_token"] for a in beat["assignments"])
    viewer = api.token(Role.VIEWER, name="looker")
    gone = api.token(Role.VIEWER, name="gone")
    listed = api.client.get("/api/v1/tokens", headers=api.headers()).json()["items"]
    gone_id = next(t["id"] for t in listed if t["name"] == "gone")
    assert api.client.delete(f"/api/v1/tokens/{gone_id}", headers=api.headers()).status_code == 200
    secrets = [viewer, gone, "ef_unknown", rank0, rank1, "efw_unknown", host["_token"]]
    keys = [tokens.cache_key(s) for s in secrets]
    with statements(context.engine, credentials=True) as sql:
        found = tokens.authenticate_keys(context.sessions, keys)
    assert len(sql) == 2
    principal = {s: found[k] for s, k in zip(secrets, keys, strict=True)}
    assert principal[viewer] == tokens.Principal(
        token_id=principal[viewer].token_id,  # type: ignore[union-attr]
        name="looker",
        role=Role.VIEWER,
        host=None,
    )
    assert isinstance(principal[gone], Unauthorized) and "revoked" in principal[gone].message
    assert isinstance(principal["ef_unknown"], Unauthorized)
    assert principal["ef_unknown"].message == "unknown token"
    for rank, secret in enumerate((rank0, rank1)):
        worker = principal[secret]
        assert isinstance(worker, tokens.Principal)
        assert (worker.role, worker.job_id, worker.rank) == (Role.WORKER, job["id"], rank)
    assert isinstance(principal["efw_unknown"], Unauthorized)
    agent = principal[host["_token"]]
    assert isinstance(agent, tokens.Principal)
    assert (agent.role, agent.host) == (Role.AGENT, "h")
    # only worker credentials: one statement
    with statements(context.engine, credentials=True) as sql:
        tokens.authenticate_keys(context.sessions, keys[3:5])
    assert len(sql) == 1 and "api_tokens" not in sql[0]
