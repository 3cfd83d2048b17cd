"""A simulated cluster for the dashboard's tests and benchmark: a host registered through the
REST API like an agent would, and workers that post per-iteration telemetry from a thread.

The workers behave like the real runtime where the dashboard can see it: each iteration they
use the plan they were last served (``GET /plan``, 304 while unchanged), switch plans only at an
iteration boundary, all ranks together, and report emulated timings: compute is
``intercept + per_sample * b`` and every rank waits in the all-reduce for the slowest.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from contract.base import PROTOCOL_VERSION


@dataclass
class Cluster:
    """REST helpers with the admin token against a live server."""

    url: str
    admin_token: str
    client: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.client = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {self.admin_token}"},
            timeout=10,
        )

    def close(self) -> None:
        self.client.close()

    def token(self, role: str, *, host: str | None = None, name: str | None = None) -> str:
        body: dict[str, Any] = {"name": name or f"{role}-{uuid.uuid4().hex[:6]}", "role": role}
        if host is not None:
            body["host"] = host
        r = self.client.post("/api/v1/tokens", json=body)
        assert r.status_code == 201, r.text
        return str(r.json()["token"])

    def register(self, name: str, devices: int, model: str = "NVIDIA A100") -> dict[str, Any]:
        token = self.token("agent", host=name)
        body = {
            "protocol_version": PROTOCOL_VERSION,
            "name": name,
            "address": "127.0.0.1",
            "devices": [
                {"index": i, "kind": "cuda", "model": model, "memory_mb": 40960}
                for i in range(devices)
            ],
        }
        r = self.client.post(
            "/api/v1/hosts/register", json=body, headers={"Authorization": f"Bearer {token}"}
        )
        assert r.status_code == 201, r.text
        return {**r.json(), "token": token}

    def submit(self, workers: int, global_batch: int, **extra: Any) -> dict[str, Any]:
        spec = {
            "name": extra.pop("name", "resnet-mixed"),
            "workload": {"builtin": "mlp"},
            "global_batch": global_batch,
            "iterations": 100_000,
            "workers": workers,
            **extra,
        }
        r = self.client.post("/api/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        return self.placed(int(r.json()["id"]))

    def placed(self, job_id: int, timeout_s: float = 30.0) -> dict[str, Any]:
        """The job once the server's controller has tried to place it (a submission pokes it;
        it answers before placement)."""
        deadline = time.monotonic() + timeout_s
        while True:
            job = dict(self.client.get(f"/api/v1/jobs/{job_id}").json())
            tried = "waiting for the controller" not in (job["pending_reason"] or "")
            if job["status"] != "pending" or tried:
                return job
            assert time.monotonic() < deadline, f"job {job_id} was never placed: {job}"
            time.sleep(0.05)

    def mark_running(self, host: dict[str, Any], job: dict[str, Any]) -> None:
        """The host's agent reports every rank of ``job`` it runs as running."""
        reports = [
            {"job_id": job["id"], "rank": w["rank"], "state": "running"}
            for w in job["workers"]
            if w["host_id"] == host["id"]
        ]
        r = self.client.post(
            f"/api/v1/hosts/{host['id']}/heartbeat",
            json={"workers": reports},
            headers={"Authorization": f"Bearer {host['token']}"},
        )
        assert r.status_code == 200, r.text

    def plan(self, job_id: int) -> dict[str, Any]:
        r = self.client.get(f"/api/v1/jobs/{job_id}/plan")
        assert r.status_code == 200, r.text
        return dict(r.json())

    def post_telemetry(self, job_id: int, records: list[dict[str, Any]]) -> None:
        r = self.client.post(f"/api/v1/jobs/{job_id}/telemetry", json={"records": records})
        assert r.status_code == 200, r.text


def emulated_iteration(
    iteration: int,
    plan_version: int,
    batches: list[int],
    per_sample_ms: list[float],
    intercept_ms: float = 4.0,
    allreduce_ms: float = 3.0,
    slowdown: Callable[[int, int], float] = lambda rank, it: 1.0,
    ts: float | None = None,
) -> list[dict[str, Any]]:
    """One iteration's telemetry records of every rank: fast ranks wait for the slowest."""
    busy = [
        (intercept_ms + per_sample_ms[r] * b) * slowdown(r, iteration)
        for r, b in enumerate(batches)
    ]
    slowest = max(busy)
    now = time.time() if ts is None else ts
    return [
        {
            "rank": r,
            "iteration": iteration,
            "plan_version": plan_version,
            "batch_size": b,
            "data_ms": round(0.1 * busy[r], 3),
            "compute_ms": round(0.9 * busy[r], 3),
            "sync_ms": round(slowest - busy[r] + allreduce_ms, 3),
            "ts": now,
        }
        for r, b in enumerate(batches)
    ]


class Workers(threading.Thread):
    """Ranks of one job posting an iteration every ``period_s`` until stopped. They read the
    plan before each iteration and use a new version from that iteration on."""

    def __init__(
        self,
        cluster: Cluster,
        job_id: int,
        per_sample_ms: list[float],
        *,
        period_s: float = 0.1,
        start_iteration: int = 0,
        slowdown: Callable[[int, int], float] = lambda rank, it: 1.0,
        on_post: Callable[[int, float], None] | None = None,
    ) -> None:
        super().__init__(daemon=True, name=f"workers-job-{job_id}")
        self.cluster, self.job_id, self.per_sample_ms = cluster, job_id, per_sample_ms
        self.period_s, self.iteration, self.slowdown = period_s, start_iteration, slowdown
        self.on_post = on_post
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.plan: dict[str, Any] | None = None

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # surfaced by stop()
            self.error = exc

    def _loop(self) -> None:
        client = self.cluster.client
        next_at = time.monotonic()
        while not self.stop_event.is_set():
            known = f"?known_version={self.plan['version']}" if self.plan else ""
            try:
                r = client.get(f"/api/v1/jobs/{self.job_id}/plan{known}")
            except httpx.TransportError:  # like real workers: a slow answer is not a reason to stop
                continue
            if r.status_code == 200:
                self.plan = r.json()
            assert self.plan is not None
            records = emulated_iteration(
                self.iteration,
                self.plan["version"],
                self.plan["batch_sizes"],
                self.per_sample_ms,
                slowdown=self.slowdown,
            )
            sent = time.time()
            try:
                self.cluster.post_telemetry(self.job_id, records)
            except httpx.TransportError:
                continue  # the same iteration again: the server dedups a post that did land
            if self.on_post is not None:
                self.on_post(self.iteration, sent)
            self.iteration += 1
            next_at += self.period_s
            self.stop_event.wait(max(0.0, next_at - time.monotonic()))

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=10)
        if self.error is not None:
            raise self.error
