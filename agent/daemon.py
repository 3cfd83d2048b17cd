"""The per-host agent: registers the host's devices, heartbeats, and runs the ranks the
control plane places here as ``python -m agent.runtime.worker`` processes.

Every tick the agent polls its processes, sends their states in a heartbeat, and reconciles
with the answer (``HeartbeatAck.assignments``): ranks to run are launched, ranks to stop (their
job was cancelled or failed elsewhere) are stopped, and processes the control plane no longer
knows are stopped too. States follow ``contract.enums.WorkerState``::

    (assigned) --launch--> RUNNING --exit 0--> SUCCEEDED
                              |----exit != 0--> FAILED (root-cause traceback from the error file)
                              |----signal-----> FAILED ("killed by SIGKILL")
                              +----stopped----> STOPPED

Each worker gets its environment from an allow-list (``agent.environment``) and its own
credential, minted for its job and rank and sent in its assignment, as ``EVENFLOW_TOKEN``: job
code never sees the agent's token nor any variable the operator marks secret. A worker that
stops because its job ended on the control plane exits with ``WORKER_EXIT_JOB_ENDED`` and is
reported stopped.

Workers post their telemetry and metrics to the agent's relay (``agent.relay``, started by
``run``; its URL reaches them as ``EVENFLOW_TELEMETRY_RELAY``), which takes each rank's batches
with the credential handed to it, keeps them in its spool (``workdir/spool/<host name>``,
``agent.spool``) before it answers, and posts one batch per job and kind. A relay started over
an earlier agent's spool posts what it holds before the agent's first heartbeat. Before a
heartbeat reports that a rank ended (or could not be launched), its job's relayed rows are
flushed (the report waits while they cannot be, at most ``HOLD_EXIT_REPORT_S``), so the control
plane has all of a rank's rows when it learns of its end.

Processes are started, polled and stopped through an injected ``agent.launcher.Launcher`` (tests
script one). The real one records each running worker (pid, start time) under
``workdir/state/<host name>``: the agent stops what an earlier agent of the host left there once
it has registered, so a restarted agent never launches a rank beside its still-running old self.
Each worker gets the agent's pid (``EVENFLOW_AGENT_PID``) and dies with it
(``agent.runtime.parent``).

The agent holds its host by an instance id (one per process). A second agent registering the
same host name while this one heartbeats is refused (409) unless it asks to replace it; once
replaced, this agent's heartbeats are refused with 409 and it stops its workers and exits.
The instance is recorded beside the workers' state (``workdir/state/<host name>.agent.json``,
with the agent's pid and process start time): an agent started again on the host after its
predecessor died (a crash, ``kill -9``, a reboot) finds that process gone and carries on as
the same instance, so it takes its host back at once instead of being refused until the dead
one's heartbeat is ``live_after_s`` old. A predecessor that still runs is never taken over.
The ranks the predecessor ran died with it (``agent.runtime.parent``); the control plane still
wants them run, but their credentials died with it too, so the agent reports each failed with
``WORKER_EXIT_AGENT_GONE`` and the reason "host h1's agent restarted (it died while rank 0 of
job 7 ran)", which the job's restart records.

When a rank fails, the control plane decides, on the heartbeat that reports it, what becomes of
the other ranks: it fails the job (they are told to stop), restarts it as a new *attempt*
(ranks are keyed by (job, rank, attempt), so an earlier attempt's processes, no longer wanted,
are stopped before the new attempt's are launched), or, for a rank that was out of the
all-reduce group, lets the job go on without it (they keep running). Only when that heartbeat
does not get through are the other ranks of the job on this host stopped at once: they would
otherwise block in a collective until the process group times out. An unreachable control
plane never stops training: heartbeats are retried and reports are kept until they are taken.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx

from agent.backoff import Backoff
from agent.client import ApiClient, ApiError
from agent.contexts import ContextCache, ContextError
from agent.environment import device_variables, worker_environment, worker_threads
from agent.interpreters import InterpreterError, Interpreters
from agent.launcher import (
    Launcher,
    LaunchSpec,
    ProcessExit,
    SubprocessLauncher,
    process_start_time,
)
from agent.network import check_address
from agent.relay import RELAY_ENV, TelemetryRelay
from agent.spool import Spool
from contract.agent import (
    LOG_TAIL_CHARS,
    WORKER_EXIT_AGENT_GONE,
    WORKER_EXIT_FATAL,
    WORKER_EXIT_JOB_ENDED,
    Assignment,
    DeviceInfo,
    Heartbeat,
    HeartbeatAck,
    HostRegister,
    WorkerReport,
)
from contract.base import CONTEXT_UNPACKED_MIN_BYTES, CONTEXT_UNPACKED_RATIO, PROTOCOL_VERSION
from contract.enums import DeviceKind, WorkerState

log = logging.getLogger("evenflow.agent")

STOP_GRACE_S = 5.0
FATAL_REGISTER_STATUSES = (401, 403, 404, 405, 409)
"""Registration answers that retrying cannot change: a refused token, another live agent on
the host, or an address that is not an Evenflow control plane (404/405: no such API there)."""
ERROR_TAIL_LINES = 60
HOLD_EXIT_REPORT_S = 30.0
"""How long a rank's end is kept out of the heartbeat while its job's relayed telemetry cannot be
flushed; then it is reported anyway (the rows stay in the spool and are retried)."""
RESERVED_PACKAGES = ("agent", "contract", "evenflow", "server")
"""Evenflow's own top-level packages: a job's code may not bring one of the same name."""
SPOOL_MAX_BYTES = 512 * 2**20
"""The relay's spool bound (all jobs): past it, workers keep their rows and retry."""


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
    pid: int
    log_path: Path
    error_path: Path
    state: WorkerState = WorkerState.RUNNING
    exit_code: int | None = None
    signal: str | None = None
    error: str | None = None
    log_tail: str | None = None
    log_end: int | None = None
    reported: WorkerState | None = None
    stop_requested: bool = False
    follow_until: datetime | None = None
    """Someone follows the job's logs until then (``Assignment.follow_log_until``)."""
    log_sent: int = 0
    """The size of the log when its tail was last uploaded live."""

    @property
    def key(self) -> tuple[int, int, int]:
        return self.assignment.job_id, self.assignment.rank, self.assignment.attempt

    def ended(self, end: ProcessExit) -> None:
        self.exit_code, self.signal = end.code, end.signal_name

    def live_log(self, now: datetime) -> WorkerReport | None:
        """A running rank's report with its log's tail, when its logs are followed and the log
        has grown since the tail last went; else None."""
        if self.follow_until is None or self.follow_until <= now:
            return None
        if self.state is not WorkerState.RUNNING or self.reported is not WorkerState.RUNNING:
            return None
        try:
            size = self.log_path.stat().st_size
        except OSError:
            return None
        if size == self.log_sent:
            return None
        tail, end = _log_tail_at(self.log_path)
        if tail is None:
            return None
        self.log_sent = size
        return self.report().model_copy(update={"log_tail": tail, "log_end": end})

    def report(self) -> WorkerReport:
        return WorkerReport(
            job_id=self.assignment.job_id,
            rank=self.assignment.rank,
            state=self.state,
            exit_code=self.exit_code,
            signal=self.signal,
            error=self.error,
            attempt=self.assignment.attempt,
            log_tail=self.log_tail,
            log_end=self.log_end if self.log_tail else None,
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
    launcher: Launcher | None = None
    """Starts and stops the worker processes (default: ``SubprocessLauncher`` keeping its
    state under ``workdir/state/<name>``, so agents of other host names sharing a workdir
    never touch each other's workers); tests pass a scripted one."""
    host_id: int | None = None
    procs: dict[tuple[int, int, int], WorkerProcess] = field(default_factory=dict)
    """By (job, rank, attempt)."""
    done: set[tuple[int, int, int]] = field(default_factory=set)
    pending: list[WorkerReport] = field(default_factory=list)
    """Reports about ranks that have no process here (told to stop before launch)."""
    failed_jobs: set[int] = field(default_factory=set)
    """Jobs with a rank that failed here whose failure the control plane has not yet taken."""
    relay: TelemetryRelay | None = None
    """The workers' telemetry relay (``agent.relay``); ``run`` starts one when none is given
    and ``relay_telemetry`` is set. Without one, workers post their telemetry to the server."""
    relay_telemetry: bool = True
    spool_max_bytes: int = SPOOL_MAX_BYTES
    predecessor: str | None = None
    """How the agent this host ran before ended, when this one carries on as its instance:
    ``"died"`` (its process is gone without having stopped) or ``"stopped"``."""
    held_since: dict[int, float] = field(default_factory=dict)
    """Jobs whose ranks' ends are held back until their relayed rows are flushed: since when."""

    def __post_init__(self) -> None:
        if self.launcher is None:
            self.launcher = SubprocessLauncher(self.workdir / "state" / self.name)
        self._launcher: Launcher = self.launcher
        self._contexts = ContextCache(
            self.workdir / "contexts", self.client.context_bytes, max_archive_bytes=2**34
        )
        """The code archives of jobs placed here: fetched once per host and digest, bounded."""
        self._interpreters = Interpreters()
        """The environments jobs named, each checked once (``agent.interpreters``)."""
        self._record = self.workdir / "state" / f"{self.name}.agent.json"
        self._adopt_dead_predecessor()

    def _adopt_dead_predecessor(self) -> None:
        """Carry on as the instance of the agent this host ran before, if that process is gone
        (see the module docstring); never when it still runs or cannot be checked."""
        try:
            record = json.loads(self._record.read_text())
            instance, pid, started = str(record["instance"]), int(record["pid"]), record["start"]
            stopped = record.get("stopped") is True
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return
        if pid == os.getpid() or started is None:
            return
        if process_start_time(pid) == started:
            return  # still running: a second agent for this host must not pose as it
        log.info(
            "the previous agent of host %s (pid %d) is gone; carrying on as its instance",
            self.name,
            pid,
        )
        self.instance = instance
        self.predecessor = "stopped" if stopped else "died"

    def _write_record(self, *, stopped: bool = False) -> None:
        """Record this agent (``stopped``: it stopped its workers and is about to exit)."""
        record: dict[str, object] = {"instance": self.instance, "pid": os.getpid()}
        record["start"] = process_start_time(os.getpid())
        if stopped:
            record["stopped"] = True
        try:
            self._record.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._record.with_suffix(".tmp")
            tmp.write_text(json.dumps(record))
            tmp.replace(self._record)
        except OSError as exc:
            log.warning("cannot record this agent in %s: %s", self._record, exc)

    # ------------------------------------------------------------------ control plane
    def register(self) -> int:
        """Register (or re-register), then stop what an earlier agent of this host left running:
        before anything is launched, and never while another live agent holds the host (that
        registration is refused first)."""
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
        self._write_record()
        self._launcher.stop_leftovers()
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
        held = self._flush_ended_jobs()
        sent = [
            p
            for p in self.procs.values()
            if p.state != p.reported and p.assignment.job_id not in held
        ]
        pending = [r for r in self.pending if r.job_id not in held]
        now = datetime.now(UTC)
        live = [r for p in self.procs.values() if (r := p.live_log(now)) is not None]
        reports = [p.report() for p in sent] + pending + live
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
            self._stop_failed_jobs()
            return None
        except httpx.TransportError as exc:
            log.warning("control plane unreachable (%s); workers keep running", exc)
            self._stop_failed_jobs()
            return None
        for p in sent:
            p.reported = p.state
        self.pending = [r for r in self.pending if r.job_id in held]
        self.failed_jobs.clear()  # the answer says what becomes of their other ranks
        self._reconcile(ack.assignments)
        self._forget_reported()
        return ack

    def _flush_ended_jobs(self) -> set[int]:
        """Flush the relayed telemetry of every job with a rank whose end is about to be
        reported, so the server has all its rows before it learns the rank ended; returns the
        jobs whose rows could not be flushed, whose ends are held back (at most
        ``HOLD_EXIT_REPORT_S``; a held failure stops its job's other ranks here at once, as an
        unanswered heartbeat would)."""
        if self.relay is None:
            return set()
        ended = {
            p.assignment.job_id
            for p in self.procs.values()
            if p.state.terminal and p.state != p.reported
        }
        ended |= {r.job_id for r in self.pending if r.state.terminal}
        held = set()
        for job_id in sorted(ended):
            if self.relay.flush(job_id):
                self.held_since.pop(job_id, None)
                continue
            waited = time.monotonic() - self.held_since.setdefault(job_id, time.monotonic())
            if waited < HOLD_EXIT_REPORT_S:
                held.add(job_id)
                log.warning("job %d: its telemetry is not flushed; holding its ranks' ends", job_id)
            else:
                self.held_since.pop(job_id, None)
                log.warning(
                    "job %d: telemetry still not flushed after %.0f s; reporting its ranks' ends",
                    job_id,
                    waited,
                )
        if held & self.failed_jobs:
            self._stop_failed_jobs()
        return held

    def _telemetry_s(self) -> float:
        """The workers' telemetry cadence (``EVENFLOW_TELEMETRY_S``, as they get it), which the
        relay keeps: 2 s unless set."""
        value = self.extra_env.get("EVENFLOW_TELEMETRY_S", os.environ.get("EVENFLOW_TELEMETRY_S"))
        try:
            seconds = float(value or 2.0)
        except ValueError:
            return 2.0
        return seconds if 0 < seconds < float("inf") else 2.0

    def run(self, stop: threading.Event, interval_s: float = 1.0) -> None:
        """Tick until ``stop`` is set, then stop every worker (and the telemetry relay, which
        it starts first unless ``relay_telemetry`` is off)."""
        if self.relay is None and self.relay_telemetry:
            self.relay = TelemetryRelay(
                self.client.post_telemetry,
                post_metrics=self.client.post_metrics,
                spool=Spool(self.workdir / "spool" / self.name, max_bytes=self.spool_max_bytes),
                flush_s=self._telemetry_s(),
            )
            self.relay.start()  # what an earlier agent's spool holds goes first
        while not stop.is_set() and not self.replaced:
            try:
                self.tick()
            except (ApiError, httpx.TransportError) as exc:
                log.warning("agent tick failed: %s", exc)
            stop.wait(interval_s)
        self.shutdown()

    # ------------------------------------------------------------------ processes
    def _reconcile(self, assignments: list[Assignment]) -> None:
        wanted = {(a.job_id, a.rank, a.attempt): a for a in assignments}
        for key, old in self.procs.items():  # first, so a new attempt never meets the old
            if key not in wanted and old.state is WorkerState.RUNNING:
                self._stop(old)
        for key, a in wanted.items():
            proc = self.procs.get(key)
            if proc is not None:
                proc.follow_until = a.follow_log_until
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
                    WorkerReport(
                        job_id=a.job_id, rank=a.rank, state=WorkerState.STOPPED, attempt=a.attempt
                    )
                )

    def _refuse(self, a: Assignment) -> None:
        """A rank to run without a credential was handed out before, to an earlier agent
        process of this host, and died with it: launching it again cannot join its job (the
        control plane restarts the job), and the report says why in words."""
        how = {
            "died": "it died",
            "stopped": "it was stopped",
        }.get(self.predecessor or "", "an earlier agent process of the host ended")
        error = (
            f"host {self.name}'s agent restarted ({how} while rank {a.rank} of job {a.job_id} ran)"
        )
        self._fail_unlaunched(a, error, fatal=False, exit_code=WORKER_EXIT_AGENT_GONE)

    def _launch(self, a: Assignment, worker_token: str) -> None:
        jobdir = self.workdir / f"job-{a.job_id}"
        jobdir.mkdir(parents=True, exist_ok=True)
        log_path, error_path = jobdir / f"rank-{a.rank}.log", jobdir / f"rank-{a.rank}.error"
        error_path.unlink(missing_ok=True)
        try:
            code = self._code(a, jobdir)
        except ContextError as exc:
            self._fail_unlaunched(a, str(exc), fatal=exc.__cause__ is None)
            return
        env = self._worker_env(a, worker_token, jobdir, error_path)
        if code is not None:  # the job's code first on sys.path
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(code), env.get("PYTHONPATH")) if p)
        python = (a.spec.get("environment") or {}).get("python") or self.python
        if python != self.python:
            try:
                self._interpreters.check(python, a.backend, env)
            except InterpreterError as exc:
                self._fail_unlaunched(a, str(exc), fatal=True)
                return
        if self.relay is not None:
            self.relay.grant(a.job_id, a.rank, worker_token)
            env[RELAY_ENV] = self.relay.url
        pid = self._launcher.launch(
            LaunchSpec(
                job_id=a.job_id,
                rank=a.rank,
                command=[python, "-m", "agent.runtime.worker"],
                env=env,
                log_path=log_path,
                cwd=code,
            )
        )
        self.procs[(a.job_id, a.rank, a.attempt)] = WorkerProcess(a, pid, log_path, error_path)
        log.info(
            "job %d rank %d/%d: launched (pid %d, %s device %d)",
            a.job_id,
            a.rank,
            a.world_size,
            pid,
            a.device_kind.value,
            a.device_index,
        )

    def _code(self, a: Assignment, jobdir: Path) -> Path | None:
        """The job's shipped code, unpacked in its directory (None when it shipped none)."""
        sha256 = (a.spec.get("workload") or {}).get("context")
        if not sha256:
            return None
        # A bomb is what unpacks far past its archive: the bound grows with the archive, whose
        # own size the control plane bounds (EVENFLOW_CONTEXT_MAX_BYTES).
        size = self._contexts.archive(sha256).stat().st_size
        limit = max(CONTEXT_UNPACKED_MIN_BYTES, CONTEXT_UNPACKED_RATIO * size)
        code = self._contexts.unpack(sha256, jobdir / "context", max_unpacked_bytes=limit)
        for name in RESERVED_PACKAGES:
            if (code / name / "__init__.py").exists() or (code / f"{name}.py").exists():
                raise ContextError(
                    f"the context's top-level {name!r} would hide Evenflow's own package of "
                    "that name from its ranks: move it into a package of another name"
                )
        return code

    def _fail_unlaunched(
        self, a: Assignment, error: str, *, fatal: bool, exit_code: int | None = None
    ) -> None:
        """Report a rank this agent could not start, with why (fatal: the same everywhere)."""
        self.done.add((a.job_id, a.rank, a.attempt))
        log.error("job %d rank %d not launched: %s", a.job_id, a.rank, error)
        self.pending.append(
            WorkerReport(
                job_id=a.job_id,
                rank=a.rank,
                state=WorkerState.FAILED,
                error=error,
                exit_code=WORKER_EXIT_FATAL if fatal else exit_code,
                attempt=a.attempt,
            )
        )

    def _worker_env(
        self, a: Assignment, worker_token: str, jobdir: Path, error_path: Path
    ) -> dict[str, str]:
        """The whole environment of one rank's process (``agent.environment``)."""
        job_vars = {
            "OMP_NUM_THREADS": worker_threads(len(self.devices), os.environ),
            "PYTHONUNBUFFERED": "1",
            **self.extra_env,
            "EVENFLOW_SERVER": self.server_url,
            "EVENFLOW_TOKEN": worker_token,
            "EVENFLOW_JOB_ID": str(a.job_id),
            "EVENFLOW_SPEC": json.dumps(a.spec),
            "RANK": str(a.rank),
            "WORLD_SIZE": str(a.world_size),
            **device_variables(a.device_kind.value, a.device_index, a.backend, os.environ),
            "MASTER_ADDR": a.master_addr,
            "MASTER_PORT": str(a.master_port),
            "EVENFLOW_ERROR_FILE": str(error_path),
            "EVENFLOW_RESULT": str(jobdir / f"rank-{a.rank}.result.json"),
            "EVENFLOW_JOB_DIR": str(jobdir),
            "EVENFLOW_AGENT_PID": str(os.getpid()),
        }
        return worker_environment(os.environ, job_vars, self.secret_env)

    def _poll(self) -> None:
        for proc in self.procs.values():
            if proc.state is not WorkerState.RUNNING:
                continue
            end = self._launcher.poll(proc.pid)
            if end is None:
                continue
            proc.ended(end)
            proc.log_tail, proc.log_end = _log_tail_at(proc.log_path)  # succeeded too
            if proc.stop_requested or end.code == WORKER_EXIT_JOB_ENDED:
                proc.state = WorkerState.STOPPED
            elif end.code == 0:
                proc.state = WorkerState.SUCCEEDED
            else:
                proc.state = WorkerState.FAILED
                proc.error = self._root_cause(proc)
                self.failed_jobs.add(proc.assignment.job_id)
                log.error(
                    "job %d rank %d failed (%s): %s",
                    proc.assignment.job_id,
                    proc.assignment.rank,
                    f"killed by {proc.signal}" if proc.signal else f"exit {end.code}",
                    (proc.error or "").strip().splitlines()[-1:],
                )

    def _stop_failed_jobs(self) -> None:
        """Without the control plane's word, stop the other ranks of a job with a failed rank
        here: they would hang in a collective with it."""
        for proc in self.procs.values():
            if proc.assignment.job_id in self.failed_jobs and proc.state is WorkerState.RUNNING:
                self._stop(proc)

    @staticmethod
    def _root_cause(proc: WorkerProcess) -> str:
        """What to report of a failed rank: that a signal killed it (with its log's tail), else
        the traceback from its error file, else its log's tail."""
        tail = _last_lines(proc.log_path)
        if proc.signal is not None:
            return f"killed by {proc.signal}" + (
                f"; last lines of its log:\n{tail}" if tail else ""
            )
        if proc.error_path.exists():
            return proc.error_path.read_text(errors="replace")[-60_000:]
        return tail or f"exit code {proc.exit_code}"

    def _stop(self, proc: WorkerProcess) -> None:
        proc.stop_requested = True
        proc.ended(self._launcher.stop(proc.pid, STOP_GRACE_S))
        proc.state = WorkerState.STOPPED
        log.info("job %d rank %d: stopped", proc.assignment.job_id, proc.assignment.rank)

    def _forget_reported(self) -> None:
        """Drop ended processes whose end the control plane has taken; keep their keys so a
        late 'run' for them is not launched again."""
        for key, proc in list(self.procs.items()):
            if proc.state.terminal and proc.reported == proc.state:
                self.done.add(key)
                del self.procs[key]
                if self.relay is not None and proc.assignment.worker_token is not None:
                    self.relay.revoke(proc.assignment.worker_token)

    def shutdown(self) -> None:
        """Stop every worker, then flush the relay's telemetry (bounded) and stop it."""
        for proc in self.procs.values():
            if proc.state is WorkerState.RUNNING:
                self._stop(proc)
        if self.relay is not None:
            self.relay.close()
        if self.host_id is not None and not self.replaced:
            self._write_record(stopped=True)


def _last_lines(path: Path) -> str:
    """The log's last ``ERROR_TAIL_LINES`` lines, for a failure's root cause without a traceback."""
    return "\n".join((_log_tail(path) or "").splitlines()[-ERROR_TAIL_LINES:])


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
    registration (``FATAL_REGISTER_STATUSES``) raises ``ApiError``; an address that does not
    resolve raises ``agent.network.AddressError`` before anything starts."""
    check_address(address)
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
                if isinstance(exc, ApiError) and exc.status_code in FATAL_REGISTER_STATUSES:
                    raise
                delay = backoff.failed()
                log.warning("cannot register yet (%s); retrying in %.1f s", exc, delay)
                stop.wait(delay)
        agent.run(stop, interval_s)
        return agent.replaced


def _log_tail(path: Path) -> str | None:
    """The last lines of a rank's log, at most ``LOG_TAIL_CHARS`` (whole lines where it can)."""
    return _log_tail_at(path)[0]


def _log_tail_at(path: Path) -> tuple[str | None, int]:
    """``_log_tail``, and where it ends in the log (bytes)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            start = max(0, f.tell() - LOG_TAIL_CHARS)
            f.seek(start)
            raw = f.read()
            end = f.tell()
    except OSError:
        return None, 0
    if start > 0 and b"\n" in raw:
        raw = raw.split(b"\n", 1)[1]  # drop the partial first line
    text = raw.decode(errors="replace").replace("\x00", "")
    return text[-LOG_TAIL_CHARS:] or None, end
