"""run_training on three gloo ranks against an HTTP control plane that excludes rank 0 (the
leader) and readmits it once it has seen rank 0's probes: the server decides from telemetry alone,
as the real one does."""

from __future__ import annotations

import threading
from collections import Counter
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from agent.runtime.membership import ExclusionOptions
from agent.runtime.remote import RemoteControlPlane
from agent.runtime.trainer import RunResult, RuntimeOptions, run_training
from contract.agent import MetricBatch, PlanOut, TelemetryBatch
from contract.enums import PlanSource
from contract.spec import JobSpec

from .spawn import run_ranks

JOB, B, ITERATIONS, EXCLUDE_AFTER, PROBES_TO_READMIT = 3, 12, 80, 4, 2


class ControlPlane(ThreadingHTTPServer):
    """v1 = [4, 4, 4]; past EXCLUDE_AFTER, v2 excludes rank 0; after its probes, v3 readmits."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.lock = threading.Lock()
        self.rows: dict[tuple[int, int], tuple[int, int, bool]] = {}
        self.duplicates = 0
        self.losses: list[tuple[int, int]] = []
        """(rank, iteration) of every loss metric posted."""
        self.fetches: Counter[str] = Counter()
        self.version = 1

    def plan(self) -> PlanOut:
        sizes, excluded = {1: ([4, 4, 4], []), 2: ([0, 6, 6], [0]), 3: ([4, 4, 4], [])}[
            self.version
        ]
        return PlanOut(
            job_id=JOB,
            version=self.version,
            batch_sizes=sizes,
            excluded=excluded,
            global_batch=B,
            source=PlanSource.AUTOMATIC,
            reason="test",
            created_at=datetime.now(UTC),
        )

    def ingest(self, batch: TelemetryBatch) -> None:
        for r in batch.all_records():
            key = (r.rank, r.iteration)
            self.duplicates += key in self.rows
            self.rows[key] = (r.plan_version, r.batch_size, r.probe)
        if self.version == 1 and any(i >= EXCLUDE_AFTER for _, i in self.rows):
            self.version = 2
        probes = sum(1 for (rank, _), (_, _, p) in self.rows.items() if rank == 0 and p)
        if self.version == 2 and probes >= PROBES_TO_READMIT:
            self.version = 3


class Handler(BaseHTTPRequestHandler):
    server: ControlPlane

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _reply(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        with self.server.lock:
            self.server.fetches[self.headers["Authorization"]] += 1
            self._reply(self.server.plan().model_dump_json().encode())

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        with self.server.lock:
            if self.path.endswith("/metrics"):
                points = MetricBatch.model_validate_json(body).points
                self.server.losses += [(p.rank, p.iteration) for p in points if p.name == "loss"]
            else:
                self.server.ingest(TelemetryBatch.model_validate_json(body))
        self._reply(b'{"accepted": 0, "duplicates": 0}')


def _worker(rank: int, world: int, url: str) -> RunResult:
    spec = JobSpec.model_validate(
        {
            "name": "exclusion-e2e",
            "workload": {"builtin": "mlp", "args": {"samples": 512, "features": 8, "hidden": 16}},
            "global_batch": B,
            "iterations": ITERATIONS,
            "workers": world,
            "emulation": [{"per_sample_ms": 0.0, "intercept_ms": 5.0}] * world,
        }
    )
    options = RuntimeOptions(
        plan_poll_s=0.01,
        telemetry_flush_records=1,
        telemetry_flush_s=0.01,
        exclusion=ExclusionOptions(probe_every=2, poll_s=0.001),
    )
    with httpx.Client(timeout=5.0) as client:
        remote = RemoteControlPlane(client, url, f"tok-{rank}", JOB)
        return run_training(
            spec,
            fetch_plan=remote.fetch_plan,
            post_telemetry=remote.post_telemetry,
            post_metrics=remote.post_metrics,
            options=options,
        )


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_control_plane_excludes_the_leader_and_readmits_it_from_its_probes() -> None:
    server = ControlPlane()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        results = run_ranks(_worker, 3, url, timeout=80)
    finally:
        server.shutdown()
        server.server_close()
    assert server.version == 3, "the run ended before the server readmitted rank 0"
    history = results[0].plan_history
    assert [v for _, v in history] == [1, 2, 3]
    assert all(r.plan_history == history for r in results)
    _, (out, _), (back, _) = history
    assert EXCLUDE_AFTER < out < back < ITERATIONS

    zero, one, two = results
    assert zero.exclusions == [(out, back)] and one.exclusions == two.exclusions == []
    assert zero.probes >= PROBES_TO_READMIT and one.probes == two.probes == 0
    assert zero.iterations == ITERATIONS - (back - out)
    assert all(r.resync_ms and r.regroup_ms for r in results)
    assert one.final_loss == two.final_loss == zero.final_loss

    # the global loss of every iteration once, from whichever rank led: rank 1 while 0 was out
    leaders = dict(sorted((i, k) for k, i in server.losses))
    assert len(server.losses) == len(leaders) == ITERATIONS
    assert all(k == (1 if out <= i < back else 0) for i, k in leaders.items())

    # rank 1 led while rank 0 was out, so it fetched; rank 2 never led
    assert server.fetches["Bearer tok-0"] > 0 and server.fetches["Bearer tok-1"] > 0
    assert server.fetches["Bearer tok-2"] == 0

    # every row arrived once; rank 0's probes sit in its window, between its normal rows
    assert server.duplicates == 0
    rows = server.rows
    for rank in (1, 2):
        assert {i for (k, i) in rows if k == rank} == set(range(ITERATIONS))
    normal = {i for (k, i), (_, _, p) in rows.items() if k == 0 and not p}
    probes = {i: rows[(0, i)] for (k, i), (_, _, p) in rows.items() if k == 0 and p}
    assert normal == set(range(out)) | set(range(back, ITERATIONS))
    assert len(probes) == zero.probes and all(out <= i < back for i in probes)
    assert all(version == 2 and size == 6 for version, size, _ in probes.values())
