"""A whole Evenflow stack on this machine: the control plane (uvicorn, SQLite) and local agents
whose workers are real ``torch.distributed`` processes (gloo). Used by ``evenflow demo``,
``evenflow compare`` and the benchmarks; nothing in it is a stand-in for a part.
"""

from __future__ import annotations

import logging
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import uvicorn

from agent.client import ApiClient
from agent.daemon import Agent, discover_devices
from contract.api import JobOut, TokenCreate
from contract.base import MAX_PAGE
from contract.enums import Role
from contract.spec import JobSpec
from server.app import create_app
from server.config import Settings

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
    _server: uvicorn.Server | None = None
    _threads: list[threading.Thread] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _http: list[httpx.Client] = field(default_factory=list)

    def __enter__(self) -> LocalCluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        settings = Settings(
            database_url=f"sqlite:///{self.workdir / 'evenflow.db'}",
            admin_token=self.admin_token,
            rebalance_interval_s=self.rebalance_interval_s,
        )
        self._server = uvicorn.Server(
            uvicorn.Config(
                create_app(settings),
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
        for i, n in enumerate(n for n in per_agent if n):
            name = f"local-{chr(ord('a') + i)}"
            token = self.client.create_token(
                TokenCreate(name=f"agent-{name}", role=Role.AGENT, host=name)
            ).token
            agent = Agent(
                ApiClient(self._client(token), token),
                name=name,
                address="127.0.0.1",
                devices=discover_devices(cpu_workers=n),
                server_url=self.url,
                token=token,
                workdir=self.workdir / name,
                extra_env=self.worker_env,
            )
            agent.register()
            self._start(agent.run, self._stop, 0.25)
        return self

    def __exit__(self, *exc: object | TracebackType) -> None:
        self._stop.set()
        for t in self._threads[1:]:
            t.join(timeout=30)
        if self._server is not None:
            self._server.should_exit = True
            self._threads[0].join(timeout=30)
        for h in self._http:
            h.close()

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
        found: dict[int, int] = {}
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
            env = dict(
                v.split("=", 1) for v in raw.decode(errors="replace").split("\0") if "=" in v
            )
            if env.get("EVENFLOW_SERVER") == self.url and env.get("EVENFLOW_JOB_ID") == str(job_id):
                found[int(env["RANK"])] = int(entry.name)
        return found

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
