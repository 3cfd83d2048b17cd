"""A whole Evenflow stack on this machine: the control plane (uvicorn, SQLite) and local agents
whose workers are real ``torch.distributed`` processes (gloo). Used by ``evenflow demo``,
``evenflow compare`` and the benchmarks; nothing in it is a stand-in for a part.

Agents run as threads of this process by default. With ``agent_processes=True`` each is a
process of its own (``python -m evenflow.local_cluster AGENT-JSON``, the same ``run_agent`` as
``evenflow agent``), in a session of its own, so a benchmark can take a host down as a crash
would (:meth:`LocalCluster.kill_agent`: SIGKILL to the agent's process group and to its
workers') and bring it back with the same name, token and workdir
(:meth:`LocalCluster.start_agent`).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import uvicorn

from agent.client import ApiClient
from agent.daemon import Agent, discover_devices
from agent.environment import worker_threads
from contract.api import JobOut, TokenCreate
from contract.base import MAX_PAGE
from contract.enums import Role
from contract.spec import JobSpec
from server.app import create_app
from server.config import Settings
from server.context import context_of

log = logging.getLogger("evenflow.local")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def server_process(
    env: Mapping[str, str], args: Sequence[str] = (), start_timeout_s: float = 60.0
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``evenflow server`` (its API and controller processes) on a free port, configured by
    ``env`` (``EVENFLOW_DATABASE_URL``, ``EVENFLOW_ADMIN_TOKEN``, ...); yields its base URL and
    process once ``/api/v1/health`` answers, and stops it on exit. For benchmarks and tests
    that need the real process model rather than an app in this process."""
    port = free_port()
    cmd = [sys.executable, "-m", "evenflow.cli", "server", "--port", str(port)]
    cmd += ["--log-level", "warning", *args]
    proc = subprocess.Popen(cmd, env=dict(env), cwd=Path(__file__).resolve().parents[1])
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                if httpx.get(base + "/api/v1/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("server did not start")
            time.sleep(0.1)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class LocalCluster:
    """``with LocalCluster(workdir, workers=4) as c: c.run_job(spec)``."""

    workdir: Path
    workers: int = 4
    agents: int = 2
    port: int = 0
    admin_token: str = field(default_factory=lambda: "ef_" + secrets.token_urlsafe(24))
    host: str = "127.0.0.1"
    rebalance_interval_s: float = 0.25
    worker_env: dict[str, str] = field(
        default_factory=lambda: {"EVENFLOW_TELEMETRY_S": "0.25", "EVENFLOW_PLAN_POLL_S": "0.25"}
    )
    url: str = ""
    client: ApiClient = field(init=False)
    app: Any = None
    """The control plane's app (``server.app.create_app``), once started."""
    _server: uvicorn.Server | None = None
    _threads: list[threading.Thread] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _http: list[httpx.Client] = field(default_factory=list)
    agent_processes: bool = False
    """Run each agent as a process of its own (see the module docstring), not a thread."""
    cuda: bool = False
    """Offer this machine's CUDA devices as torch finds them (one agent, NCCL ranks; ``workers``
    and ``agents`` are then ignored) instead of ``workers`` CPU slots (gloo)."""
    agents_by_name: dict[str, tuple[str, int]] = field(default_factory=dict)
    """Host name -> (agent token, CPU devices)."""
    _agent_procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.cuda and self.agent_processes:  # before anything starts
            raise ValueError("cuda=True runs its one agent as a thread, not agent_processes")

    def __enter__(self) -> LocalCluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        settings = Settings(
            database_url=f"sqlite:///{self.workdir / 'evenflow.db'}",
            admin_token=self.admin_token,
            rebalance_interval_s=self.rebalance_interval_s,
        )
        self.app = create_app(settings)
        self._server = uvicorn.Server(
            uvicorn.Config(
                self.app,
                host=self.host,
                port=self.port,
                log_level="warning",
                timeout_graceful_shutdown=3,
            )
        )
        self._start(self._server.run)
        self.url = f"http://{self.host}:{self.port}"
        self.client = ApiClient(self._client(self.admin_token), self.admin_token)
        self._wait_healthy()
        per_agent = [
            self.workers // self.agents + (1 if i < self.workers % self.agents else 0)
            for i in range(self.agents)
        ]
        if self.cuda:
            per_agent = [1]
        else:  # every agent here shares this machine's CPUs: split them over all the workers
            self.worker_env.setdefault("OMP_NUM_THREADS", worker_threads(self.workers, os.environ))
        for i, n in enumerate(n for n in per_agent if n):
            name = f"local-{chr(ord('a') + i)}"
            token = self.client.create_token(
                TokenCreate(name=f"agent-{name}", role=Role.AGENT, host=name)
            ).token
            self.agents_by_name[name] = (token, n)
            if self.agent_processes:
                self.start_agent(name)
                continue
            agent = Agent(
                ApiClient(self._client(token), token),
                name=name,
                address="127.0.0.1",
                devices=discover_devices(None if self.cuda else n),
                server_url=self.url,
                token=token,
                workdir=self.workdir / name,
                extra_env=self.worker_env,
            )
            agent.register()
            self._start(agent.run, self._stop, 0.25)
        if self.agent_processes:
            self._wait_registered(list(self.agents_by_name))
        return self

    def __exit__(self, *exc: object | TracebackType) -> None:
        self._stop.set()
        for proc in self._agent_procs.values():  # SIGTERM: it stops its workers, then exits
            if proc.poll() is None:
                proc.terminate()
        for name, proc in self._agent_procs.items():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                log.warning("agent %s did not stop; killing it", name)
                self.kill_agent(name)
        for t in self._threads[1:]:
            t.join(timeout=30)
        if self._server is not None:
            context_of(self.app).plan_waiters.close()  # held long-polls answer now
            self._server.should_exit = True
            self._threads[0].join(timeout=30)
        for h in self._http:
            h.close()

    # ------------------------------------------------------------------ agent processes
    def start_agent(self, name: str) -> int:
        """Start (or start again) the agent process of host ``name`` with its token and
        workdir; returns its pid. Needs ``agent_processes``."""
        if not self.agent_processes:
            raise RuntimeError("start_agent needs LocalCluster(agent_processes=True)")
        old = self._agent_procs.get(name)
        if old is not None and old.poll() is None:
            raise RuntimeError(f"the agent of {name} is running (pid {old.pid})")
        token, devices = self.agents_by_name[name]
        config = {
            "server": self.url,
            "name": name,
            "devices": devices,
            "workdir": str(self.workdir / name),
            "interval_s": 0.25,
            "worker_env": self.worker_env,
        }
        env = {**os.environ, "EVENFLOW_TOKEN": token}
        with (self.workdir / f"{name}.agent.log").open("ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "evenflow.local_cluster", json.dumps(config)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=Path(__file__).resolve().parents[1],
            )
        self._agent_procs[name] = proc
        return proc.pid

    def agent_pid(self, name: str) -> int | None:
        proc = self._agent_procs.get(name)
        return proc.pid if proc is not None and proc.poll() is None else None

    def kill_agent(self, name: str) -> list[int]:
        """Take host ``name`` down as a crash would: SIGKILL to its agent's process group and,
        at the same moment, to the process group of every worker it launched (each runs in a
        session of its own). Returns the pids killed (the agent's first)."""
        proc = self._agent_procs.get(name)
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"no agent of {name} is running")
        workers = self._workers_of_agent(proc.pid)
        killed = [proc.pid, *workers]
        os.killpg(proc.pid, signal.SIGKILL)
        for pid in workers:
            with suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        proc.wait()
        return killed

    def _workers_of_agent(self, agent_pid: int) -> list[int]:
        return [
            pid
            for pid, env in _worker_environments()
            if env.get("EVENFLOW_AGENT_PID") == str(agent_pid)
        ]

    def _wait_registered(self, names: list[str], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            hosts = {h.name: h for h in self.client.hosts().items}
            if all(n in hosts for n in names):
                return
            for n in names:
                proc = self._agent_procs[n]
                if proc.poll() is not None:
                    raise RuntimeError(f"the agent of {n} exited with {proc.returncode}")
            time.sleep(0.1)
        raise RuntimeError(f"agents {names} did not register within {timeout_s} s")

    def _client(self, token: str) -> httpx.Client:
        h = httpx.Client(
            base_url=self.url or f"http://{self.host}:{self.port}",
            timeout=30.0,
            headers={"Authorization": f"Bearer {token}"},
        )
        self._http.append(h)
        return h

    def _start(self, target: Callable[..., Any], *args: Any) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        t.start()
        self._threads.append(t)

    def _wait_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                self.client.health()
                return
            except (httpx.TransportError, Exception):
                time.sleep(0.1)
        raise RuntimeError(f"the control plane at {self.url} did not start")

    def worker_pids(self, job_id: int) -> dict[int, int]:
        """rank -> pid of this cluster's live worker processes of a job (Linux: read from
        ``/proc``), for fault-injection tests and benchmarks."""
        return {
            int(env["RANK"]): pid
            for pid, env in _worker_environments()
            if env.get("EVENFLOW_SERVER") == self.url and env.get("EVENFLOW_JOB_ID") == str(job_id)
        }

    def worker_hosts(self, job_id: int) -> dict[int, str]:
        """rank -> host name (``local-a``, ...) of this cluster's live workers of a job."""
        return {
            int(env["RANK"]): Path(env["EVENFLOW_JOB_DIR"]).parent.name
            for _, env in _worker_environments()
            if env.get("EVENFLOW_SERVER") == self.url and env.get("EVENFLOW_JOB_ID") == str(job_id)
        }

    def submit(self, spec: JobSpec) -> JobOut:
        return self.client.submit(spec)

    def last_iteration(self, job_id: int, after: int = -1) -> int:
        """The newest iteration rank 0 has reported (``after`` if none newer)."""
        since = after + 1
        page = self.client.telemetry(job_id, since_iteration=since, rank=0, limit=MAX_PAGE)
        if page.total > len(page.items):  # more than a page since ``after``: read the last row
            last = page.total - 1
            page = self.client.telemetry(
                job_id, since_iteration=since, rank=0, limit=1, offset=last
            )
        return page.items[-1].iteration if page.items else after

    def wait(
        self,
        job_id: int,
        on_progress: Callable[[int], None] | None = None,
        poll_s: float = 0.5,
        timeout_s: float = 3600.0,
    ) -> JobOut:
        """Block until the job ends, calling ``on_progress(iterations done)`` as it advances."""
        deadline = time.monotonic() + timeout_s
        last = -1
        while time.monotonic() < deadline:
            job = self.client.job(job_id)
            last = self.last_iteration(job_id, last)
            if on_progress is not None:
                on_progress(last + 1)
            if job.status.terminal:
                return job
            time.sleep(poll_s)
        raise TimeoutError(f"job {job_id} did not finish in {timeout_s} s")


def _worker_environments() -> Iterator[tuple[int, dict[str, str]]]:
    """(pid, environment) of every live ``agent.runtime.worker`` process this user can read."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "environ").read_bytes()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"agent.runtime.worker" not in cmdline:
            continue
        env = dict(v.split("=", 1) for v in raw.decode(errors="replace").split("\0") if "=" in v)
        yield int(entry.name), env


def _agent_main(argv: Sequence[str]) -> None:
    """One local agent as a process (``LocalCluster.start_agent``): its token from
    ``EVENFLOW_TOKEN``, everything else from the JSON in ``argv[0]``."""
    from agent.daemon import run_agent

    config = json.loads(argv[0])
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    run_agent(
        config["server"],
        os.environ["EVENFLOW_TOKEN"],
        config["name"],
        "127.0.0.1",
        discover_devices(cpu_workers=int(config["devices"])),
        Path(config["workdir"]),
        interval_s=float(config["interval_s"]),
        extra_env=config["worker_env"],
    )


if __name__ == "__main__":
    _agent_main(sys.argv[1:])
