"""Jobs: placement, the state machine, cancellation and worker reports."""

from __future__ import annotations

from typing import Any

from contract.agent import LOG_TAIL_CHARS
from contract.enums import Role
from server.context import context_of
from server.controller import Controller
from tests.harness import Api


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


def test_job_waits_pending_until_devices_are_free_and_priority_goes_first(api: Api) -> None:
    api.register("h", devices=2)
    blocker = api.submit(workers=2)
    assert blocker["status"] == "starting" and blocker["pending_reason"] is None
    low = api.submit(workers=2, priority=0)
    high = api.submit(workers=2, priority=10)
    assert low["status"] == high["status"] == "pending"
    assert low["pending_reason"] == f"needs 2 devices, 0 free, 2 busy with job {blocker['id']}"
    r = api.client.get(f"/api/v1/jobs/{low['id']}/plan", headers=api.headers())
    assert r.status_code == 404
    assert "waiting for devices" in r.json()["detail"]
    # Cancelling the blocker frees its devices: the next placement round starts the
    # higher-priority job, and the other now waits for it.
    api.client.post(f"/api/v1/jobs/{blocker['id']}/cancel", headers=api.headers())
    api.place()
    assert _job(api, high["id"])["status"] == "starting"
    assert _job(api, high["id"])["pending_reason"] is None
    waiting = _job(api, low["id"])
    assert waiting["status"] == "pending"
    assert waiting["pending_reason"] == f"needs 2 devices, 0 free, 2 busy with job {high['id']}"
    listed = api.client.get("/api/v1/jobs?status=pending", headers=api.headers()).json()
    assert [(j["id"], j["pending_reason"]) for j in listed["items"]] == [
        (low["id"], waiting["pending_reason"])
    ]
    # Cancelling the high-priority job frees its devices for the other.
    r = api.client.post(f"/api/v1/jobs/{high['id']}/cancel", headers=api.headers())
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    api.place()
    assert _job(api, low["id"])["status"] == "starting"
    again = api.client.post(f"/api/v1/jobs/{high['id']}/cancel", headers=api.headers())
    assert again.status_code == 409
    assert "already cancelled" in again.json()["detail"]


def test_a_job_that_could_never_be_placed_is_refused_naming_the_shortfall(api: Api) -> None:
    spec = {"name": "big", "workload": {"builtin": "mlp"}, "global_batch": 64, "iterations": 10}
    r = api.client.post("/api/v1/jobs", json={**spec, "workers": 1}, headers=api.headers())
    assert r.status_code == 422 and r.json()["field"] == "workers"
    assert "no host is registered" in r.json()["detail"]
    api.register("a", devices=2)
    api.register("b", devices=1)
    api.submit(workers=3)  # every device busy: a later job may wait for them, not be refused
    r = api.client.post("/api/v1/jobs", json={**spec, "workers": 4}, headers=api.headers())
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "workers"
    assert r.json()["detail"] == (
        "the job needs 4 devices of one kind but the registered hosts have at most 3 "
        "(cpu: 2 on a, 1 on b): 1 short, so it could never be placed"
    )
    api.register("g", devices=2, kind="cuda")  # 5 devices, but never 4 of one kind
    r = api.client.post("/api/v1/jobs", json={**spec, "workers": 4}, headers=api.headers())
    assert r.status_code == 422 and "cpu: 2 on a, 1 on b; cuda: 2 on g" in r.json()["detail"]
    assert api.client.get("/api/v1/jobs", headers=api.headers()).json()["total"] == 1
    waits = api.submit(workers=3)
    assert waits["status"] == "pending" and "3 busy with job 1" in str(waits["pending_reason"])


def test_submission_answers_before_placement_which_the_controller_does(api: Api) -> None:
    """POST /jobs only stores the job (placement may take seconds: the placement solver);
    the controller's next round places it."""
    api.register("h", devices=2)
    created = api.submit(workers=2, place=False)
    assert created["status"] == "pending" and created["workers"] == []
    assert created["pending_reason"] == "needs 2 devices, 2 free, waiting for the controller"
    assert _job(api, created["id"])["status"] == "pending"  # nothing placed it meanwhile
    context = context_of(api.client.app)  # type: ignore[arg-type]
    controller = Controller(context.settings, engine=context.engine, sessions=context.sessions)
    assert controller.place() == [created["id"]]
    job = _job(api, created["id"])
    assert job["status"] == "starting" and job["pending_reason"] is None
    assert len(job["workers"]) == 2


def test_a_submission_wakes_the_controller_once_committed(api: Api) -> None:
    api.register("h", devices=1)
    woken: list[int] = []
    context = context_of(api.client.app)  # type: ignore[arg-type]
    context.wake_controller = woken.append
    api.submit(workers=1, place=False)
    assert woken == [0]


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
    devices = api.client.get("/api/v1/hosts", headers=api.headers()).json()["items"][0]["devices"]
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


def test_each_ranks_root_cause_and_log_tail_are_served_per_rank(api: Api) -> None:
    host = api.register("h", devices=2)
    job = api.submit(workers=2, max_restarts=0)  # the failure ends the job (no restart)
    r = api.client.get(f"/api/v1/jobs/{job['id']}/logs", headers=api.headers())
    assert r.status_code == 200
    assert [(x["rank"], x["state"], x["log_tail"]) for x in r.json()["items"]] == [
        (0, "assigned", None),
        (1, "assigned", None),
    ]
    _report(api, host, job["id"], 0, "running")
    tb = "Traceback (most recent call last):\nRuntimeError: boom"
    tail = "step 41 loss 0.3\nstep 42 loss 0.3\n" + tb
    _report(api, host, job["id"], 1, "failed", exit_code=1, error=tb, log_tail=tail)
    _report(api, host, job["id"], 0, "stopped", exit_code=-15, log_tail="step 42 loss 0.3\n")
    viewer = api.token(Role.VIEWER)
    r = api.client.get(f"/api/v1/jobs/{job['id']}/logs", headers=api.headers(viewer))
    assert r.status_code == 200, r.text
    by_rank = {x["rank"]: x for x in r.json()["items"]}
    assert by_rank[1]["state"] == "failed" and by_rank[1]["exit_code"] == 1
    assert by_rank[1]["error"] == tb and by_rank[1]["log_tail"] == tail
    assert by_rank[0]["state"] == "stopped" and by_rank[0]["log_tail"] == "step 42 loss 0.3\n"
    one = api.client.get(f"/api/v1/jobs/{job['id']}/logs?rank=1", headers=api.headers())
    assert one.json() == {"items": [one.json()["items"][0]], "total": 1}
    assert one.json()["items"][0]["rank"] == 1
    missing = api.client.get(f"/api/v1/jobs/{job['id']}/logs?rank=7", headers=api.headers())
    assert missing.status_code == 404 and missing.json()["field"] == "rank"
    assert api.client.get("/api/v1/jobs/999/logs", headers=api.headers()).status_code == 404


def test_a_log_tail_over_the_bound_is_refused(api: Api) -> None:
    host = api.register("h", devices=1)
    job = api.submit(workers=1)
    r = _report(api, host, job["id"], 0, "failed", exit_code=1, log_tail="x" * (LOG_TAIL_CHARS + 1))
    assert r.status_code == 422 and "log_tail" in r.text
    assert _job(api, job["id"])["status"] == "starting"  # nothing stored from it


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
        ({**base, "environment": {"python": "python3"}}, "environment.python"),  # not a path
        ({**base, "engine": "zero3"}, "engine"),
        ({**base, "gradient_sync": "fast"}, "gradient_sync"),
        ({**base, "engine": "fsdp"}, ""),  # builtin mlp has no blocks to shard
        (
            {
                **base,
                "engine": "fsdp",
                "workload": {"entrypoint": "m:f"},
                "gradient_sync": "overlap",
            },
            "",
        ),
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
    api.register("h", devices=1)
    ids = [api.submit(workers=1)["id"] for _ in range(3)]
    page = api.client.get("/api/v1/jobs?limit=2", headers=api.headers()).json()
    assert page["total"] == 3
    assert [j["id"] for j in page["items"]] == ids[::-1][:2]
    assert api.client.get("/api/v1/jobs/424242", headers=api.headers()).status_code == 404


def test_workload_args_take_any_json_within_bounds(api: Api) -> None:
    api.register("h", devices=1)
    args = {"layers": [64, 128, 256], "optim": {"name": "adamw", "betas": [0.9, 0.95]}, "x": None}
    body = {
        "name": "j",
        "workload": {"entrypoint": "mytrain.main:train", "args": args},
        "global_batch": 8,
        "iterations": 1,
        "workers": 1,
    }
    r = api.client.post("/api/v1/jobs", json=body, headers=api.headers())
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["workload"]["args"] == args
    deep: object = 1
    for _ in range(9):
        deep = [deep]
    too_deep = {**body, "workload": {"entrypoint": "a:b", "args": {"grid": deep}}}
    r = api.client.post("/api/v1/jobs", json=too_deep, headers=api.headers())
    assert r.status_code == 422
    assert r.json()["field"].startswith("workload.args")
    assert "args.grid nests 9 levels deep; at most 8" in r.json()["detail"]
    assert "\n" not in r.json()["detail"]
    big = {**body, "workload": {"entrypoint": "a:b", "args": {"ok": 1, "table": ["x" * 100] * 200}}}
    r = api.client.post("/api/v1/jobs", json=big, headers=api.headers())
    assert r.status_code == 422
    assert "at most 16384; the largest is args.table" in r.json()["detail"]
    assert api.client.get("/api/v1/jobs", headers=api.headers()).json()["total"] == 1
