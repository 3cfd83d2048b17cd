"""Nothing acknowledged is lost when a host's agent is killed: a real agent process runs a
checkpointed 2-rank job, is ``kill -9``-ed at random moments (its workers die with it) and
started again; the job resumes from its checkpoint, and every iteration it trained, before
the crashes too, is in its telemetry and its loss series. The restarts say the agent died."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.client import ApiClient, make_http
from contract.api import TokenCreate
from contract.enums import JobStatus, Role
from tests.harness import ROOT, LiveServer

HOST = "bars-h1"
ITERATIONS, EVERY, CRASHES = 500, 25, 2


def _wait_for(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture
def agents(
    live_server: LiveServer, tmp_path: Path
) -> Iterator[Callable[[], subprocess.Popen[bytes]]]:
    """``start()`` starts the host's agent (always the same name and workdir) as its own
    process; each is SIGKILLed at the end if still alive."""
    admin = ApiClient(make_http(live_server.url, live_server.admin_token))
    token = admin.create_token(TokenCreate(name="a", role=Role.AGENT, host=HOST)).token
    admin.http.close()
    started: list[subprocess.Popen[bytes]] = []
    # the relay posts every 5 s: a crash finds rows acknowledged but not yet posted
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "EVENFLOW_TOKEN": token,
        "EVENFLOW_TELEMETRY_S": "5",
    }

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "evenflow.cli", "agent", "--server", live_server.url),
                *("--name", HOST, "--address", "127.0.0.1", "--cpu-workers", "2"),
                *("--heartbeat", "0.3", "--workdir", str(tmp_path / "agent")),
            ],
            env=env,
            start_new_session=True,
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _iterations(admin: ApiClient, job_id: int) -> dict[int, set[int]]:
    """Every stored telemetry row's iteration, by rank."""
    seen: dict[int, set[int]] = {0: set(), 1: set()}
    offset = 0
    while True:
        page = admin.telemetry(job_id, limit=1000, offset=offset)
        for row in page.items:
            seen[row.rank].add(row.iteration)
        offset += len(page.items)
        if not page.items or offset >= page.total:
            return seen


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_kill_9_of_the_agent_at_random_moments_loses_no_trained_iteration(
    live_server: LiveServer, agents: Callable[[], subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)
    print(f"seed {seed}")
    admin = ApiClient(make_http(live_server.url, live_server.admin_token))
    agent = agents()
    spool = tmp_path / "agent" / "spool" / HOST
    _wait_for(lambda: any(h.name == HOST for h in admin.hosts().items), 60, "the agent")
    job = admin.submit(
        {
            "name": "crashing",
            "workload": {"builtin": "mlp", "seed": 5},
            "global_batch": 32,
            "iterations": ITERATIONS,
            "workers": 2,
            "max_restarts": CRASHES,
            "policy": {"name": "equal"},
            "emulation": [{"per_sample_ms": 1.0}, {"per_sample_ms": 1.0}],
            "checkpoint": {"every_iterations": EVERY},
        }
    )
    for crash in range(CRASHES):
        # a checkpoint of this attempt, then a random moment (checkpoints come every ~1 s)
        def checkpointed(attempt: int = crash) -> bool:
            return any(c.attempt == attempt for c in admin.checkpoints(job.id).items)

        _wait_for(checkpointed, 180, f"a checkpoint of attempt {crash}")
        time.sleep(rng.uniform(0.0, 2.5))
        agent.kill()  # kill -9: its workers die with it (a host crash, to them)
        assert agent.wait(timeout=10) == -signal.SIGKILL
        print("spooled at the crash:", sorted(p.name for p in spool.glob("*.spool")))
        time.sleep(rng.uniform(1.0, 3.0))
        agent = agents()
    _wait_for(lambda: admin.job(job.id).status.terminal, 300, "the job's end")
    done = admin.job(job.id)
    assert done.status is JobStatus.SUCCEEDED, (seed, done.error)
    assert done.restarts == CRASHES, (seed, done.restart_history)
    for restart in done.restart_history:
        assert restart.reason.startswith(f"host {HOST}'s agent restarted (it died while rank"), (
            seed,
            restart.reason,
        )
        assert restart.resumed_from is not None and restart.resumed_from >= EVERY
    # What each attempt trained before its crash and never trained again (below the
    # checkpoint the next attempt resumed from) came only from the dead agents' spools.
    assert _iterations(admin, job.id) == {0: set(range(ITERATIONS)), 1: set(range(ITERATIONS))}, (
        seed
    )
    (loss,) = [s for s in admin.metrics(job.id, points=10_000, names=["loss"]).series]
    assert sorted(set(range(ITERATIONS)) - set(loss.iteration)) == [], seed
    admin.http.close()
