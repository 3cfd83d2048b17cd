"""The `evenflow` CLI against a real uvicorn server: tables for people, JSON for scripts,
non-zero exits with the server's message."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from agent.client import ApiClient, make_http
from contract.agent import DeviceInfo, Heartbeat, HostRegister, WorkerReport
from contract.api import JobOut, TokenCreate
from contract.base import PROTOCOL_VERSION
from contract.enums import DeviceKind, Role, WorkerState
from evenflow.cli import main
from tests.conftest import LiveServer


@pytest.fixture
def env(live_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> LiveServer:
    monkeypatch.setenv("EVENFLOW_SERVER", live_server.url)
    monkeypatch.setenv("EVENFLOW_TOKEN", live_server.admin_token)
    return live_server


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> object:
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_submit_list_show_cancel(
    env: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client = ApiClient(make_http(env.url, env.admin_token))
    client.register_host(
        HostRegister(
            protocol_version=PROTOCOL_VERSION,
            name="cli-host",
            address="127.0.0.1",
            devices=[
                DeviceInfo(index=i, kind=DeviceKind.CPU, model="CPU", memory_mb=1) for i in range(2)
            ],
        )
    )
    spec = tmp_path / "job.yaml"
    spec.write_text(
        "name: cli-job\nworkload: {builtin: mlp}\nglobal_batch: 64\niterations: 10\nworkers: 2\n"
    )
    job = _json(capsys, "jobs", "submit", str(spec))
    # The submission answers before placement; the server's controller places it next.
    assert isinstance(job, dict) and job["status"] == "pending"
    _placed(client, job["id"])
    listed = _json(capsys, "jobs", "list")
    assert isinstance(listed, dict) and [j["id"] for j in listed["items"]] == [job["id"]]
    assert main(["jobs", "show", str(job["id"])]) == 0
    out = capsys.readouterr().out
    assert "cli-job" in out and "plan v1" in out and "[32, 32]" in out
    assert "waits" not in out
    # A second job waits for the first one's devices, and says so.
    second = _json(capsys, "jobs", "submit", str(spec))
    assert isinstance(second, dict)
    reason = f"needs 2 devices, 0 free, 2 busy with job {job['id']}"
    assert _placed(client, second["id"]).pending_reason == reason
    assert main(["jobs", "show", str(second["id"])]) == 0
    assert f"job {second['id']} waits: {reason}" in capsys.readouterr().out
    assert main(["jobs", "list"]) == 0
    assert f"job {second['id']} waits: {reason}" in capsys.readouterr().out
    client.cancel(second["id"])
    assert main(["hosts", "list"]) == 0
    assert "cli-host" in capsys.readouterr().out
    cancelled = _json(capsys, "jobs", "cancel", str(job["id"]))
    assert isinstance(cancelled, dict) and cancelled["status"] == "cancelled"
    assert main(["jobs", "cancel", str(job["id"])]) == 1
    assert "409" in capsys.readouterr().err


def _placed(client: ApiClient, job_id: int) -> JobOut:
    """The job once the server's controller has tried to place it."""
    deadline = time.monotonic() + 30
    while True:
        job = client.job(job_id)
        if job.status.value != "pending" or "controller" not in (job.pending_reason or ""):
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.05)


def test_tokens_create_and_revoke(
    env: LiveServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    created = _json(capsys, "tokens", "create", "--role", "viewer", "--name", "dash")
    assert isinstance(created, dict) and created["token"].startswith("ef_")
    monkeypatch.setenv("EVENFLOW_TOKEN", created["token"])
    assert main(["jobs", "list"]) == 0
    assert main(["tokens", "create", "--role", "admin"]) == 1
    assert "admin role" in capsys.readouterr().err
    monkeypatch.setenv("EVENFLOW_TOKEN", env.admin_token)
    assert main(["tokens", "revoke", str(created["id"])]) == 0
    monkeypatch.setenv("EVENFLOW_TOKEN", created["token"])
    assert main(["jobs", "list"]) == 1
    assert "revoked" in capsys.readouterr().err


def test_bad_spec_file_and_unreachable_server(
    env: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text(
        "name: x\nworkload: {builtin: mlp}\nglobal_batch: -3\niterations: 1\nworkers: 1\n"
    )
    with pytest.raises(SystemExit) as exc:
        main(["jobs", "submit", str(spec)])
    assert "global_batch" in str(exc.value)
    assert main(["jobs", "list", "--server", "http://127.0.0.1:9"]) == 1
    assert "cannot reach" in capsys.readouterr().err


def test_jobs_logs_prints_each_ranks_tail(
    env: LiveServer, capsys: pytest.CaptureFixture[str]
) -> None:
    agent_token = (
        ApiClient(make_http(env.url, env.admin_token))
        .create_token(TokenCreate(name="agent-logs-host", role=Role.AGENT, host="logs-host"))
        .token
    )
    agent = ApiClient(make_http(env.url, agent_token))
    host = agent.register_host(
        HostRegister(
            protocol_version=PROTOCOL_VERSION,
            name="logs-host",
            address="127.0.0.1",
            devices=[
                DeviceInfo(index=i, kind=DeviceKind.CPU, model="CPU", memory_mb=1) for i in range(2)
            ],
        )
    )
    admin = ApiClient(make_http(env.url, env.admin_token))
    job = admin.submit(
        {
            "name": "dies",
            "workload": {"builtin": "mlp"},
            "global_batch": 8,
            "iterations": 5,
            "workers": 2,
        }
    )
    assert _placed(admin, job.id).status.value == "starting"
    assert main(["jobs", "logs", str(job.id)]) == 0
    assert "no rank has ended yet" in capsys.readouterr().out
    reports = [
        WorkerReport(
            job_id=job.id,
            rank=1,
            state=WorkerState.FAILED,
            exit_code=1,
            error="RuntimeError: boom",
            log_tail="step 3\nRuntimeError: boom\n",
        ),
        WorkerReport(
            job_id=job.id, rank=0, state=WorkerState.STOPPED, exit_code=-15, log_tail="step 3\n"
        ),
    ]
    agent.heartbeat(host.id, Heartbeat(workers=reports))
    assert main(["jobs", "logs", str(job.id), "--follow"]) == 0  # the job ended: returns
    out = capsys.readouterr().out
    assert "rank 0 (stopped, exit -15)" in out and "rank 1 (failed, exit 1)" in out
    assert "RuntimeError: boom" in out
    assert main(["jobs", "logs", str(job.id), "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "rank 1" in out and "rank 0" not in out
    assert main(["jobs", "logs", str(job.id), "--rank", "9"]) == 1
    assert "no rank 9" in capsys.readouterr().err
