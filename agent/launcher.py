"""How the agent starts, watches and stops worker processes: an interface with value types,
and the real implementation (``SubprocessLauncher``) beside it.

The agent (``agent.daemon.Agent``) only talks to a :class:`Launcher`, so its loop can be driven
in tests by a scripted fake; a process's end is data (:class:`ProcessExit`), never an
exception::

    launch(LaunchSpec) -> pid
    poll(pid)          -> None while it runs | ProcessExit(code=...) | ProcessExit(signal=...)
    stop(pid, grace_s) -> ProcessExit       (SIGTERM to its process group, SIGKILL after grace)
    stop_leftovers()   -> pids stopped       (workers of an earlier agent on this host)

The real launcher keeps one file per running worker in its state directory (pid and the
process's start time from ``/proc/<pid>/stat``). An agent killed with ``kill -9`` cannot clean
up; its workers normally die with it (``agent.runtime.parent``), and the next agent on the host
stops any that did not before it launches anything. A pid is only signalled when its start
time still matches the file, so a pid the kernel has since given to an unrelated process is
never touched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

log = logging.getLogger("evenflow.agent.launcher")


@dataclass(frozen=True)
class LaunchSpec:
    """One rank to start: its command, its whole environment, where its output goes."""

    job_id: int
    rank: int
    command: Sequence[str]
    env: Mapping[str, str]
    log_path: Path
    cwd: Path | None = None
    """Where the process starts (the job's unpacked code, when it shipped some)."""


@dataclass(frozen=True)
class ProcessExit:
    """How a process ended: it exited with ``code``, or ``signal`` killed it (then ``code`` is
    ``-signal``, as :mod:`subprocess` reports it)."""

    code: int
    signal: signal.Signals | None = None

    @classmethod
    def from_returncode(cls, returncode: int) -> ProcessExit:
        if returncode < 0:
            with contextlib.suppress(ValueError):
                return cls(code=returncode, signal=signal.Signals(-returncode))
        return cls(code=returncode)

    @property
    def signal_name(self) -> str | None:
        return self.signal.name if self.signal is not None else None


class Launcher(Protocol):
    """Starts, polls and stops the worker processes of one agent."""

    def launch(self, spec: LaunchSpec) -> int:
        """Start a rank; returns its pid."""
        ...

    def poll(self, pid: int) -> ProcessExit | None:
        """None while the process runs, else how it ended."""
        ...

    def stop(self, pid: int, grace_s: float) -> ProcessExit:
        """Stop a process (and its children), politely first; returns how it ended."""
        ...

    def stop_leftovers(self) -> list[int]:
        """Stop every worker an earlier agent of this host left running; returns their pids."""
        ...


def process_start_time(pid: int) -> int | None:
    """The start time of a live process (clock ticks after boot, ``/proc/<pid>/stat`` field
    22), or None when there is no such process (or no ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 2 (the command name) is in parentheses and may hold spaces; count after it.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie has ended; only its exit status is left to reap
        return None
    return int(fields[22 - 3])


class SubprocessLauncher:
    """Workers as child processes, each in a session (process group) of its own, recorded in
    ``state_dir`` while they run."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self._popens: dict[int, subprocess.Popen[bytes]] = {}

    def launch(self, spec: LaunchSpec) -> int:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with spec.log_path.open("ab") as out:
            popen = subprocess.Popen(
                list(spec.command),
                env=dict(spec.env),
                cwd=spec.cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._popens[popen.pid] = popen
        record = {
            "pid": popen.pid,
            "start_time": process_start_time(popen.pid),
            "job_id": spec.job_id,
            "rank": spec.rank,
        }
        path = self._state_file(popen.pid)
        path.with_suffix(".tmp").write_text(json.dumps(record))
        path.with_suffix(".tmp").replace(path)
        return popen.pid

    def poll(self, pid: int) -> ProcessExit | None:
        code = self._popens[pid].poll()
        if code is None:
            return None
        return self._ended(pid, code)

    def stop(self, pid: int, grace_s: float) -> ProcessExit:
        popen = self._popens[pid]
        if popen.poll() is None:
            _signal_group(pid, signal.SIGTERM)
            try:
                popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(pid, signal.SIGKILL)
                popen.wait()
        return self._ended(pid, popen.returncode)

    def stop_leftovers(self) -> list[int]:
        stopped = []
        for path in sorted(self.state_dir.glob("worker-*.json")):
            if int(path.stem.removeprefix("worker-")) in self._popens:
                continue  # one of ours
            try:
                record = json.loads(path.read_text())
                pid, started = int(record["pid"]), record["start_time"]
            except (OSError, ValueError, KeyError, TypeError):
                log.warning("ignoring unreadable worker state file %s", path)
                path.unlink(missing_ok=True)
                continue
            if started is None:
                log.warning("cannot check leftover worker pid %d without /proc; left alone", pid)
            elif process_start_time(pid) == started:
                log.warning(
                    "stopping leftover worker pid %d (job %s rank %s) of an earlier agent",
                    pid,
                    record.get("job_id"),
                    record.get("rank"),
                )
                _kill_leftover(pid, started)
                stopped.append(pid)
            path.unlink(missing_ok=True)
        return stopped

    def _ended(self, pid: int, returncode: int) -> ProcessExit:
        self._state_file(pid).unlink(missing_ok=True)
        return ProcessExit.from_returncode(returncode)

    def _state_file(self, pid: int) -> Path:
        return self.state_dir / f"worker-{pid}.json"


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _kill_leftover(pid: int, started: int) -> None:
    """SIGKILL a leftover worker's process group (it leads one: it was started in a session of
    its own), or the process alone if it no longer leads one. Not ours to wait for: the
    process's parent (init, once its agent died) reaps it."""
    if process_start_time(pid) != started:  # ended (and perhaps reused) since it was checked
        return
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError) as exc:
        log.warning("could not stop leftover worker pid %d: %s", pid, exc)
