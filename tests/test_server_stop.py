"""`evenflow server` stopping: the requests it holds open are answered, not cut off."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from evenflow.local_cluster import free_port
from tests.harness import ADMIN_TOKEN, ROOT, job_with_plan

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _start(tmp_path: Path, workers: int) -> tuple[str, subprocess.Popen[str]]:
    """``evenflow server`` with its output captured; its root URL and process."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "EVENFLOW_DATABASE_URL": f"sqlite:///{tmp_path / 'stop.db'}",
        "EVENFLOW_ADMIN_TOKEN": ADMIN_TOKEN,
    }
    port = free_port()
    cmd = [sys.executable, "-m", "evenflow.cli", "server", "--port", str(port)]
    cmd += ["--log-level", "info", "--workers", str(workers)]
    proc = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    root = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(root + "/api/v1/health", timeout=1).status_code == 200:
                return root, proc
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise AssertionError("server did not start:\n" + (proc.communicate()[0] or ""))
        time.sleep(0.1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [1, 2])
def test_a_stopping_server_answers_its_long_polls_and_ends_its_streams(
    tmp_path: Path, workers: int
) -> None:
    root, proc = _start(tmp_path, workers)
    base = root + "/api/v1"
    out: dict[str, Any] = {}
    try:
        job = job_with_plan(root)
        version = int(httpx.get(f"{base}/jobs/{job}/plan", headers=AUTH).json()["version"])

        def long_poll() -> None:
            try:
                r = httpx.get(
                    f"{base}/jobs/{job}/plan",
                    params={"known_version": version, "wait_s": 30},
                    headers=AUTH,
                    timeout=90,
                )
                out["poll"] = (r.status_code, time.monotonic())
            except httpx.HTTPError as exc:
                out["poll"] = (repr(exc), time.monotonic())

        def stream() -> None:
            try:
                url = f"{base}/jobs/{job}/stream"
                with httpx.stream("GET", url, params={"max_s": 60}, headers=AUTH, timeout=90) as r:
                    out["stream_status"] = r.status_code
                    for _ in r.iter_lines():
                        pass
                out["stream"] = ("closed", time.monotonic())
            except httpx.HTTPError as exc:
                out["stream"] = (repr(exc), time.monotonic())

        threads = [threading.Thread(target=f) for f in (long_poll, stream)]
        for t in threads:
            t.start()
        time.sleep(1.5)  # both are held by the server now
        assert "poll" not in out and out.get("stream_status") == 200
        stopped_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        log, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    status, polled_at = out["poll"]
    assert status == 304, (status, log)  # the plan is unchanged: answered, not cut off
    assert polled_at - stopped_at < 2.0
    ended, ended_at = out["stream"]
    assert ended == "closed" and ended_at - stopped_at < 2.0, (ended, log)
    assert "timeout graceful shutdown exceeded" not in log, log
    assert "Traceback" not in log, log
