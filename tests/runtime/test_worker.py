"""``python -m agent.runtime.worker`` as the agent daemon will launch it: two processes, env vars,
a real (tiny, in-test) HTTP control plane, and a user entrypoint with its own loop."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from agent.runtime.worker import worker_main
from contract.agent import MetricBatch, PlanOut, TelemetryBatch
from contract.enums import PlanSource

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
JOB, TOKEN, B, ITERATIONS, SWITCH_AFTER = 5, "tok-123", 16, 40, 4


class ControlPlane(ThreadingHTTPServer):
    """Serves v1 = [8, 8]; once telemetry passes SWITCH_AFTER, v2 = [16, 0] (rank 1 idle)."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.lock = threading.Lock()
        self.rows: dict[tuple[int, int], tuple[int, int]] = {}
        self.losses: dict[tuple[int, int], float] = {}
        """(rank, iteration) -> the loss metric posted."""
        self.unauthorised = 0
        self.version = 1

    def plan(self) -> PlanOut:
        return PlanOut(
            job_id=JOB,
            version=self.version,
            batch_sizes=[8, 8] if self.version == 1 else [16, 0],
            global_batch=B,
            source=PlanSource.AUTOMATIC,
            reason="test",
            created_at=datetime.now(UTC),
        )


class Handler(BaseHTTPRequestHandler):
    server: ControlPlane

    def _authorised(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {TOKEN}":
            return True
        with self.server.lock:
            self.server.unauthorised += 1
        self._send(401, b'{"detail": "bad token"}')
        return False

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        # The runtime long-polls (known_version, wait_s); this plane answers at once.
        if self._authorised() and urlsplit(self.path).path == f"/api/v1/jobs/{JOB}/plan":
            with self.server.lock:
                self._send(200, self.server.plan().model_dump_json().encode())

    def do_POST(self) -> None:
        if self._authorised() and self.path == f"/api/v1/jobs/{JOB}/metrics":
            body = self.rfile.read(int(self.headers["Content-Length"]))
            points = MetricBatch.model_validate_json(body).points
            with self.server.lock:
                self.server.losses.update(
                    {(p.rank, p.iteration): p.value for p in points if p.name == "loss"}
                )
            self._send(200, json.dumps({"accepted": len(points), "duplicates": 0}).encode())
            return
        if not self._authorised() or self.path != f"/api/v1/jobs/{JOB}/telemetry":
            return
        body = self.rfile.read(int(self.headers["Content-Length"]))
        batch = TelemetryBatch.model_validate_json(body)
        with self.server.lock:
            for r in batch.all_records():
                self.server.rows[(r.rank, r.iteration)] = (r.plan_version, r.batch_size)
            if any(i >= SWITCH_AFTER for _, i in self.server.rows):
                self.server.version = 2
        self._send(
            200, json.dumps({"accepted": len(batch.all_records()), "duplicates": 0}).encode()
        )

    def log_message(self, format: str, *args: object) -> None:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_two_worker_processes_against_an_http_control_plane(tmp_path: Path) -> None:
    server = ControlPlane()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    spec = {
        "name": "worker-test",
        "workload": {"entrypoint": "user_workload:train", "args": {"samples": 400}},
        "global_batch": B,
        "iterations": ITERATIONS,
        "workers": 2,
        "emulation": [{"per_sample_ms": 1.0}, {"per_sample_ms": 1.0}],
    }
    port = free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)]),
            "EVENFLOW_SERVER": f"http://127.0.0.1:{server.server_port}",
            "EVENFLOW_TOKEN": TOKEN,
            "EVENFLOW_JOB_ID": str(JOB),
            "EVENFLOW_SPEC": json.dumps(spec),
            "EVENFLOW_RESULT": str(tmp_path / f"rank{rank}.json"),
            "EVENFLOW_PLAN_POLL_S": "0.02",
            "EVENFLOW_TELEMETRY_S": "0.02",
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "agent.runtime.worker"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        outputs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
        server.shutdown()
        server.server_close()
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out
    assert "EMULATED run" in outputs[0]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert server.unauthorised == 0
    assert set(server.rows) == {(r, i) for r in range(2) for i in range(ITERATIONS)}
    assert results[0]["plan_history"] == results[1]["plan_history"]
    assert [v for _, v in results[0]["plan_history"]] == [1, 2]
    switch = results[0]["plan_history"][1][0]
    for i in range(ITERATIONS):
        v0, b0 = server.rows[(0, i)]
        v1, b1 = server.rows[(1, i)]
        assert v0 == v1 == (1 if i < switch else 2)
        assert b0 + b1 == B
    assert results[1]["samples_seen"] == 8 * switch  # nothing after v2 gave it 0 samples
    assert results[0]["final_loss"] < 0.2 * results[0]["losses"][0][1]
    assert results[0]["emulated"] and results[0]["telemetry"]["pending"] == 0
    # rank 0 leads throughout and posted the global loss of every iteration (CPU: each is read)
    assert server.losses == {(0, i): loss for i, loss in results[0]["losses"]}
    assert sorted(i for _, i in server.losses) == list(range(ITERATIONS))
    assert all(r["metrics"]["pending"] == 0 and r["metrics"]["dropped"] == 0 for r in results)


def test_worker_refuses_an_incomplete_or_bad_environment(caplog: pytest.LogCaptureFixture) -> None:
    assert worker_main({"RANK": "0"}) == 2
    assert "EVENFLOW_SERVER" in caplog.text
    env = {
        "EVENFLOW_SERVER": "http://x",
        "EVENFLOW_TOKEN": "t",
        "EVENFLOW_JOB_ID": "1",
        "EVENFLOW_SPEC": '{"name": "x"}',
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }
    assert worker_main(env) == 2
    assert "bad worker environment" in caplog.text
