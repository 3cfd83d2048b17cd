"""An agent on a GPU host, on CPU: workers whose torch says CUDA is available (a sitecustomize
fakes it in every worker) still train a CPU job with gloo, and a job starts when the port a
server would have chosen is held by a stale process."""

from __future__ import annotations

import json
import random
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from agent.client import ApiClient, make_http
from agent.daemon import Agent, discover_devices
from agent.network import AddressError, check_address
from contract.enums import JobStatus
from tests.agent.test_daemon import _spec, _wait
from tests.harness import ROOT, LiveServer

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

FAKE_CUDA = """
import json, os, pathlib
import torch
torch.cuda.is_available = lambda: True  # what a GPU host's torch says
torch.cuda.device_count = lambda: 8
if "RANK" in os.environ:
    seen = {k: os.environ.get(k) for k in
            ("RANK", "CUDA_VISIBLE_DEVICES", "EVENFLOW_BACKEND", "EVENFLOW_DEVICE")}
    out = pathlib.Path(__file__).with_name(f"rank-{os.environ['RANK']}.json")
    out.write_text(json.dumps(seen))
"""


@contextmanager
def running_agent(
    live_server: LiveServer, workdir: Path, address: str, pythonpath: str
) -> Iterator[tuple[Agent, ApiClient]]:
    """An agent with two CPU devices, running in a thread, and an admin client."""
    admin = ApiClient(make_http(live_server.url, live_server.admin_token))
    http = httpx.Client(base_url=live_server.url, timeout=10)
    a = Agent(
        ApiClient(http, live_server.admin_token),
        name="gpu-host",
        address=address,
        devices=discover_devices(cpu_workers=2),
        server_url=live_server.url,
        token=live_server.admin_token,
        workdir=workdir,
        extra_env={
            "PYTHONPATH": pythonpath,
            "EVENFLOW_TELEMETRY_S": "0.2",
            "EVENFLOW_PLAN_POLL_S": "0.2",
        },
    )
    a.register()
    stop = threading.Event()
    thread = threading.Thread(target=a.run, args=(stop, 0.3), daemon=True)
    thread.start()
    try:
        yield a, admin
    finally:
        stop.set()
        thread.join(timeout=30)
        http.close()
        admin.http.close()


@pytest.fixture
def agent_with(live_server: LiveServer, tmp_path: Path) -> Iterator[tuple[Path, Agent, ApiClient]]:
    """An agent whose workers see a fake CUDA through a sitecustomize."""
    fake = tmp_path / "fake-cuda"
    fake.mkdir()
    (fake / "sitecustomize.py").write_text(FAKE_CUDA)
    with running_agent(live_server, tmp_path / "agent", "127.0.0.1", f"{fake}:{ROOT}") as pair:
        yield fake, *pair


def test_cpu_ranks_on_a_cuda_host_train_with_gloo(
    agent_with: tuple[Path, Agent, ApiClient],
) -> None:
    fake, _, admin = agent_with
    job = admin.submit(_spec(iterations=30, emulation=None))
    done = _wait(lambda: (j := admin.job(job.id)).status.terminal and j)
    assert done.status is JobStatus.SUCCEEDED, done.error
    assert {(r.rank, r.iteration) for r in admin.telemetry(job.id).items} == {
        (r, i) for r in range(2) for i in range(30)
    }
    for rank in range(2):  # the fake was in force, and the rank was pinned to the CPU
        seen = json.loads((fake / f"rank-{rank}.json").read_text())
        assert seen == {
            "RANK": str(rank),
            "CUDA_VISIBLE_DEVICES": "",
            "EVENFLOW_BACKEND": "gloo",
            "EVENFLOW_DEVICE": "cpu",
        }


def test_a_job_starts_when_the_port_it_would_have_been_given_is_held(
    agent_with: tuple[Path, Agent, ApiClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, a, admin = agent_with
    with socket.socket() as stale:  # a leftover process listening on "the job's port"
        stale.bind(("127.0.0.1", 0))
        stale.listen()
        held = stale.getsockname()[1]
        # Were the port chosen ahead (the control plane once drew one at random), it would be
        # this one: rank 0 must not depend on any port chosen before it binds.
        monkeypatch.setattr(random, "randint", lambda *_: held)
        job = admin.submit(_spec(iterations=20, emulation=None))
        done = _wait(lambda: (j := admin.job(job.id)).status.terminal and j)
    assert done.status is JobStatus.SUCCEEDED, done.error
    log = (a.workdir / f"job-{job.id}" / "rank-0.log").read_text()
    served = re.search(r"rendezvous served on 127\.0\.0\.1:(\d+)", log)
    assert served is not None and int(served.group(1)) != held


def test_a_rendezvous_that_cannot_complete_fails_the_job_naming_the_address(
    live_server: LiveServer, tmp_path: Path
) -> None:
    """The agent advertises an address nothing answers at (TEST-NET-1, RFC 5737): the job
    fails within its rendezvous timeout, not after the 10 minutes of a collective timeout."""
    with running_agent(live_server, tmp_path / "agent", "192.0.2.1", str(ROOT)) as (_, admin):
        job = admin.submit(_spec(iterations=5, emulation=None, rendezvous_timeout_s=3))
        done = _wait(lambda: (j := admin.job(job.id)).status.terminal and j, timeout=90)
    assert done.status is JobStatus.FAILED
    assert done.error is not None and "RendezvousError" in done.error
    assert "192.0.2.1" in done.error and "within 3 s" in done.error


def test_an_address_that_does_not_resolve_is_refused() -> None:
    assert "127.0.0.1" in check_address("127.0.0.1")
    with pytest.raises(AddressError, match=re.escape("'no-such-host.invalid' does not resolve")):
        check_address("no-such-host.invalid")
