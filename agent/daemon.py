"""The per-host agent: registers the host's devices, heartbeats, and runs the ranks the
control plane places here as ``python -m agent.runtime.worker`` processes.

Every tick the agent polls its processes, sends their states in a heartbeat, and reconciles
with the answer (``HeartbeatAck.assignments``): ranks to run are launched, ranks to stop (their
job was cancelled or failed elsewhere) are stopped, and processes the control plane no longer
knows are stopped too. States follow ``contract.enums.WorkerState``::

    (assigned) --launch--> RUNNING --exit 0--> SUCCEEDED
                              |----exit != 0--> FAILED (root-cause traceback from the error file)
                              +----stopped----> STOPPED

Each worker gets its environment from an allow-list (``agent.environment``) and its own
credential, minted for its job and rank and sent in its assignment, as ``EVENFLOW_TOKEN``: job
code never sees the agent's token nor any variable the operator marks secret. A worker that
stops because its job ended on the control plane exits with ``WORKER_EXIT_JOB_ENDED`` and is
reported stopped.

The agent holds its host by an instance id (one per process). A second agent registering the
same host name while this one heartbeats is refused (409) unless it asks to replace it; once
replaced, this agent's heartbeats are refused with 409 and it stops its workers and exits.

When a rank fails, the other ranks of its job on this host are stopped at once: they would
otherwise block in a collective until the process group times out. The control plane marks the
job failed on the first report and tells other hosts to stop their ranks. An unreachable control
plane never stops training: heartbeats are retried and reports are kept until they are taken.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from agent.backoff import Backoff
from agent.client import ApiClient, ApiError
from agent.environment import worker_environment
from contract.agent import (
    LOG_TAIL_CHARS,
    WORKER_EXIT_JOB_ENDED,
    Assignment,
    DeviceInfo,
    Heartbeat,
    HeartbeatAck,
    HostRegister,
    WorkerReport,
)
from contract.base import PROTOCOL_VERSION
from contract.enums import DeviceKind, WorkerState

log = logging.getLogger("evenflow.agent")

STOP_GRACE_S = 5.0
ERROR_TAIL_LINES = 60


def discover_devices(cpu_workers: int | None = None) -> list[DeviceInfo]:
    """CUDA devices from torch when present (unless CPU workers are asked for), else CPU slots."""
    if cpu_workers is None:
        import torch

        if torch.cuda.is_available():
            return [
                DeviceInfo(
                    index=i,
                    kind=DeviceKind.CUDA,
                    model=torch.cuda.get_device_name(i),
                    memory_mb=torch.cuda.get_device_properties(i).total_memory // 2**20,
                )
                for i in range(torch.cuda.device_count())
            ]
        cpu_workers = 1
    memory_mb = _total_memory_mb() // max(1, cpu_workers)
    model = f"CPU ({os.cpu_count()} cores shared)"
    return [
        DeviceInfo(index=i, kind=DeviceKind.CPU, model=model, memory_mb=memory_mb)
        for i in range(cpu_workers)
    ]


def _total_memory_mb() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20)
    except (ValueError, OSError):
        return 0


@dataclass
class WorkerProcess:
    """One rank this agent launched."""

    assignment: Assignment
    popen: subprocess.Popen[bytes]
    log_path: Path
    error_path: Path
    state: WorkerState = WorkerState.RUNNING
    exit_code: int | None = None
    error: str | None = None
    log_tail: str | None = None
    reported: WorkerState | None = None
    stop_requested: bool = False

    @property
    def key(self) -> tuple[int, int]:
        return self.assignment.job_id, self.assignment.rank

    def report(self) -> WorkerReport:
        return WorkerReport(
            job_id=self.assignment.job_id,
            rank=self.assignment.rank,
            state=self.state,
            exit_code=self.exit_code,
            error=self.error,
            log_tail=self.log_tail,
        )


@dataclass
class Agent:
    client: ApiClient
    name: str
    address: str
    devices: list[DeviceInfo]
    server_url: str
    token: str
    workdir: Path
    python: str = sys.executable
    extra_env: Mapping[str, str] = field(default_factory=dict)
    """Variables every worker gets (set by whoever runs the agent, e.g. telemetry cadence)."""
    secret_env: frozenset[str] = frozenset()
    """Variables of the agent's environment never passed to a worker (``--secret-env``)."""
    instance: str = field(default_factory=lambda: uuid.uuid4().hex)
    """This agent process, as the control plane knows it."""
    replace: bool = False
    """Take the host over from another live agent instance when registering."""
    replaced: bool = False
    """Another instance took the host over: this one must stop."""
    host_id: int | None = None
    procs: dict[tuple[int, int], WorkerProcess] = field(default_factory=dict)
    done: set[tuple[int, int]] = field(default_factory=set)
    pending: list[WorkerReport] = field(default_factory=list)
    """Reports about ranks that have no process here (told to stop before launch)."""

    # ------------------------------------------------------------------ control plane
    def register(self) -> int:
        host = self.client.register_host(
            HostRegister(
                protocol_version=PROTOCOL_VERSION,
                name=self.name,
                address=self.address,
                devices=self.devices,
                instance=self.instance,
                replace=self.replace,
            )
        )
        self.host_id = host.id
        log.info(
            "registered host %s (id %d) with %d device(s)", self.name, host.id, len(self.devices)
        )
        return host.id

    def tick(self) -> HeartbeatAck | None:
        """Poll processes, heartbeat with their states, reconcile with the answer."""
        if self.host_id is None:
            self.register()
        assert self.host_id is not None
        self._poll()
        reports = [p.report() for p in self.procs.values() if p.state != p.reported] + self.pending
        try:
            ack = self.client.heartbeat(
                self.host_id, Heartbeat(workers=reports, instance=self.instance)
            )
        except ApiError as exc:
            if exc.status_code == 404:  # the control plane lost us (a fresh database)
                self.host_id = None
            if exc.status_code == 409:  # another agent instance took the host over
                self.replaced = True
                log.error("%s; stopping", exc.detail)
                return None
            log.warning("heartbeat refused: %s", exc)
            return None
        except httpx.TransportError as exc:
            log.warning("control plane unreachable (%s); workers keep running", exc)
            return None
        for p in self.procs.values():
            p.reported = p.state
        self.pending.clear()
        self._reconcile(ack.assignments)
        self._forget_reported()
        return ack

    def run(self, stop: threading.Event, interval_s: float = 1.0) -> None:
        """Tick until ``stop`` is set, then stop every worker."""
        while not stop.is_set() and not self.replaced:
            try:
                self.tick()
            except (ApiError, httpx.TransportError) as exc:
                log.warning("agent tick failed: %s", exc)
            stop.wait(interval_s)
        self.shutdown()

    # ------------------------------------------------------------------ processes
    def _reconcile(self, assignments: list[Assignment]) -> None:
        wanted = {(a.job_id, a.rank): a for a in assignments}
        for key, a in wanted.items():
            proc = self.procs.get(key)
            if a.desired == "run" and proc is None and key not in self.done:
                if a.worker_token is None:
                    self._refuse(a)
                else:
                    self._launch(a, a.worker_token)
            elif a.desired == "stop" and proc is not None and proc.state is WorkerState.RUNNING:
                self._stop(proc)
            elif a.desired == "stop" and proc is None and key not in self.done:
                self.done.add(key)
                self.pending.append(
                    WorkerReport(job_id=a.job_id, rank=a.rank, state=WorkerState.STOPPED)
                )
        for key, proc in self.procs.items():
            if key not in wanted and proc.state is WorkerState.RUNNING:
                self._stop(proc)

    def _refuse(self, a: Assignment) -> None:
        """A rank to run without a credential was handed out before (to an earlier instance of
        this agent): launching it again cannot join its job."""
        self.done.add((a.job_id, a.rank))
        error = (
            f"rank {a.rank} of job {a.job_id} was already handed to an earlier agent on this "
            "host; its credential is not known to this agent, so it is not launched again"
        )
        log.error("%s", error)
        self.pending.append(
            WorkerReport(job_id=a.job_id, rank=a.rank, state=WorkerState.FAILED, error=error)
        )

    def _launch(self, a: Assignment, worker_token: str) -> None:
        jobdir = self.workdir / f"job-{a.job_id}"
        jobdir.mkdir(parents=True, exist_ok=True)
        log_path, error_path = jobdir / f"rank-{a.rank}.log", jobdir / f"rank-{a.rank}.error"
        error_path.unlink(missing_ok=True)
        job_vars = {
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "PYTHONUNBUFFERED": "1",
            **self.extra_env,
            "EVENFLOW_SERVER": self.server_url,
            "EVENFLOW_TOKEN": worker_token,
            "EVENFLOW_JOB_ID": str(a.job_id),
            "EVENFLOW_SPEC": json.dumps(a.spec),
            "RANK": str(a.rank),
            "WORLD_SIZE": str(a.world_size),
            "LOCAL_RANK": str(a.device_index),
            "MASTER_ADDR": a.master_addr,
            "MASTER_PORT": str(a.master_port),
            "EVENFLOW_ERROR_FILE": str(error_path),
            "EVENFLOW_RESULT": str(jobdir / f"rank-{a.rank}.result.json"),
        }
        env = worker_environment(os.environ, job_vars, self.secret_env)
        with log_path.open("ab") as out:
            popen = subprocess.Popen(
                [self.python, "-m", "agent.runtime.worker"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs[(a.job_id, a.rank)] = WorkerProcess(a, popen, log_path, error_path)
        log.info(
            "job %d rank %d/%d: launched (pid %d, %s device %d)",
            a.job_id,
            a.rank,
            a.world_size,
            popen.pid,
            a.device_kind.value,
            a.device_index,
        )

    def _poll(self) -> None:
        failed_jobs: set[int] = set()
        for proc in self.procs.values():
            if proc.state is not WorkerState.RUNNING:
                continue
            code = proc.popen.poll()
            if code is None:
                continue
            proc.exit_code = code
            if code != 0:
                proc.log_tail = _log_tail(proc.log_path)
            if proc.stop_requested or code == WORKER_EXIT_JOB_ENDED:
                proc.state = WorkerState.STOPPED
            elif code == 0:
                proc.state = WorkerState.SUCCEEDED
            else:
                proc.state = WorkerState.FAILED
                proc.error = self._root_cause(proc)
                failed_jobs.add(proc.assignment.job_id)
                log.error(
                    "job %d rank %d failed (exit %d): %s",
                    proc.assignment.job_id,
                    proc.assignment.rank,
                    code,
                    (proc.error or "").strip().splitlines()[-1:],
                )
        for proc in self.procs.values():  # siblings of a failed rank would hang in a collective
            if proc.assignment.job_id in failed_jobs and proc.state is WorkerState.RUNNING:
                self._stop(proc)

    @staticmethod
    def _root_cause(proc: WorkerProcess) -> str:
        if proc.error_path.exists():
            return proc.error_path.read_text(errors="replace")[-60_000:]
        try:
            lines = proc.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return f"exit code {proc.exit_code}"
        return "\n".join(lines[-ERROR_TAIL_LINES:])[-60_000:] or f"exit code {proc.exit_code}"

    def _stop(self, proc: WorkerProcess) -> None:
        proc.stop_requested = True
        _signal_group(proc.popen, signal.SIGTERM)
        try:
            proc.popen.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            _signal_group(proc.popen, signal.SIGKILL)
            proc.popen.wait()
        proc.exit_code = proc.popen.returncode
        proc.state = WorkerState.STOPPED
        log.info("job %d rank %d: stopped", proc.assignment.job_id, proc.assignment.rank)

    def _forget_reported(self) -> None:
        """Drop ended processes whose end the control plane has taken; keep their keys so a
        late 'run' for them is not launched again."""
        for key, proc in list(self.procs.items()):
            if proc.state.terminal and proc.reported == proc.state:
                self.done.add(key)
                del self.procs[key]

    def shutdown(self) -> None:
        for proc in self.procs.values():
            if proc.state is WorkerState.RUNNING:
                self._stop(proc)


def _signal_group(popen: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(popen.pid, sig)


def run_agent(
    server: str,
    token: str,
    name: str,
    address: str,
    devices: list[DeviceInfo],
    workdir: Path,
    *,
    interval_s: float = 1.0,
    stop: threading.Event | None = None,
    extra_env: Mapping[str, str] | None = None,
    secret_env: frozenset[str] = frozenset(),
    replace: bool = False,
) -> bool:
    """Run an agent until ``stop`` is set (or SIGINT/SIGTERM when run as the main thread) or
    another agent instance takes the host over; returns whether it was taken over. A refused
    registration (401, 403, 409: another live agent holds the host) raises ``ApiError``."""
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    with httpx.Client(base_url=server.rstrip("/"), timeout=10.0) as http:
        agent = Agent(
            ApiClient(http, token),
            name=name,
            address=address,
            devices=devices,
            server_url=server,
            token=token,
            workdir=workdir,
            extra_env=dict(extra_env or {}),
            secret_env=secret_env,
            replace=replace,
        )
        backoff = Backoff(0.5, 5.0)
        while not stop.is_set():
            try:
                agent.register()
                break
            except (ApiError, httpx.TransportError) as exc:
                if isinstance(exc, ApiError) and exc.status_code in (401, 403, 409):
                    raise
                delay = backoff.failed()
                log.warning("cannot register yet (%s); retrying in %.1f s", exc, delay)
                stop.wait(delay)
        agent.run(stop, interval_s)
        return agent.replaced


def _log_tail(path: Path) -> str | None:
    """The last lines of a rank's log, at most ``LOG_TAIL_CHARS`` (whole lines where it can)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - LOG_TAIL_CHARS))
            text = f.read().decode(errors="replace").replace("\x00", "")
    except OSError:
        return None
    if len(text) >= LOG_TAIL_CHARS and "\n" in text:
        text = text.split("\n", 1)[1]  # drop the partial first line
    return text[-LOG_TAIL_CHARS:] or None
