"""A worker's own check that its agent is alive (``agent.runtime.parent``), with real
processes: the parent-death signal is left out here, so the check alone must end the worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from agent.runtime.parent import EXIT_AGENT_GONE

# The "agent": starts a worker that watches it (parent check only), prints the worker's pid,
# then sleeps until killed.
AGENT = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(worker.pid, flush=True)
time.sleep(600)
"""
WORKER = """
import os, sys, time
from agent.runtime import parent
parent.set_parent_death_signal = lambda *a: False
parent.die_with_agent(os.getppid(), interval_s=0.2)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_worker_whose_agent_dies_exits_by_its_own_check() -> None:
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, WORKER], stdout=subprocess.PIPE, start_new_session=True
    )
    assert agent.stdout is not None
    worker = int(agent.stdout.readline())
    try:
        time.sleep(1.0)  # the worker has armed its check
        assert _alive(worker)
        agent.kill()
        agent.wait()
        deadline = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), "the worker outlived its agent"
    finally:
        agent.stdout.close()
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)


def test_a_worker_started_after_its_agent_died_exits_at_once() -> None:
    code = "from agent.runtime import parent; parent.die_with_agent(1)"
    done = subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True)
    assert done.returncode == EXIT_AGENT_GONE
    assert b"gone before this worker started" in done.stderr
