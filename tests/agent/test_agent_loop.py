"""The agent's loop without processes: ``Agent.tick`` against the real app in-process, with a
scripted launcher whose processes end when the test says so (as torch's elastic agent is
tested with scripted monitor results)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from agent.client import ApiClient
from agent.daemon import Agent, WorkerProcess, discover_devices
from agent.launcher import LaunchSpec, ProcessExit
from contract.agent import WORKER_EXIT_JOB_ENDED
from contract.enums import Role, WorkerState
from tests.harness import Api


class ScriptedLauncher:
    """Processes that run until the test ends them (``end``); records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.specs: dict[int, LaunchSpec] = {}
        self.ends: dict[int, ProcessExit] = {}

    def launch(self, spec: LaunchSpec) -> int:
        pid = 1000 + len(self.specs)
        self.specs[pid] = spec
        self.calls.append(("launch", spec.job_id, spec.rank))
        return pid

    def poll(self, pid: int) -> ProcessExit | None:
        return self.ends.get(pid)

    def stop(self, pid: int, grace_s: float) -> ProcessExit:
        spec = self.specs[pid]
        self.calls.append(("stop", spec.job_id, spec.rank))
        return self.ends.setdefault(pid, ProcessExit(code=-15, signal=signal.SIGTERM))

    def stop_leftovers(self) -> list[int]:
        self.calls.append(("stop_leftovers",))
        return []

    def pid(self, job_id: int, rank: int) -> int:
        return next(p for p, s in self.specs.items() if (s.job_id, s.rank) == (job_id, rank))

    def end(self, job_id: int, rank: int, end: ProcessExit) -> None:
        self.ends[self.pid(job_id, rank)] = end

    def stopped(self) -> list[tuple[int, int]]:
        return [(c[1], c[2]) for c in self.calls if c[0] == "stop"]


@pytest.fixture
def host(api: Api, tmp_path: Path) -> tuple[Agent, ScriptedLauncher]:
    token = api.token(Role.AGENT, host="host-a")
    launcher = ScriptedLauncher()
    agent = Agent(
        ApiClient(api.client, token),
        name="host-a",
        address="127.0.0.1",
        devices=discover_devices(cpu_workers=2),
        server_url="http://testserver",
        token=token,
        workdir=tmp_path,
        launcher=launcher,
    )
    agent.register()
    return agent, launcher


def _job(api: Api, job_id: object) -> dict[str, Any]:
    r = api.client.get(f"/api/v1/jobs/{job_id}", headers=api.headers())
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


def _devices(api: Api) -> list[tuple[str, int | None]]:
    hosts = api.client.get("/api/v1/hosts", headers=api.headers()).json()["items"]
    return [(d["status"], d["job_id"]) for h in hosts for d in h["devices"]]


def _running(api: Api, agent: Agent, launcher: ScriptedLauncher) -> int:
    # no restarts: these tests are about what one attempt's failure does (tests/api/test_restarts)
    job_id = int(api.submit(workers=2, max_restarts=0)["id"])  # type: ignore[call-overload]
    agent.tick()  # launches both ranks
    agent.tick()  # reports them running
    assert launcher.calls[-2:] == [("launch", job_id, 0), ("launch", job_id, 1)]
    assert _job(api, job_id)["status"] == "running"
    return job_id


def test_assigned_ranks_are_launched_after_leftovers_are_stopped(
    api: Api, host: tuple[Agent, ScriptedLauncher]
) -> None:
    agent, launcher = host
    job_id = _running(api, agent, launcher)
    assert launcher.calls == [("stop_leftovers",), ("launch", job_id, 0), ("launch", job_id, 1)]
    for rank in (0, 1):
        spec = launcher.specs[launcher.pid(job_id, rank)]
        assert spec.env["RANK"] == str(rank) and spec.env["WORLD_SIZE"] == "2"
        assert spec.env["EVENFLOW_TOKEN"].startswith("efw_")  # its own credential
        assert spec.env["EVENFLOW_AGENT_PID"].isdigit()
        assert list(spec.command[1:]) == ["-m", "agent.runtime.worker"]
    agent.tick()
    assert len(launcher.specs) == 2  # launched once only


def test_a_failed_rank_stops_its_siblings_and_fails_the_job_with_its_root_cause(
    api: Api, host: tuple[Agent, ScriptedLauncher]
) -> None:
    agent, launcher = host
    job_id = _running(api, agent, launcher)
    error_file = Path(launcher.specs[launcher.pid(job_id, 1)].env["EVENFLOW_ERROR_FILE"])
    error_file.write_text("Traceback (most recent call last):\n  ...\nRuntimeError: boom\n")
    launcher.end(job_id, 1, ProcessExit(code=1))
    agent.tick()
    assert launcher.stopped() == [(job_id, 0)]  # at once: the answer says the job failed
    job = _job(api, job_id)
    assert job["status"] == "failed" and job["error"] == "rank 1 failed: RuntimeError: boom"
    workers = {w["rank"]: w for w in job["workers"]}
    assert workers[1]["state"] == "failed" and "Traceback" in workers[1]["error"]
    agent.tick()
    assert {w["rank"]: w["state"] for w in _job(api, job_id)["workers"]} == {
        0: "stopped",
        1: "failed",
    }
    assert _devices(api) == [("free", None), ("free", None)]


def test_a_rank_killed_by_a_signal_fails_the_job_naming_the_signal(
    api: Api, host: tuple[Agent, ScriptedLauncher]
) -> None:
    agent, launcher = host
    job_id = _running(api, agent, launcher)
    launcher.end(job_id, 1, ProcessExit(code=-9, signal=signal.SIGKILL))
    agent.tick()
    job = _job(api, job_id)
    assert job["error"] == "rank 1 killed by SIGKILL"
    w1 = next(w for w in job["workers"] if w["rank"] == 1)
    assert w1["exit_code"] == -9 and w1["error"].startswith("killed by SIGKILL")


def test_a_stop_assignment_stops_the_rank_and_frees_the_device_once_reported(
    api: Api, host: tuple[Agent, ScriptedLauncher]
) -> None:
    agent, launcher = host
    job_id = _running(api, agent, launcher)
    assert api.client.post(f"/api/v1/jobs/{job_id}/cancel", headers=api.headers()).is_success
    # The workers may still run: their devices stay busy until the agent says they stopped.
    assert _devices(api) == [("busy", job_id), ("busy", job_id)]
    agent.tick()  # told to stop them
    assert launcher.stopped() == [(job_id, 0), (job_id, 1)]
    assert _devices(api) == [("busy", job_id), ("busy", job_id)]
    agent.tick()  # reports them stopped
    assert {w["state"] for w in _job(api, job_id)["workers"]} == {"stopped"}
    assert _devices(api) == [("free", None), ("free", None)]


def test_a_process_the_control_plane_does_not_list_is_stopped(
    api: Api, host: tuple[Agent, ScriptedLauncher]
) -> None:
    agent, launcher = host
    job_id = _running(api, agent, launcher)
    known = agent.procs[(job_id, 0, 0)]
    stray = known.assignment.model_copy(update={"job_id": 999})
    pid = launcher.launch(
        LaunchSpec(job_id=999, rank=0, command=["x"], env={}, log_path=known.log_path)
    )
    agent.procs[(999, 0, 0)] = WorkerProcess(stray, pid, known.log_path, known.error_path)
    assert agent.tick() is not None  # the report of an unknown rank does not wedge heartbeats
    assert launcher.stopped() == [(999, 0)]
    assert agent.procs[(job_id, 0, 0)].state is WorkerState.RUNNING
    assert agent.tick() is not None and (999, 0, 0) not in agent.procs


def test_a_rank_whose_job_ended_exits_and_is_reported_stopped_not_failed(
    api: Api, host: tuple[Agent, ScriptedLauncher]
) -> None:
    agent, launcher = host
    job_id = _running(api, agent, launcher)
    assert api.client.post(f"/api/v1/jobs/{job_id}/cancel", headers=api.headers()).is_success
    launcher.end(job_id, 0, ProcessExit(code=WORKER_EXIT_JOB_ENDED))  # its telemetry got 409
    launcher.end(job_id, 1, ProcessExit(code=WORKER_EXIT_JOB_ENDED))
    agent.tick()
    assert launcher.stopped() == []
    job = _job(api, job_id)
    assert job["status"] == "cancelled"
    assert {w["state"] for w in job["workers"]} == {"stopped"}
    assert _devices(api) == [("free", None), ("free", None)]


def test_a_rank_cancelled_before_launch_is_never_launched(
    api: Api, host: tuple[Agent, ScriptedLauncher]
) -> None:
    agent, launcher = host
    job_id = api.submit(workers=2)["id"]
    assert api.client.post(f"/api/v1/jobs/{job_id}/cancel", headers=api.headers()).is_success
    assert _devices(api) == [("free", None), ("free", None)]  # never handed out: free at once
    agent.tick()
    agent.tick()
    assert launcher.calls == [("stop_leftovers",)]
    assert {w["state"] for w in _job(api, job_id)["workers"]} == {"stopped"}
