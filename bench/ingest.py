"""Telemetry ingest rate and current-plan fetch latency against a real uvicorn server.

    python bench/ingest.py [--json] [--backends sqlite,postgresql] [--seconds 10]

For each backend: start `evenflow server` in a subprocess on a fresh database, register a host
with 64 devices and a 64-worker job, then
  1. ingest: 8 concurrent clients post telemetry batches of 500 records as fast as the server
     takes them; report records/s;
  2. plan polling: 256 concurrent pollers each fetch the current plan once a second (the
     runtime's cadence); report p50/p99 latency and the request rate reached.
Targets (issue 2, 2-core machine): >= 50,000 records/s, p99 <= 20 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, text
from stack import TOKEN, server  # bench/ is the script's directory

ROOT = Path(__file__).resolve().parents[1]
PG_ADMIN = os.environ.get(
    "EVENFLOW_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
WORKERS = 64
BATCH = 500
CLIENTS = 8
POLLERS = 256


@contextmanager
def database(backend: str) -> Iterator[str]:
    if backend == "sqlite":
        with tempfile.TemporaryDirectory() as d:
            yield f"sqlite:///{d}/bench.db"
        return
    name = f"evenflow_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield PG_ADMIN.rsplit("/", 1)[0] + "/" + name
    finally:
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def setup_job(base: str) -> int:
    h = {"Authorization": f"Bearer {TOKEN}"}
    devices = [
        {"index": i, "kind": "cpu", "model": "CPU", "memory_mb": 1024} for i in range(WORKERS)
    ]
    r = httpx.post(
        base + "/api/v1/hosts/register",
        headers=h,
        json={
            "protocol_version": 1,
            "name": "bench-host",
            "address": "127.0.0.1",
            "devices": devices,
        },
    )
    r.raise_for_status()
    r = httpx.post(
        base + "/api/v1/jobs",
        headers=h,
        json={
            "name": "bench",
            "workload": {"builtin": "mlp"},
            "global_batch": 4096,
            "iterations": 10**8,
            "workers": WORKERS,
        },
    )
    r.raise_for_status()
    return int(r.json()["id"])


def bodies(client: int, count: int) -> list[bytes]:
    """Pre-encoded batches so the clients spend their CPU on sending, not on JSON."""
    out = []
    per_iter = WORKERS
    for b in range(count):
        recs = []
        for k in range(BATCH):
            n = b * BATCH + k
            it = client * 10**7 + n // per_iter
            recs.append(
                {
                    "rank": n % per_iter,
                    "iteration": it,
                    "plan_version": 1,
                    "batch_size": 64,
                    "data_ms": 1.5,
                    "compute_ms": 20.0 + random.random(),
                    "sync_ms": 3.0,
                    "ts": 1.7e9 + n,
                }
            )
        out.append(json.dumps({"records": recs}).encode())
    return out


async def ingest(base: str, job: int, seconds: float) -> dict[str, Any]:
    per_client = max(4, int(seconds * 15))
    payloads = [bodies(c, per_client) for c in range(CLIENTS)]
    h = {"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    accepted = 0
    latencies: list[float] = []

    async def client(c: int, http: httpx.AsyncClient) -> None:
        nonlocal accepted
        for body in payloads[c]:
            t0 = time.perf_counter()
            r = await http.post(f"/api/v1/jobs/{job}/telemetry", content=body, headers=h)
            latencies.append(time.perf_counter() - t0)
            r.raise_for_status()
            accepted += r.json()["accepted"]

    async with httpx.AsyncClient(
        base_url=base, timeout=60, limits=httpx.Limits(max_connections=CLIENTS)
    ) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c, http) for c in range(CLIENTS)))
        wall = time.perf_counter() - t0
    total = CLIENTS * per_client * BATCH
    assert accepted == total, f"accepted {accepted} of {total}"
    latencies.sort()
    return {
        "records": total,
        "seconds": round(wall, 2),
        "records_per_s": round(total / wall),
        "batch_p50_ms": round(1000 * latencies[len(latencies) // 2], 1),
        "batch_p99_ms": round(1000 * latencies[int(len(latencies) * 0.99)], 1),
    }


async def poll(base: str, job: int, seconds: float, interval: float = 1.0) -> dict[str, Any]:
    h = {"Authorization": f"Bearer {TOKEN}"}
    lat: list[float] = []
    end = time.monotonic() + seconds

    async def poller(http: httpx.AsyncClient) -> None:
        await asyncio.sleep(random.random() * interval)
        while time.monotonic() < end:
            t0 = time.perf_counter()
            r = await http.get(f"/api/v1/jobs/{job}/plan", headers=h)
            lat.append(time.perf_counter() - t0)
            r.raise_for_status()
            await asyncio.sleep(max(0.0, interval - (time.perf_counter() - t0)))

    async with httpx.AsyncClient(
        base_url=base, timeout=30, limits=httpx.Limits(max_connections=POLLERS)
    ) as http:
        await asyncio.gather(*(poller(http) for _ in range(POLLERS)))
    lat.sort()
    return {
        "requests": len(lat),
        "requests_per_s": round(len(lat) / seconds),
        "p50_ms": round(1000 * statistics.median(lat), 2),
        "p99_ms": round(1000 * lat[int(len(lat) * 0.99)], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="sqlite,postgresql")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results: dict[str, Any] = {}
    for backend in args.backends.split(","):
        # Plan polling in steady state, on a server of its own: the target.
        with database(backend) as url, server(url) as base:
            steady = asyncio.run(poll(base, setup_job(base), args.seconds))
        # Ingest, then polling again while the control loop digests that flood (far more than
        # one 64-worker job sends): reported beside the target, not instead of it.
        with database(backend) as url, server(url) as base:
            job = setup_job(base)
            flood = asyncio.run(ingest(base, job, args.seconds))
            results[backend] = {
                "ingest": flood,
                "plan_poll": steady,
                "plan_poll_after_flood": asyncio.run(poll(base, job, args.seconds)),
            }
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(
        f"{'backend':<11} {'records/s':>10} {'batch p50':>10} {'batch p99':>10} "
        f"{'poll req/s':>10} {'poll p50':>9} {'poll p99':>9}   after flood p50 / p99"
    )
    for backend, r in results.items():
        i, p, f = r["ingest"], r["plan_poll"], r["plan_poll_after_flood"]
        print(
            f"{backend:<11} {i['records_per_s']:>10} {i['batch_p50_ms']:>8}ms {i['batch_p99_ms']:>8}ms "
            f"{p['requests_per_s']:>10} {p['p50_ms']:>7}ms {p['p99_ms']:>7}ms   "
            f"{f['p50_ms']}ms / {f['p99_ms']}ms"
        )
    print(
        "targets: >= 50000 records/s; plan fetch p99 <= 20 ms (8 ingest clients, 256 pollers at 1/s)"
    )


if __name__ == "__main__":
    main()
