"""The agent daemon against a real server, launching real torch.distributed worker processes."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent.client import ApiClient, make_http
from agent.daemon import Agent, _log_tail, discover_devices
from contract.agent import LOG_TAIL_CHARS, DeviceInfo, HostRegister
from contract.api import TokenCreate
from contract.base import PROTOCOL_VERSION
from contract.enums import DeviceKind, JobStatus, Role, WorkerState
from tests.harness import ROOT, LiveServer

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


@pytest.fixture
def agent(live_server: LiveServer, tmp_path: Path) -> Iterator[tuple[Agent, ApiClient]]:
    admin = ApiClient(make_http(live_server.url, live_server.admin_token))
    http = httpx.Client(base_url=live_server.url, timeout=10)
    a = Agent(
        ApiClient(http, live_server.admin_token),
        name="test-host",
        address="127.0.0.1",
        devices=discover_devices(cpu_workers=2),
        server_url=live_server.url,
        token=live_server.admin_token,
        workdir=tmp_path / "agent",
        extra_env={
            "PYTHONPATH": str(ROOT),
            "EVENFLOW_TELEMETRY_S": "0.2",
            "EVENFLOW_PLAN_POLL_S": "0.2",
        },
    )
    a.register()
    stop = threading.Event()
    thread = threading.Thread(target=a.run, args=(stop, 0.3), daemon=True)
    thread.start()
    yield a, admin
    stop.set()
    thread.join(timeout=30)
    http.close()
    admin.http.close()


def _wait(pred: Callable[[], Any], timeout: float = 150.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError("condition not reached in time")


def _spec(**kw: Any) -> dict[str, Any]:
    return {
        "name": "t",
        "workload": {"builtin": "mlp"},
        "global_batch": 32,
        "iterations": 120,
        "workers": 2,
        "policy": {"name": "minmax", "explore_iterations": 4, "rebalance_every": 8},
        "emulation": [
            {"per_sample_ms": 1.0, "intercept_ms": 2.0},
            {"per_sample_ms": 3.0, "intercept_ms": 2.0},
        ],
        **kw,
    }


def test_cpu_devices_are_offered_when_asked() -> None:
    devices = discover_devices(cpu_workers=3)
    assert [(d.kind, d.index) for d in devices] == [
        (DeviceKind.CPU, 0),
        (DeviceKind.CPU, 1),
        (DeviceKind.CPU, 2),
    ]


def test_job_runs_to_success_with_rebalanced_plans(agent: tuple[Agent, ApiClient]) -> None:
    _, admin = agent
    job = admin.submit(_spec())
    done = _wait(lambda: (j := admin.job(job.id)).status.terminal and j)
    assert done.status is JobStatus.SUCCEEDED, done.error
    rows = admin.telemetry(job.id).items
    assert sorted({(r.rank, r.iteration) for r in rows}) == [
        (r, i) for r in range(2) for i in range(120)
    ]
    for it in range(120):
        sizes = [r.batch_size for r in rows if r.iteration == it]
        assert sum(sizes) == 32, f"iteration {it}: {sizes}"
    plans = admin.plans(job.id).items
    assert len(plans) >= 2 and plans[0].source.value == "automatic"
    final = plans[0].batch_sizes
    assert final[0] > final[1], "the 3x faster rank gets more samples"
    # what each rank printed is on the server once it succeeded
    logs = admin.logs(job.id).items
    assert [log.rank for log in logs] == [0, 1]
    for log in logs:
        assert log.state is WorkerState.SUCCEEDED and log.log_tail is not None
        assert "finished:" in log.log_tail


def test_failed_rank_fails_the_job_with_its_traceback(agent: tuple[Agent, ApiClient]) -> None:
    """The rank fails again on its restart (the agent launches the new attempt's ranks although
    the same (job, rank) ran here before); out of restarts, the job fails with both reasons."""
    _, admin = agent
    job = admin.submit(
        _spec(
            workload={"entrypoint": "tests.agent.failing_workload:main"},
            emulation=None,
            max_restarts=1,
        )
    )
    done = _wait(lambda: (j := admin.job(job.id)).status.terminal and j)
    assert done.status is JobStatus.FAILED
    assert (done.attempt, done.restarts) == (1, 1)
    assert done.error is not None and done.error.startswith("failed after 1 restart(s)")
    assert done.error.count("rank 1 failed") == 2 and "corrupt" in done.error
    w1 = next(w for w in done.workers if w.rank == 1)
    assert w1.error is not None and "Traceback" in w1.error and "RuntimeError: boom" in w1.error
    # Its agent uploaded the last lines of its log with the failure.
    (log,) = admin.logs(job.id, rank=1).items
    assert log.state is WorkerState.FAILED and log.log_tail is not None
    assert "RuntimeError: boom" in log.log_tail


def test_a_followed_running_ranks_log_reaches_the_server_as_it_grows(
    agent: tuple[Agent, ApiClient],
) -> None:
    """Nothing of a running rank's log is uploaded until someone follows the job's logs; then
    its tail comes with the agent's heartbeats, and keeps growing, while the rank runs."""
    _, admin = agent
    job = admin.submit(
        _spec(workload={"entrypoint": "tests.agent.chatty_workload:main"}, emulation=None)
    )
    _wait(lambda: all(w.state is WorkerState.RUNNING for w in admin.logs(job.id).items))
    time.sleep(1.0)  # a few heartbeats while the ranks print, nobody following
    assert all(r.log_tail is None for r in admin.logs(job.id).items)

    def said(after: int) -> dict[int, int] | None:
        ranks = admin.follow_logs(job.id).items
        assert all(r.state is WorkerState.RUNNING for r in ranks)
        last = {r.rank: _last_said(r.log_tail) for r in ranks}
        return last if all(n is not None and n > after for n in last.values()) else None

    first = _wait(lambda: said(-1), timeout=30)
    later = _wait(lambda: said(max(first.values()) + 5), timeout=30)
    assert admin.job(job.id).status is JobStatus.RUNNING
    assert all(later[r] > first[r] for r in (0, 1))
    admin.cancel(job.id)
    _wait(lambda: admin.job(job.id).status.terminal)


def _last_said(tail: str | None) -> int | None:
    lines = [line for line in (tail or "").splitlines() if " says " in line]
    return int(lines[-1].rsplit(" ", 1)[1]) if lines else None


def test_a_log_tail_is_the_end_of_the_log_in_whole_lines(tmp_path: Path) -> None:
    log = tmp_path / "rank-0.log"
    log.write_text("".join(f"line {i}\n" for i in range(20_000)))
    tail = _log_tail(log)
    assert tail is not None and len(tail) <= LOG_TAIL_CHARS
    assert tail.startswith("line ") and tail.endswith("line 19999\n")
    short = tmp_path / "short.log"
    short.write_text("only\n")
    assert _log_tail(short) == "only\n"
    assert _log_tail(tmp_path / "missing.log") is None


def test_a_rank_killed_by_sigkill_fails_the_job_naming_the_signal(
    agent: tuple[Agent, ApiClient],
) -> None:
    a, admin = agent
    job = admin.submit(_spec(iterations=100_000, max_restarts=0))  # fails, not restarts
    _wait(lambda: len(admin.telemetry(job.id, limit=10).items) > 0)
    os.kill(a.procs[(job.id, 1, 0)].pid, signal.SIGKILL)  # as the kernel's OOM killer would
    done = _wait(lambda: (j := admin.job(job.id)).status.terminal and j, timeout=60)
    assert done.status is JobStatus.FAILED
    assert done.error == "rank 1 killed by SIGKILL"
    w1 = next(w for w in done.workers if w.rank == 1)
    assert w1.exit_code == -9 and w1.error is not None and w1.error.startswith("killed by SIGKILL")


def test_cancel_stops_the_workers(agent: tuple[Agent, ApiClient]) -> None:
    a, admin = agent
    job = admin.submit(_spec(iterations=100_000))
    _wait(lambda: len(admin.telemetry(job.id, limit=10).items) > 0)
    admin.cancel(job.id)
    _wait(lambda: all(w.state.value == "stopped" for w in admin.job(job.id).workers), timeout=60)
    assert all(p.state is WorkerState.STOPPED for p in a.procs.values())
    assert not list((a.workdir / "state" / a.name).iterdir())  # no process left to stop
    # The devices are free again for the next job.
    assert all(d.status.value == "free" for h in admin.hosts().items for d in h.devices)


def test_job_code_holds_only_its_own_rank_credential(
    live_server: LiveServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent runs with its own token (and an operator secret) in its environment; the job's
    code sees neither, and the credential it does get cannot touch another job."""
    admin = ApiClient(make_http(live_server.url, live_server.admin_token))
    agent_token = admin.create_token(
        TokenCreate(name="agent-iso", role=Role.AGENT, host="iso-host")
    ).token
    monkeypatch.setenv("EVENFLOW_TOKEN", agent_token)
    monkeypatch.setenv("EVENFLOW_ADMIN_TOKEN", live_server.admin_token)
    monkeypatch.setenv("SITE_S3_KEY", "site-secret-value-123")
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    http = httpx.Client(base_url=live_server.url, timeout=10)
    a = Agent(
        ApiClient(http, agent_token),
        name="iso-host",
        address="127.0.0.1",
        devices=discover_devices(cpu_workers=2),
        server_url=live_server.url,
        token=agent_token,
        workdir=tmp_path / "agent",
        extra_env={"EVENFLOW_TELEMETRY_S": "0.2"},
        secret_env=frozenset({"SITE_S3_KEY"}),
    )
    a.register()
    stop = threading.Event()
    thread = threading.Thread(target=a.run, args=(stop, 0.3), daemon=True)
    thread.start()
    # Another job, on a host no agent runs: placed there, it never starts.
    parking = admin.register_host(
        HostRegister(
            protocol_version=PROTOCOL_VERSION,
            name="parking",
            address="127.0.0.1",
            devices=[DeviceInfo(index=0, kind=DeviceKind.CPU, model="CPU", memory_mb=1)],
        )
    )
    victim = admin.submit(
        _spec(workers=None, devices=[parking.devices[0].id], emulation=None, name="victim")
    )
    try:
        job = admin.submit(
            _spec(
                iterations=20,
                emulation=None,
                workload={
                    "entrypoint": "tests.agent.env_workload:main",
                    "args": {"victim": victim.id},
                },
            )
        )
        done = _wait(lambda: (j := admin.job(job.id)).status.terminal and j)
        assert done.status is JobStatus.SUCCEEDED, done.error
        assert {r.rank for r in admin.telemetry(job.id).items} == {0, 1}  # its own credential works
    finally:
        stop.set()
        thread.join(timeout=30)
        http.close()
        victim_status = admin.job(victim.id).status
        admin.http.close()
    for rank in (0, 1):
        seen = json.loads(
            (tmp_path / "agent" / f"job-{job.id}" / f"rank-{rank}.environ.json").read_text()
        )
        env = seen["environ"]
        values = "\n".join(env.values())
        assert agent_token not in values and live_server.admin_token not in values
        assert "site-secret-value-123" not in values
        assert "EVENFLOW_ADMIN_TOKEN" not in env and "SITE_S3_KEY" not in env
        assert env["EVENFLOW_TOKEN"].startswith("efw_")
        assert env["NCCL_DEBUG"] == "WARN" and env["RANK"] == str(rank)
        assert seen["cancel"] == 403
    assert victim_status in (JobStatus.PENDING, JobStatus.STARTING)  # not cancelled by it
