"""No orphan workers, with real processes: workers die with a ``kill -9``-ed agent, and a
restarted agent stops what an earlier one left behind (never a pid reused since)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.client import ApiClient, make_http
from agent.daemon import Agent, discover_devices
from agent.launcher import LaunchSpec, ProcessExit, SubprocessLauncher, process_start_time
from contract.agent import WORKER_ORPHAN_EXIT_S
from contract.api import TokenCreate
from contract.enums import Role
from tests.harness import ROOT, Api, LiveServer

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(SLEEPER, start_new_session=True)


def _gone(pid: int, start_time: int | None) -> bool:
    """The process is no more (a zombie waiting for init counts as gone), or the pid is now
    another process's."""
    return process_start_time(pid) != start_time


def _wait_for(pred: object, timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():  # type: ignore[operator]
            return True
        time.sleep(step)
    return False


@pytest.fixture
def reaped() -> Iterator[list[int]]:
    """Pids to SIGKILL after the test if still alive (a failing test leaves no orphans)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _write_state(state_dir: Path, pid: int, start_time: int | None) -> Path:
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / f"worker-{pid}.json"
    path.write_text(json.dumps({"pid": pid, "start_time": start_time, "job_id": 7, "rank": 0}))
    return path


def test_launcher_reports_how_a_process_ended_and_forgets_it(tmp_path: Path) -> None:
    launcher = SubprocessLauncher(tmp_path / "state")
    spec = LaunchSpec(job_id=1, rank=0, command=SLEEPER, env={}, log_path=tmp_path / "log")
    pid = launcher.launch(spec)
    record = json.loads((tmp_path / "state" / f"worker-{pid}.json").read_text())
    assert record["pid"] == pid and record["start_time"] == process_start_time(pid)
    assert launcher.poll(pid) is None
    os.kill(pid, signal.SIGKILL)
    assert _wait_for(lambda: launcher.poll(pid) is not None, timeout=10)
    assert launcher.poll(pid) == ProcessExit(code=-9, signal=signal.SIGKILL)
    assert list((tmp_path / "state").iterdir()) == []
    quick = launcher.launch(
        LaunchSpec(1, 1, [sys.executable, "-c", "raise SystemExit(5)"], {}, tmp_path / "log")
    )
    assert _wait_for(lambda: launcher.poll(quick) is not None, timeout=30)
    assert launcher.poll(quick) == ProcessExit(code=5)
    slow = launcher.launch(LaunchSpec(1, 2, SLEEPER, {}, tmp_path / "log"))
    assert launcher.stop(slow, grace_s=5) == ProcessExit(code=-15, signal=signal.SIGTERM)


def test_a_restarted_agent_stops_leftovers_before_it_registers_but_never_a_reused_pid(
    api: Api, tmp_path: Path, reaped: list[int]
) -> None:
    leftover, unrelated = _sleeper(), _sleeper()
    reaped += [leftover.pid, unrelated.pid]
    state = tmp_path / "state" / "host-a"
    started = process_start_time(leftover.pid)
    _write_state(state, leftover.pid, started)
    # A file naming a pid the kernel has since given to an unrelated process: its start time
    # differs from the one recorded.
    other_started = process_start_time(unrelated.pid)
    assert other_started is not None
    _write_state(state, unrelated.pid, other_started - 1)
    token = api.token(Role.AGENT, host="host-a")
    agent = Agent(
        ApiClient(api.client, token),
        name="host-a",
        address="127.0.0.1",
        devices=discover_devices(cpu_workers=1),
        server_url="http://testserver",
        token=token,
        workdir=tmp_path,
    )
    agent.register()
    assert leftover.wait(timeout=10) == -signal.SIGKILL
    time.sleep(0.5)
    assert unrelated.poll() is None, "a pid reused by another process must not be killed"
    assert list(state.iterdir()) == []


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_workers_die_within_10_s_of_a_kill_9_of_their_agent(
    live_server: LiveServer, tmp_path: Path, reaped: list[int]
) -> None:
    admin = ApiClient(make_http(live_server.url, live_server.admin_token))
    token = admin.create_token(TokenCreate(name="a", role=Role.AGENT, host="orphan-host")).token
    workdir = tmp_path / "agent"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "EVENFLOW_TOKEN": token,
        "EVENFLOW_TELEMETRY_S": "0.2",
    }
    agent = subprocess.Popen(
        [
            *(sys.executable, "-m", "evenflow.cli", "agent", "--server", live_server.url),
            *("--name", "orphan-host", "--address", "127.0.0.1", "--cpu-workers", "2"),
            *("--heartbeat", "0.3", "--workdir", str(workdir)),
        ],
        env=env,
        start_new_session=True,
    )
    reaped.append(agent.pid)
    try:
        assert _wait_for(lambda: any(h.name == "orphan-host" for h in admin.hosts().items), 30)
        job = admin.submit(
            {
                "name": "long",
                "workload": {"builtin": "mlp"},
                "global_batch": 32,
                "iterations": 1_000_000,
                "workers": 2,
            }
        )
        assert _wait_for(lambda: len(admin.telemetry(job.id, limit=10).items) > 0, 180, 0.5)
        records = [
            json.loads(p.read_text())
            for p in (workdir / "state" / "orphan-host").glob("worker-*.json")
        ]
        workers = {r["pid"]: r["start_time"] for r in records}
        reaped += list(workers)
        assert len(workers) == 2 and all(not _gone(p, t) for p, t in workers.items())
        agent.kill()
        assert agent.wait(timeout=10) == -signal.SIGKILL
        # The bound the control plane counts on (WORKER_ORPHAN_EXIT_S, 10 s) is the deadline.
        assert _wait_for(
            lambda: all(_gone(p, t) for p, t in workers.items()), WORKER_ORPHAN_EXIT_S
        ), "workers outlived their agent"
    finally:
        admin.http.close()
