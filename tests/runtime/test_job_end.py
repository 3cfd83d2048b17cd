"""A worker whose job ended on the control plane stops: its telemetry is answered 409 (or its
credential, dead with the job, 401), and the rank ends without a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from torch.utils.data import DataLoader

from agent.runtime.remote import RemoteControlPlane
from agent.runtime.telemetry import TelemetryClosed, TelemetrySender
from contract.agent import WORKER_EXIT_JOB_ENDED, TelemetryBatch
from contract.base import PROTOCOL_VERSION
from contract.enums import Role
from tests.harness import ROOT, Api, LiveServer, free_port, telemetry_record


def _placed(
    client: httpx.Client,
    admin: str,
    workers: int,
    spec: dict[str, Any],
    place: Callable[[], object] | None = None,
) -> Any:
    """Register a host as its agent, submit a job there and wait until it is placed (``place``
    runs a placement round where no controller runs on its own); (job id, agent token, worker
    tokens)."""
    auth = {"Authorization": f"Bearer {admin}"}
    r = client.post(
        "/api/v1/tokens", json={"name": "a", "role": Role.AGENT.value, "host": "h"}, headers=auth
    )
    agent = {"Authorization": f"Bearer {r.json()['token']}"}
    body = {
        "protocol_version": PROTOCOL_VERSION,
        "name": "h",
        "address": "127.0.0.1",
        "devices": [
            {"index": i, "kind": "cpu", "model": "CPU", "memory_mb": 1024} for i in range(workers)
        ],
    }
    host = client.post("/api/v1/hosts/register", json=body, headers=agent).json()
    job = client.post("/api/v1/jobs", json=spec, headers=auth).json()
    if place is not None:
        place()
    deadline = time.monotonic() + 30
    while client.get(f"/api/v1/jobs/{job['id']}", headers=auth).json()["status"] == "pending":
        assert time.monotonic() < deadline, "the job was never placed"
        time.sleep(0.05)
    ack = client.post(f"/api/v1/hosts/{host['id']}/heartbeat", json={}, headers=agent).json()
    tokens = {a["rank"]: a["worker_token"] for a in ack["assignments"]}
    return job["id"], agent["Authorization"].split()[1], tokens


SPEC = {"name": "j", "workload": {"builtin": "mlp"}, "global_batch": 16, "workers": 1}


def test_telemetry_after_the_job_ended_closes_the_sender(api: Api) -> None:
    admin = api.headers()["Authorization"].split()[1]
    job_id, agent_token, tokens = _placed(
        api.client, admin, 1, {**SPEC, "iterations": 10}, api.place
    )
    batch = TelemetryBatch(records=[telemetry_record(0, 0)])
    mine = RemoteControlPlane(api.client, "http://testserver", tokens[0], job_id)
    agent = RemoteControlPlane(api.client, "http://testserver", agent_token, job_id)
    assert mine.post_telemetry(batch).accepted == 1
    api.client.post(f"/api/v1/jobs/{job_id}/cancel", headers=api.headers())
    with pytest.raises(TelemetryClosed, match="has ended"):
        mine.post_telemetry(batch)  # 401: the credential died with the job
    with pytest.raises(TelemetryClosed, match="has ended"):
        agent.post_telemetry(batch)  # 409

    sender = TelemetrySender(mine.post_telemetry, flush_records=1, backoff_initial_s=0.01)
    sender.submit(telemetry_record(0, 1))
    deadline = time.monotonic() + 10
    with pytest.raises(TelemetryClosed):
        while time.monotonic() < deadline:
            sender.submit(telemetry_record(0, 2))
            time.sleep(0.01)
    stats = sender.close(deadline_s=1)
    assert stats.delivered == 0 and stats.posts == 0
    assert stats.submitted == stats.delivered + stats.dropped + stats.pending


def test_a_loop_left_because_the_job_ended_closes_without_a_second_error() -> None:
    """The user's body meets the job's end (a metric's report raised); closing the loop then completes
    the iteration, whose record the closed sender refuses too: that refusal is not raised out of
    the generator's close (Python would print it as an ignored exception with a traceback)."""
    from tests.runtime.test_loop import TinyLM, Tokens, context, pad, token_loss

    def ended(_: object) -> None:
        raise TelemetryClosed("job 1 has ended (cancelled)")

    ctx = context(0, 1, [], iterations=3, submit=ended, submit_metric=ended)
    model, _ = ctx.prepare(TinyLM())
    batches = ctx.batches(DataLoader(Tokens(), collate_fn=pad))
    batch = next(batches)
    with pytest.raises(TelemetryClosed):  # the update is made, then the loss's report refused
        ctx.step(token_loss(model, batch)[0])
    assert ctx.sync_gradients
    with pytest.raises(TelemetryClosed):
        ctx.log("acc", 1.0)
    batches.close()  # what the garbage collector does with the abandoned loop: must not raise


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_worker_stops_cleanly_when_its_job_is_cancelled(live_server: LiveServer) -> None:
    with httpx.Client(base_url=live_server.url, timeout=10) as client:
        spec = {**SPEC, "iterations": 1_000_000}
        job_id, _, tokens = _placed(client, live_server.admin_token, 1, spec)
        env = {
            "PATH": os.environ["PATH"],
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "EVENFLOW_SERVER": live_server.url,
            "EVENFLOW_TOKEN": tokens[0],
            "EVENFLOW_JOB_ID": str(job_id),
            "EVENFLOW_SPEC": json.dumps(spec),
            "EVENFLOW_TELEMETRY_S": "0.2",
            "RANK": "0",
            "WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "agent.runtime.worker"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            auth = {"Authorization": f"Bearer {live_server.admin_token}"}
            deadline = time.monotonic() + 60
            while not client.get(f"/api/v1/jobs/{job_id}/telemetry", headers=auth).json()["items"]:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
            assert client.post(f"/api/v1/jobs/{job_id}/cancel", headers=auth).status_code == 200
            out, _ = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == WORKER_EXIT_JOB_ENDED, out
    assert f"job {job_id} has ended on the control plane" in out
    assert "Traceback" not in out
