"""Job code holds only its own rank's credential: what a worker token may and may not do, agents
writing only the ranks of their own host, no telemetry once a job has ended, and one live agent
per host name."""

from __future__ import annotations

import hashlib
from typing import Any

from sqlalchemy import select

from contract.base import PROTOCOL_VERSION
from contract.enums import Role
from server.context import context_of
from server.models import Worker
from tests.harness import Api


def _record(rank: int, iteration: int = 0) -> dict[str, Any]:
    return {
        "rank": rank,
        "iteration": iteration,
        "plan_version": 1,
        "batch_size": 8,
        "data_ms": 1.0,
        "compute_ms": 2.0,
        "sync_ms": 0.5,
        "ts": 1.0,
    }


def _heartbeat(api: Api, host: dict[str, Any], **body: Any) -> dict[str, Any]:
    r = api.client.post(
        f"/api/v1/hosts/{host['id']}/heartbeat",
        json={"workers": [], **body},
        headers=api.headers(str(host["_token"])),
    )
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


def _worker_tokens(api: Api, host: dict[str, Any]) -> dict[tuple[int, int], str]:
    return {
        (a["job_id"], a["rank"]): a["worker_token"]
        for a in _heartbeat(api, host)["assignments"]
        if a["worker_token"] is not None
    }


def _post(api: Api, job_id: object, token: str, *ranks: int) -> Any:
    return api.client.post(
        f"/api/v1/jobs/{job_id}/telemetry",
        json={"records": [_record(r) for r in ranks]},
        headers=api.headers(token),
    )


def test_a_worker_token_reads_its_own_job_and_nothing_else(api: Api) -> None:
    host = api.register("host-a", devices=4)
    job, other = api.submit(workers=2), api.submit(workers=2)
    tokens = _worker_tokens(api, host)
    assert set(tokens) == {(job["id"], 0), (job["id"], 1), (other["id"], 0), (other["id"], 1)}
    assert all(t.startswith("efw_") for t in tokens.values())
    mine = api.headers(tokens[(job["id"], 0)])
    plan = api.client.get(f"/api/v1/jobs/{job['id']}/plan", headers=mine)
    assert plan.status_code == 200
    version = plan.json()["version"]
    held = api.client.get(
        f"/api/v1/jobs/{job['id']}/plan",
        params={"known_version": version, "wait_s": 0.1},
        headers=mine,
    )
    assert held.status_code == 304  # the long-poll works too
    spec = api.client.get(f"/api/v1/jobs/{job['id']}", headers=mine)
    assert spec.status_code == 200 and spec.json()["spec"]["global_batch"] == 64
    r = api.client.get(f"/api/v1/jobs/{other['id']}/plan", headers=mine)
    assert r.status_code == 403
    assert f"worker credential of job {job['id']}" in r.json()["detail"]
    for path in ("/api/v1/jobs", "/api/v1/hosts", "/api/v1/tokens", "/api/v1/audit"):
        r = api.client.get(path, headers=mine)
        assert r.status_code == 403, path
        assert "worker credential" in r.json()["detail"]


def test_a_worker_token_posts_only_its_own_rank_and_cannot_act(api: Api) -> None:
    host = api.register("host-a", devices=4)
    job, other = api.submit(workers=2), api.submit(workers=2)
    tokens = _worker_tokens(api, host)
    rank0 = tokens[(job["id"], 0)]
    assert _post(api, job["id"], rank0, 0).status_code == 200
    r = _post(api, job["id"], rank0, 1)
    assert r.status_code == 403
    assert "rank 0 only, not rank 1" in r.json()["detail"]
    r = _post(api, job["id"], rank0, 0, 1)  # one foreign rank spoils the batch
    assert r.status_code == 403
    r = _post(api, other["id"], rank0, 0)
    assert r.status_code == 403
    assert f"not post telemetry for job {other['id']}" in r.json()["detail"]
    # No cancelling, registering, heartbeats, tokens or submissions.
    h = api.headers(rank0)
    assert api.client.post(f"/api/v1/jobs/{other['id']}/cancel", headers=h).status_code == 403
    assert api.client.post(f"/api/v1/jobs/{job['id']}/cancel", headers=h).status_code == 403
    reg = {
        "protocol_version": PROTOCOL_VERSION,
        "name": "host-a",
        "address": "10.0.0.9",
        "devices": [{"index": 0, "kind": "cpu", "model": "CPU", "memory_mb": 1}],
    }
    assert api.client.post("/api/v1/hosts/register", json=reg, headers=h).status_code == 403
    hb = api.client.post(f"/api/v1/hosts/{host['id']}/heartbeat", json={"workers": []}, headers=h)
    assert hb.status_code == 403
    r = api.client.post("/api/v1/tokens", json={"name": "x", "role": "admin"}, headers=h)
    assert r.status_code == 403
    statuses = {
        j["id"]: j["status"]
        for j in api.client.get("/api/v1/jobs", headers=api.headers()).json()["items"]
    }
    assert statuses[job["id"]] == statuses[other["id"]] == "starting"


def test_only_the_hash_of_a_worker_token_is_stored(api: Api) -> None:
    host = api.register("host-a", devices=2)
    job = api.submit(workers=2)
    tokens = _worker_tokens(api, host)
    context = context_of(api.client.app)  # type: ignore[arg-type]
    with context.sessions() as s:
        stored = {(w.job_id, w.rank): w.token_hash for w in s.scalars(select(Worker))}
    for key, secret in tokens.items():
        assert stored[key] == hashlib.sha256(secret.encode()).hexdigest()
        assert secret not in stored.values()
    assert (job["id"], 0) in tokens


def test_a_rank_handed_out_again_gets_a_new_token_and_the_old_one_dies(api: Api) -> None:
    host = api.register("host-a", devices=1)
    job = api.submit(workers=1, global_batch=8)
    first = _worker_tokens(api, host)[(job["id"], 0)]
    second = _worker_tokens(api, host)[(job["id"], 0)]  # the agent never launched it
    assert first != second
    assert _post(api, job["id"], first, 0).status_code == 401
    assert _post(api, job["id"], second, 0).status_code == 200
    # Once the agent says the rank runs, no credential is sent any more.
    r = api.client.post(
        f"/api/v1/hosts/{host['id']}/heartbeat",
        json={"workers": [{"job_id": job["id"], "rank": 0, "state": "running"}]},
        headers=api.headers(str(host["_token"])),
    )
    assert [a["worker_token"] for a in r.json()["assignments"]] == [None]
    assert _post(api, job["id"], second, 0).status_code == 200


def test_a_worker_token_dies_when_its_job_ends(api: Api) -> None:
    host = api.register("host-a", devices=1)
    job = api.submit(workers=1, global_batch=8)
    token = _worker_tokens(api, host)[(job["id"], 0)]
    plan = f"/api/v1/jobs/{job['id']}/plan"
    assert api.client.get(plan, headers=api.headers(token)).status_code == 200
    r = api.client.post(f"/api/v1/jobs/{job['id']}/cancel", headers=api.headers())
    assert r.status_code == 200
    r = api.client.get(plan, headers=api.headers(token))
    assert r.status_code == 401
    assert "the job has ended (cancelled)" in r.json()["detail"]
    assert _post(api, job["id"], token, 0).status_code == 401
    # The stop assignment carries no credential.
    assert [a["worker_token"] for a in _heartbeat(api, host)["assignments"]] == [None]


def test_worker_credentials_cannot_be_created_through_tokens(api: Api) -> None:
    r = api.client.post(
        "/api/v1/tokens", json={"name": "w", "role": "worker"}, headers=api.headers()
    )
    assert r.status_code == 409
    assert r.json()["field"] == "role"


def test_an_agent_writes_only_the_ranks_placed_on_its_host(api: Api) -> None:
    a = api.register("host-a", devices=1)
    b = api.register("host-b", devices=1)
    job = api.submit(workers=2, global_batch=8)  # one rank on each host
    ranks = {
        host: [x["rank"] for x in _heartbeat(api, h)["assignments"]]
        for host, h in (("a", a), ("b", b))
    }
    mine, theirs = ranks["a"][0], ranks["b"][0]
    assert _post(api, job["id"], str(a["_token"]), mine).status_code == 200
    r = _post(api, job["id"], str(a["_token"]), theirs)
    assert r.status_code == 403
    assert f"rank {theirs} of job {job['id']} is not placed on host 'host-a'" in r.json()["detail"]
    r = _post(api, job["id"], str(a["_token"]), mine, theirs)
    assert r.status_code == 403
    assert _post(api, job["id"], str(b["_token"]), theirs).status_code == 200


def test_telemetry_for_an_ended_job_is_409(api: Api) -> None:
    host = api.register("host-a", devices=1)
    job = api.submit(workers=1, global_batch=8)
    assert _post(api, job["id"], str(host["_token"]), 0).status_code == 200
    api.client.post(f"/api/v1/jobs/{job['id']}/cancel", headers=api.headers())
    for token in (str(host["_token"]), api.headers()["Authorization"].split()[1]):
        r = _post(api, job["id"], token, 0)
        assert r.status_code == 409
        assert "has ended (cancelled)" in r.json()["detail"]


def _register(api: Api, token: str, instance: str, **extra: Any) -> Any:
    body = {
        "protocol_version": PROTOCOL_VERSION,
        "name": "host-a",
        "address": "127.0.0.1",
        "devices": [{"index": 0, "kind": "cpu", "model": "CPU", "memory_mb": 1024}],
        "instance": instance,
        **extra,
    }
    return api.client.post("/api/v1/hosts/register", json=body, headers=api.headers(token))


def test_a_second_live_agent_for_a_host_is_refused_unless_it_replaces(api: Api) -> None:
    token = api.token(Role.AGENT, host="host-a")
    first = _register(api, token, "first")
    assert first.status_code == 201
    assert _register(api, token, "first").status_code == 201  # the same process again
    r = _register(api, token, "second")
    assert r.status_code == 409
    detail = r.json()["detail"]
    assert "host host-a is held by another live agent (last heartbeat 0s ago)" in detail
    assert "--replace" in detail
    host = {"id": first.json()["id"], "_token": token}
    _heartbeat(api, host, instance="first")  # the holder goes on
    assert _register(api, token, "second", replace=True).status_code == 201
    r = api.client.post(
        f"/api/v1/hosts/{host['id']}/heartbeat",
        json={"workers": [], "instance": "first"},
        headers=api.headers(token),
    )
    assert r.status_code == 409
    assert "replaced" in r.json()["detail"]
    _heartbeat(api, host, instance="second")
    audit = api.client.get("/api/v1/audit", headers=api.headers()).json()["items"]
    assert any(a["action"] == "host.replace" for a in audit)
