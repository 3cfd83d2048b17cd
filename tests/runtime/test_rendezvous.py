"""The rendezvous: rank 0 binds a free port and publishes it, the others look it up; a
rendezvous that cannot complete fails within its timeout naming the address and port; the
device and backend come from the assignment."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from agent.runtime.rendezvous import DeviceAssignment, Rendezvous, RendezvousError, connect
from agent.runtime.worker import worker_main
from tests.harness import ROOT

pytestmark = pytest.mark.timeout(120)


def _unused_port() -> int:
    """A port nothing listens on (bound and released, never listened)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_rank0_binds_a_free_port_and_the_others_find_it_through_publish() -> None:
    published: list[int] = []
    with socket.socket() as held:  # a stale process on the port a server might have chosen
        held.bind(("127.0.0.1", 0))
        held.listen()
        stale = held.getsockname()[1]
        rank0 = Rendezvous("127.0.0.1", 0, 0, 2, timeout_s=30, publish_port=published.append)
        rank1 = Rendezvous(
            "127.0.0.1", 0, 1, 2, timeout_s=30, lookup_port=lambda: (published or [None])[0]
        )
        stores: dict[int, object] = {}
        t = threading.Thread(target=lambda: stores.setdefault(0, connect(rank0)))
        t.start()
        stores[1] = connect(rank1)
        t.join(timeout=30)
    assert len(published) == 1 and published[0] not in (0, stale)
    assert set(stores) == {0, 1}


def test_a_port_that_is_held_is_named_in_the_error() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(RendezvousError, match=f"127.0.0.1:{port}"):
            connect(Rendezvous("127.0.0.1", port, 0, 2, timeout_s=3))


def test_an_unpublished_port_fails_within_the_timeout() -> None:
    rdzv = Rendezvous("127.0.0.1", 0, 1, 2, timeout_s=1, lookup_port=lambda: None)
    with pytest.raises(RendezvousError, match=r"did not publish .* on 127.0.0.1 within 1 s"):
        connect(rdzv)


def _run_worker(tmp_path: Path, rank: int, port: int) -> tuple[int, str, str]:
    spec = {
        "name": "rdzv",
        "workload": {"builtin": "mlp"},
        "global_batch": 8,
        "iterations": 2,
        "workers": 2,
        "rendezvous_timeout_s": 3,
    }
    error = tmp_path / f"rank-{rank}.error"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "EVENFLOW_SERVER": f"http://127.0.0.1:{_unused_port()}",
        "EVENFLOW_TOKEN": "t",
        "EVENFLOW_JOB_ID": "1",
        "EVENFLOW_SPEC": json.dumps(spec),
        "EVENFLOW_ERROR_FILE": str(error),
        "RANK": str(rank),
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "agent.runtime.worker"],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,  # a hang guard only: main waited 10 minutes here
    )
    return proc.returncode, error.read_text() if error.exists() else "", proc.stdout + proc.stderr


@pytest.mark.distributed
def test_an_unreachable_rank0_fails_the_worker_naming_address_and_port(tmp_path: Path) -> None:
    port = _unused_port()
    code, error, out = _run_worker(tmp_path, 1, port)
    assert code == 1, out
    last = error.strip().splitlines()[-1]  # what the job's failure reason shows
    assert "RendezvousError" in last and f"127.0.0.1:{port}" in last and "within 3 s" in last


@pytest.mark.distributed
def test_ranks_that_never_come_fail_rank0_naming_its_port(tmp_path: Path) -> None:
    port = _unused_port()
    code, error, out = _run_worker(tmp_path, 0, port)
    assert code == 1, out
    last = error.strip().splitlines()[-1]
    assert f"only 1 of 2 ranks reached the rendezvous at 127.0.0.1:{port} within 3 s" in last


def test_the_device_comes_from_the_assignment_not_from_torch() -> None:
    assert DeviceAssignment.from_env({}) == DeviceAssignment("gloo", torch.device("cpu"))
    cuda = DeviceAssignment.from_env({"EVENFLOW_BACKEND": "nccl", "EVENFLOW_DEVICE": "cuda:0"})
    assert cuda.backend == "nccl" and cuda.device == torch.device("cuda", 0)
    for bad in (
        {"EVENFLOW_BACKEND": "mpi"},
        {"EVENFLOW_BACKEND": "nccl", "EVENFLOW_DEVICE": "cpu"},
        {"EVENFLOW_BACKEND": "gloo", "EVENFLOW_DEVICE": "cuda:0"},
        {"EVENFLOW_DEVICE": "tpu:banana"},
    ):
        with pytest.raises(ValueError):
            DeviceAssignment.from_env(bad)


def test_the_worker_refuses_a_device_its_backend_cannot_use(
    caplog: pytest.LogCaptureFixture,
) -> None:
    env = {
        "EVENFLOW_SERVER": "http://x",
        "EVENFLOW_TOKEN": "t",
        "EVENFLOW_JOB_ID": "1",
        "EVENFLOW_SPEC": json.dumps(
            {
                "name": "x",
                "workload": {"builtin": "mlp"},
                "global_batch": 8,
                "iterations": 1,
                "workers": 1,
            }
        ),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "0",
        "EVENFLOW_BACKEND": "nccl",
        "EVENFLOW_DEVICE": "cpu",
    }
    assert worker_main(env) == 2
    assert "backend nccl needs a cuda device" in caplog.text
