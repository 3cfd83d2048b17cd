"""One live agent per host name: a second is refused with 409 unless it replaces the first,
which then stops (the agent against the real app, in-process)."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest

from agent.client import ApiClient, ApiError
from agent.daemon import Agent, discover_devices
from contract.enums import Role
from tests.harness import Api


def _agent(api: Api, token: str, tmp_path: Path, *, replace: bool = False) -> Agent:
    return Agent(
        ApiClient(api.client, token),
        name="host-a",
        address="127.0.0.1",
        devices=discover_devices(cpu_workers=1),
        server_url="http://testserver",
        token=token,
        workdir=tmp_path,
        replace=replace,
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
