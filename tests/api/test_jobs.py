"""Jobs: placement, the state machine, cancellation and worker reports."""

from __future__ import annotations

from typing import Any

from tests.conftest import Api


def _job(api: Api, job_id: object) -> dict[str, Any]:
    r = api.client.get(f"/api/v1/jobs/{job_id}", headers=api.headers())
    assert r.status_code == 200
    data: dict[str, Any] = r.json()
    return data


def _report(
    api: Api, host: dict[str, Any], job_id: object, rank: int, state: str, **kw: object
) -> Any:
    body = {"workers": [{"job_id": job_id, "rank": rank, "state": state, **kw}]}
    return api.client.post(
        f"/api/v1/hosts/{host['id']}/heartbeat", json=body, headers=api.headers(host["_token"])
    )


def test_job_is_placed_with_an_initial_plan_summing_to_b(api: Api) -> None:
    api.register("h", devices=3)
    job = api.submit(workers=3, global_batch=100)
    assert job["status"] == "starting"
    assert [w["rank"] for w in job["workers"]] == [0, 1, 2]  # type: ignore[union-attr]
    plan = api.client.get(f"/api/v1/jobs/{job['id']}/plan", headers=api.headers()).json()
    assert plan["version"] == 1 and plan["source"] == "initial"
    assert plan["batch_sizes"] == [34, 33, 33]
    assert sum(plan["batch_sizes"]) == 100
    # 304 when the caller already has it.
    r = api.client.get(f"/api/v1/jobs/{job['id']}/plan?known_version=1", headers=api.headers())
    assert r.status_code == 304
    assert r.content == b""


def test_job_waits_pending_until_devices_appear_and_priority_goes_first(api: Api) -> None:
    low = api.submit(workers=2, priority=0)
    high = api.submit(workers=2, priority=10)
    assert low["status"] == high["status"] == "pending"
    r = api.client.get(f"/api/v1/jobs/{low['id']}/plan", headers=api.headers())
    assert r.status_code == 404
    assert "waiting for devices" in r.json()["detail"]
    api.register("h", devices=2)
    assert _job(api, high["id"])["status"] == "starting"
    assert _job(api, low["id"])["status"] == "pending"
    # Cancelling the high-priority job frees its devices for the other.
    r = api.client.post(f"/api/v1/jobs/{high['id']}/cancel", headers=api.headers())
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    assert _job(api, low["id"])["status"] == "starting"
    again = api.client.post(f"/api/v1/jobs/{high['id']}/cancel", headers=api.headers())
    assert again.status_code == 409
    assert "already cancelled" in again.json()["detail"]


def test_worker_reports_drive_the_job_to_success(api: Api) -> None:
    host = api.register("h", devices=2)
    job = api.submit(workers=2)
    _report(api, host, job["id"], 0, "running")
    assert _job(api, job["id"])["status"] == "starting"
    _report(api, host, job["id"], 1, "running")
    j = _job(api, job["id"])
    assert j["status"] == "running" and j["started_at"] is not None
    _report(api, host, job["id"], 0, "succeeded", exit_code=0)
    _report(api, host, job["id"], 1, "succeeded", exit_code=0)
    j = _job(api, job["id"])
    assert j["status"] == "succeeded" and j["finished_at"] is not None
    devices = api.client.get("/api/v1/hosts", headers=api.headers()).json()[0]["devices"]
    assert all(d["status"] == "free" and d["job_id"] is None for d in devices)


def test_a_failed_rank_fails_the_job_with_its_traceback(api: Api) -> None:
    host = api.register("h", devices=2)
    job = api.submit(workers=2, max_restarts=0)  # restarts: tests/api/test_restarts.py
    _report(api, host, job["id"], 0, "running")
    tb = "Traceback (most recent call last):\n  File x\nRuntimeError: CUDA out of memory"
    _report(api, host, job["id"], 1, "failed", exit_code=1, error=tb)
    j = _job(api, job["id"])
    assert j["status"] == "failed"
    assert "rank 1 failed" in j["error"] and "out of memory" in j["error"]
    assert j["workers"][1]["error"] == tb
    # The agent is told to stop the surviving rank.
    ack = api.client.post(
        f"/api/v1/hosts/{host['id']}/heartbeat", json={}, headers=api.headers(host["_token"])
    ).json()
    assert [(a["rank"], a["desired"]) for a in ack["assignments"]] == [(0, "stop")]


def test_bad_specs_are_422_naming_the_field(api: Api) -> None:
    base = {
        "name": "j",
        "workload": {"builtin": "mlp"},
        "global_batch": 8,
        "iterations": 1,
        "workers": 1,
    }
    cases = [
        ({**base, "global_batch": "8"}, "global_batch"),
        ({**base, "global_batch": 0}, "global_batch"),
        ({**base, "surprise": 1}, "surprise"),
        ({**base, "workload": {"builtin": "mlp", "entrypoint": "a:b"}}, "workload"),
        ({**base, "epochs": 2}, ""),
        ({**base, "workers": 2, "emulation": [{"per_sample_ms": 1.0}]}, ""),
        ({**base, "devices": [99], "workers": None}, "devices"),
    ]
    for body, field in cases:
        body = {k: v for k, v in body.items() if v is not None}
        r = api.client.post("/api/v1/jobs", json=body, headers=api.headers())
        assert r.status_code == 422, body
        assert r.json()["detail"]
        assert (r.json().get("field") or "").startswith(field), (body, r.json())
    assert api.client.get("/api/v1/jobs", headers=api.headers()).json()["total"] == 0


def test_422_speaks_words_for_patterns_keys_and_checks(api: Api) -> None:
    body = {
        "name": "my job!",
        "workload": {"builtin": "mlp"},
        "global_batch": 8,
        "iterations": 1,
        "workers": 1,
        "surprise": 1,
    }
    r = api.client.post("/api/v1/jobs", json=body, headers=api.headers())
    assert r.status_code == 422
    detail = r.json()["detail"]
    assert "name: must start with a letter or digit" in detail
    assert "surprise: unknown key" in detail
    assert "^[" not in detail  # no raw regular expression
    body = {**body, "name": "j", "epochs": 2}
    del body["surprise"]
    r = api.client.post("/api/v1/jobs", json=body, headers=api.headers())
    assert r.json()["detail"].endswith(": give exactly one of iterations or epochs")


def test_list_is_newest_first_with_total(api: Api) -> None:
    ids = [api.submit(workers=1)["id"] for _ in range(3)]
    page = api.client.get("/api/v1/jobs?limit=2", headers=api.headers()).json()
    assert page["total"] == 3
    assert [j["id"] for j in page["items"]] == ids[::-1][:2]
    assert api.client.get("/api/v1/jobs/424242", headers=api.headers()).status_code == 404
