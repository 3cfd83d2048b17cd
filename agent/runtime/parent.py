"""A worker dies with its agent: no orphan keeps training (and holding its device) after the
agent that launched it is gone.

Two guards, both armed by :func:`die_with_agent` at the worker's start:

- On Linux, ``PR_SET_PDEATHSIG``: the kernel sends the worker SIGKILL the moment its parent
  dies; strictly, when the parent's *thread* that started it ends, so the agent launches from
  the thread that runs its loop, which stops every worker before it ends. Set in the worker
  rather than in a ``preexec_fn`` (unsafe in the agent, which has threads).
- Everywhere, a check that the parent is still the agent (``EVENFLOW_AGENT_PID``): at once,
  which covers an agent that died before the signal was armed, then every
  ``CHECK_INTERVAL_S`` in a daemon thread. A changed parent pid means the agent is gone
  (the worker was handed to init or a subreaper): the worker exits with
  ``EXIT_AGENT_GONE``.

So a worker ends within ``contract.agent.WORKER_ORPHAN_EXIT_S`` of its agent's death.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading

from contract.agent import WORKER_EXIT_AGENT_GONE

log = logging.getLogger("evenflow.runtime.parent")

CHECK_INTERVAL_S = 1.0
EXIT_AGENT_GONE = WORKER_EXIT_AGENT_GONE
"""Exit status of a worker whose agent died (nobody is left to read it but init); not 4,
``WORKER_EXIT_FATAL``, which tells the control plane not to restart the job."""
PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only);
    returns whether it was set."""
    if not sys.platform.startswith("linux"):
        log.info("no parent-death signal on %s; relying on the parent check", sys.platform)
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    except (OSError, AttributeError) as exc:
        log.warning("cannot set a parent-death signal (%s); relying on the parent check", exc)
        return False
    return True


def agent_alive(agent_pid: int) -> bool:
    """Whether this process's parent is still the agent that launched it."""
    return os.getppid() == agent_pid


def die_with_agent(agent_pid: int, interval_s: float = CHECK_INTERVAL_S) -> None:
    """Arm both guards; exits at once (``EXIT_AGENT_GONE``) if the agent is already gone."""
    set_parent_death_signal()
    if not agent_alive(agent_pid):
        log.error("agent (pid %d) is gone before this worker started; exiting", agent_pid)
        sys.exit(EXIT_AGENT_GONE)
    threading.Thread(
        target=_watch, args=(agent_pid, interval_s), name="evenflow-agent-watch", daemon=True
    ).start()


def _watch(agent_pid: int, interval_s: float) -> None:
    stop = threading.Event()
    while not stop.wait(interval_s):
        if not agent_alive(agent_pid):
            log.error("agent (pid %d) is gone; this worker exits with it", agent_pid)
            logging.shutdown()
            os._exit(EXIT_AGENT_GONE)
