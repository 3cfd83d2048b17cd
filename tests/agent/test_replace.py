"""One live agent per host name: a second is refused with 409 unless it replaces the first,
which then stops (the agent against the real app, in-process)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from agent.client import ApiClient, ApiError
from agent.daemon import Agent, discover_devices
from agent.launcher import process_start_time
from contract.enums import Role
from tests.agent.test_agent_loop import ScriptedLauncher
from tests.harness import Api


def _agent(
    api: Api, token: str, tmp_path: Path, *, replace: bool = False, launcher: Any = None
) -> Agent:
    return Agent(
        ApiClient(api.client, token),
        name="host-a",
        address="127.0.0.1",
        devices=discover_devices(cpu_workers=1),
        server_url="http://testserver",
        token=token,
        workdir=tmp_path,
        replace=replace,
        launcher=launcher,
    )


def test_a_second_agent_is_refused_then_replaces_the_first(api: Api, tmp_path: Path) -> None:
    token = api.token(Role.AGENT, host="host-a")
    first = _agent(api, token, tmp_path / "1")
    first.register()
    assert first.tick() is not None
    second = _agent(api, token, tmp_path / "2")
    with pytest.raises(ApiError) as refused:
        second.register()
    assert refused.value.status_code == 409
    assert re.fullmatch(
        r"host host-a is held by another live agent \(last heartbeat \d+s ago\); "
        r"start with --replace to take over",
        refused.value.detail,
    ), refused.value.detail
    assert first.tick() is not None and not first.replaced  # the first one is untouched

    second.replace = True
    second.register()
    assert first.tick() is None and first.replaced
    stop = threading.Event()
    first.run(stop, interval_s=0.01)  # returns at once: it was replaced
    assert not stop.is_set()
    assert second.tick() is not None


def _pose_as_predecessor(workdir: Path, proc: subprocess.Popen[bytes]) -> None:
    """Make ``proc`` the recorded process of the host's agent (as if it had registered)."""
    record = workdir / "state" / "host-a.agent.json"
    data = json.loads(record.read_text())
    data.update(pid=proc.pid, start=process_start_time(proc.pid))
    record.write_text(json.dumps(data))


def test_an_agent_started_again_after_its_predecessor_died_takes_the_host_back(
    api: Api, tmp_path: Path
) -> None:
    """A host crash: its agent is gone without a word, and the agent started again on the host
    (same workdir) is not refused as a second live agent while the dead one's last heartbeat is
    fresh; a predecessor that still runs is never taken over."""
    token = api.token(Role.AGENT, host="host-a")
    first = _agent(api, token, tmp_path)
    first.register()
    assert first.tick() is not None
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _pose_as_predecessor(tmp_path, stand_in)  # a live predecessor
        with pytest.raises(ApiError) as refused:
            _agent(api, token, tmp_path).register()
        assert refused.value.status_code == 409
        _pose_as_predecessor(tmp_path, stand_in)
    finally:
        stand_in.kill()
        stand_in.wait()
    # the recorded agent process has died (kill -9): the next agent carries on as its instance
    again = _agent(api, token, tmp_path)
    assert again.instance == first.instance
    again.register()
    ack = again.tick()
    assert ack is not None and ack.status.value == "active"
    assert _agent(api, token, tmp_path / "elsewhere").instance != first.instance


def test_the_ranks_of_an_agent_that_died_restart_their_job_saying_so(
    api: Api, tmp_path: Path
) -> None:
    """The agent that comes back finds its predecessor's ranks still wanted (their credentials
    died with it): the job's restart names the agent's death, not a missing credential."""
    token = api.token(Role.AGENT, host="host-a")
    first = _agent(api, token, tmp_path, launcher=ScriptedLauncher())
    first.register()
    job = api.submit(workers=1, max_restarts=1)
    first.tick()  # launches rank 0
    first.tick()  # reports it running
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    _pose_as_predecessor(tmp_path, stand_in)
    stand_in.kill()  # the recorded agent process dies (kill -9)
    stand_in.wait()
    again = _agent(api, token, tmp_path, launcher=ScriptedLauncher())
    assert again.predecessor == "died"
    again.register()
    again.tick()  # rank 0 is wanted, without a credential: reported failed at the next tick
    again.tick()
    out = api.client.get(f"/api/v1/jobs/{job['id']}", headers=api.headers()).json()
    assert out["restarts"] == 1
    assert out["restart_history"][0]["reason"] == (
        f"host host-a's agent restarted (it died while rank 0 of job {job['id']} ran) "
        "(no checkpoint: from iteration 0)"
    )
