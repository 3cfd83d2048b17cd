"""A failed rank or a lost host restarts the job as a new attempt (fresh credentials, ranks,
plan and port; on fewer devices when the spec allows) until ``max_restarts``; then it fails with
every reason. Checkpoints are reported by a rank's own credential and listed."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

from contract.agent import WORKER_EXIT_AGENT_GONE, WORKER_EXIT_FATAL, WorkerReport
from contract.enums import Role, WorkerState
from server.context import context_of
from server.models import Job
from server.services import control_loop, hosts, rank_reports
from server.services.rebalancer import Tracker
from tests.harness import Api

CHECKPOINT = {"every_iterations": 10, "path": "/tmp/evenflow-ckpt-test"}


def _heartbeat(api: Api, host: dict[str, Any], *reports: dict[str, Any]) -> dict[str, Any]:
    r = api.client.post(
        f"/api/v1/hosts/{host['id']}/heartbeat",
        json={"workers": list(reports)},
        headers=api.headers(str(host["_token"])),
    )
    assert r.status_code == 200, r.text
    api.place()  # the controller's next placement round
    data: dict[str, Any] = r.json()
    return data


def _assignments(api: Api, host: dict[str, Any], job_id: object) -> list[dict[str, Any]]:
    return [a for a in _heartbeat(api, host)["assignments"] if a["job_id"] == job_id]


def _failed(job_id: object, rank: int, attempt: int = 0, **kw: Any) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "rank": rank,
        "state": "failed",
        "exit_code": kw.pop("exit_code", 1),
        "error": kw.pop("error", "Traceback...\nRuntimeError: Connection reset by peer"),
        "attempt": attempt,
    }


def _telemetry(api: Api, job_id: object, token: str, rank: int, iterations: range) -> None:
    records = [
        {
            "rank": rank,
            "iteration": i,
            "plan_version": 1,
            "batch_size": 32,
            "data_ms": 1.0,
            "compute_ms": 2.0,
            "sync_ms": 0.5,
            "ts": 1.0,
        }
        for i in iterations
    ]
    r = api.client.post(
        f"/api/v1/jobs/{job_id}/telemetry", json={"records": records}, headers=api.headers(token)
    )
    assert r.status_code == 200, r.text


def _checkpoint(api: Api, job_id: object, token: str, rank: int, iteration: int) -> Any:
    return api.client.post(
        f"/api/v1/jobs/{job_id}/checkpoints",
        json={
            "rank": rank,
            "iteration": iteration,
            "size_bytes": 1234,
            "url": f"/tmp/ck/job-{job_id}/ckpt-{iteration:012d}.pt",
            "write_ms": 2.5,
        },
        headers=api.headers(token),
    )


def test_a_failed_rank_restarts_the_job_from_its_last_checkpoint(api: Api) -> None:
    host = api.register("host-a", devices=2)
    job = api.submit(workers=2, checkpoint=CHECKPOINT)
    first = _assignments(api, host, job["id"])
    assert [a["attempt"] for a in first] == [0, 0]
    tokens = {a["rank"]: a["worker_token"] for a in first}
    _telemetry(api, job["id"], tokens[0], 0, range(25))
    _telemetry(api, job["id"], tokens[1], 1, range(24))
    assert _checkpoint(api, job["id"], tokens[0], 0, 10).status_code == 201
    assert _checkpoint(api, job["id"], tokens[0], 0, 20).status_code == 201

    _heartbeat(api, host, _failed(job["id"], 1))
    out = api.client.get(f"/api/v1/jobs/{job['id']}", headers=api.headers()).json()
    assert out["status"] == "starting"  # placed again at once: the devices are free
    assert (out["attempt"], out["restarts"]) == (1, 1)
    (restart,) = out["restart_history"]
    assert restart["reason"] == "rank 1 failed: RuntimeError: Connection reset by peer"
    assert (restart["attempt"], restart["resumed_from"], restart["iterations_lost"]) == (1, 20, 5)
    assert out["plan_version"] == 2  # a new initial plan for the devices it now has
    assert [w["state"] for w in out["workers"]] == ["assigned", "assigned"]

    second = _assignments(api, host, job["id"])
    assert [a["attempt"] for a in second] == [1, 1]
    assert all(a["worker_token"] not in tokens.values() for a in second)  # fresh credentials
    r = api.client.get(f"/api/v1/jobs/{job['id']}/plan", headers=api.headers(tokens[0]))
    assert r.status_code == 401  # the old attempt's credential died with it

    # the old attempt's other rank fails too (its peer vanished): that is not a second restart
    _heartbeat(api, host, _failed(job["id"], 0, attempt=0))
    again = api.client.get(f"/api/v1/jobs/{job['id']}", headers=api.headers()).json()
    assert (again["attempt"], again["status"]) == (1, "starting")


def test_a_rank_killed_by_a_signal_says_so() -> None:
    report = WorkerReport(
        job_id=1, rank=2, state=WorkerState.FAILED, exit_code=-9, error="INFO plan v3 in force"
    )
    assert rank_reports.failure_reason(report) == "rank 2 killed by SIGKILL"
    signalled = report.model_copy(update={"exit_code": None, "signal": "SIGTERM"})
    assert rank_reports.failure_reason(signalled) == "rank 2 killed by SIGTERM"
    report = report.model_copy(update={"exit_code": 1, "error": "Traceback\nValueError: x"})
    assert rank_reports.failure_reason(report) == "rank 2 failed: ValueError: x"
    said = "host h1's agent restarted (it died while rank 2 of job 1 ran)"
    gone = report.model_copy(update={"exit_code": WORKER_EXIT_AGENT_GONE, "error": said})
    assert rank_reports.failure_reason(gone) == said
    unsaid = gone.model_copy(update={"error": None})
    assert rank_reports.failure_reason(unsaid) == "rank 2's agent died while it ran"


def test_an_old_attempts_live_rank_keeps_its_device_until_reported_gone(api: Api) -> None:
    """A restart never shows a device free while a rank of the old attempt may still run on
    it: rank 0 on host-a keeps its device until host-a's agent no longer reports it running."""
    a = api.register("host-a", devices=1)
    b = api.register("host-b", devices=1)
    job = api.submit(workers=2)
    _assignments(api, a, job["id"])
    _assignments(api, b, job["id"])
    running = {"job_id": job["id"], "rank": 0, "state": "running", "attempt": 0}
    _heartbeat(api, a, running)
    _heartbeat(api, b, _failed(job["id"], 1))  # rank 1 on host-b fails: restart

    def devices() -> dict[str, tuple[str, object]]:
        listed = api.client.get("/api/v1/hosts", headers=api.headers()).json()["items"]
        return {h["name"]: (h["devices"][0]["status"], h["devices"][0]["job_id"]) for h in listed}

    out = api.client.get(f"/api/v1/jobs/{job['id']}", headers=api.headers()).json()
    assert (out["attempt"], out["status"]) == (1, "pending")  # one device is still held
    assert devices() == {"host-a": ("busy", job["id"]), "host-b": ("free", None)}
    ack = _heartbeat(api, a, running)  # still running: still held
    assert devices()["host-a"] == ("busy", job["id"])
    assert not [x for x in ack["assignments"] if x["job_id"] == job["id"]]  # so the agent stops it
    _heartbeat(api, a, {**running, "state": "stopped"})  # gone: the new attempt is placed
    out = api.client.get(f"/api/v1/jobs/{job['id']}", headers=api.headers()).json()
    assert (out["attempt"], out["status"]) == (1, "starting")
    assert [x["attempt"] for x in _assignments(api, a, job["id"])] == [1]


def test_after_max_restarts_the_job_fails_with_every_reason(api: Api) -> None:
    host = api.register("host-a", devices=2)
    job = api.submit(workers=2, max_restarts=2)
    for attempt in range(3):
        _assignments(api, host, job["id"])
        _heartbeat(api, host, _failed(job["id"], attempt % 2, attempt, error=f"boom {attempt}"))
    out = api.client.get(f"/api/v1/jobs/{job['id']}", headers=api.headers()).json()
    assert out["status"] == "failed"
    assert out["restarts"] == 2
    assert out["error"] == (
        "failed after 2 restart(s): attempt 0: rank 0 failed: boom 0 (no checkpoint: from "
        "iteration 0); attempt 1: rank 1 failed: boom 1 (no checkpoint: from iteration 0); "
        "attempt 2: rank 0 failed: boom 2"
    )
    assert all(h["resumed_from"] is None for h in out["restart_history"])
    devices = api.client.get("/api/v1/hosts", headers=api.headers()).json()["items"][0]["devices"]
    # rank 1 of the last attempt was handed out and not yet reported ended: may still run
    assert sorted(d["status"] for d in devices) == ["busy", "free"]
    stopped = {"job_id": job["id"], "rank": 1, "state": "stopped", "attempt": 2}
    _heartbeat(api, host, stopped)
    devices = api.client.get("/api/v1/hosts", headers=api.headers()).json()["items"][0]["devices"]
    assert {d["status"] for d in devices} == {"free"}


def test_no_restarts_allowed_or_a_fatal_exit_fails_at_once(api: Api) -> None:
    host = api.register("host-a", devices=4)
    none_allowed = api.submit(workers=2, max_restarts=0)
    fatal = api.submit(workers=2, checkpoint=CHECKPOINT)
    _assignments(api, host, fatal["id"])
    error = "checkpoint.path '/x/job-2' cannot be written: PermissionError: denied"
    _heartbeat(
        api,
        host,
        _failed(none_allowed["id"], 0),
        _failed(fatal["id"], 0, exit_code=WORKER_EXIT_FATAL, error=error),
    )
    for job, reason in ((none_allowed, "Connection reset by peer"), (fatal, "cannot be written")):
        out = api.client.get(f"/api/v1/jobs/{job['id']}", headers=api.headers()).json()
        assert (out["status"], out["restarts"]) == ("failed", 0)
        assert reason in out["error"]


def test_a_lost_host_restarts_the_job_on_fewer_devices_when_the_spec_allows(api: Api) -> None:
    a = api.register("host-a", devices=1)
    api.register("host-b", devices=1)
    job = api.submit(workers=1, max_workers=2, global_batch=64)
    assert (
        len(api.client.get(f"/api/v1/jobs/{job['id']}", headers=api.headers()).json()["workers"])
        == 2
    )
    context = context_of(api.client.app)  # type: ignore[arg-type]
    later = datetime.now(UTC) + timedelta(seconds=120)
    _heartbeat(api, a)  # host-a stays alive; host-b falls silent
    with context.sessions() as session, session.begin():
        for h in hosts.list_hosts(session)[0]:
            if h.name == "host-a":
                h.last_heartbeat = later
        lost = hosts.mark_lost(session, later, after_s=60).lost
    assert [h.name for h in lost] == ["host-b"]
    out = api.client.get(f"/api/v1/jobs/{job['id']}", headers=api.headers()).json()
    assert out["status"] == "pending" and out["attempt"] == 1  # rank 0 may still run on host-a
    _heartbeat(api, a)  # host-a's agent runs nothing of the old attempt (any more)
    out = api.client.get(f"/api/v1/jobs/{job['id']}", headers=api.headers()).json()
    assert out["status"] == "starting" and out["attempt"] == 1
    assert re.match(
        rf"host 'host-b' was lost \(no heartbeat from its agent for 1[12]\d s while rank \d "
        rf"of job {job['id']} ran there\)",
        out["restart_history"][0]["reason"],
    ), out["restart_history"][0]["reason"]
    assert [w["host_id"] for w in out["workers"]] == [a["id"]]  # one rank, where it can run
    plan = api.client.get(f"/api/v1/jobs/{job['id']}/plan", headers=api.headers()).json()
    assert plan["batch_sizes"] == [64]  # the global batch never changes
    (assignment,) = _assignments(api, a, job["id"])
    assert (assignment["world_size"], assignment["attempt"]) == (1, 1)


def test_checkpoints_are_reported_by_the_rank_and_listed(api: Api) -> None:
    host = api.register("host-a", devices=2)
    job = api.submit(workers=2, checkpoint=CHECKPOINT)
    tokens = {a["rank"]: a["worker_token"] for a in _assignments(api, host, job["id"])}
    assert _checkpoint(api, job["id"], tokens[0], 0, 10).status_code == 201
    assert _checkpoint(api, job["id"], str(host["_token"]), 0, 20).status_code == 201
    r = _checkpoint(api, job["id"], tokens[0], 1, 30)  # another rank's
    assert r.status_code == 403 and "may report checkpoints for rank 0 only" in r.json()["detail"]
    viewer = api.token(Role.VIEWER)
    r = _checkpoint(api, job["id"], viewer, 0, 30)
    assert r.status_code == 403
    r = api.client.post(
        f"/api/v1/jobs/{job['id']}/checkpoints",
        json={"rank": 0, "iteration": 0, "size_bytes": -1, "url": ""},
        headers=api.headers(tokens[0]),
    )
    assert r.status_code == 422 and "iteration" in r.text
    r = api.client.get(f"/api/v1/jobs/{job['id']}/checkpoints", headers=api.headers(viewer))
    assert r.status_code == 200
    listed = r.json()["items"]
    assert [(c["iteration"], c["rank"], c["attempt"], c["size_bytes"]) for c in listed] == [
        (20, 0, 0, 1234),
        (10, 0, 0, 1234),
    ]
    r = api.client.get("/api/v1/jobs/999/checkpoints", headers=api.headers())
    assert r.status_code == 404


def test_bad_checkpoint_and_restart_specs_are_refused(api: Api) -> None:
    for extra, field in (
        ({"checkpoint": {"every_iterations": 0}}, "every_iterations"),
        ({"checkpoint": {"every_iterations": 5, "keep": 0}}, "keep"),
        ({"checkpoint": {"every_iterations": 5, "path": ""}}, "path"),
        ({"max_restarts": -1}, "max_restarts"),
    ):
        spec = {
            "name": "j",
            "workload": {"builtin": "mlp"},
            "global_batch": 8,
            "iterations": 5,
            "workers": 1,
            **extra,
        }
        r = api.client.post("/api/v1/jobs", json=spec, headers=api.headers())
        assert r.status_code == 422, r.text
        assert field in r.text


def test_the_control_loop_forgets_what_it_learnt_about_an_earlier_attempt() -> None:
    """A restarted job may run on other devices or another number of them: its fitted models,
    straggler baselines and cadence start afresh; another job's are kept."""
    state = control_loop.LoopState()
    first, other = Job(id=1, attempt=0), Job(id=2, attempt=0)
    for job in (first, other):
        state.follow(job)
        state.trackers[job.id] = Tracker(world=99)
        state.decided_at[job.id] = 1.0
    state.follow(first)  # the same attempt: nothing forgotten
    assert state.trackers[1].world == 99
    state.follow(Job(id=1, attempt=1))
    assert 1 not in state.trackers and 1 not in state.decided_at
    assert state.attempts == {1: 1, 2: 0} and state.trackers[2].world == 99
