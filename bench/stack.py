"""`evenflow server` in a subprocess, for benchmarks that measure it over real HTTP."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from server.local_cluster import free_port

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "ef_bench-admin-token-0123456789"


@contextmanager
def server(
    db_url: str, extra_env: Mapping[str, str] | None = None, args: Sequence[str] = ()
) -> Iterator[str]:
    """A control plane on a free port (hosts never marked lost); yields its base URL."""
    port = free_port()
    env = {
        **os.environ,
        "EVENFLOW_DATABASE_URL": db_url,
        "EVENFLOW_ADMIN_TOKEN": TOKEN,
        "EVENFLOW_HOST_LOST_AFTER_S": "86400",
        **(extra_env or {}),
    }
    cmd = [
        sys.executable,
        "-m",
        "agent.cli",
        "server",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *args,
    ]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(base + "/api/v1/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("server did not start")
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
