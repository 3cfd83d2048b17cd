"""Telemetry ingest rate and current-plan fetch latency against a real uvicorn server.

    python bench/ingest.py [--json] [--backends sqlite,postgresql] [--seconds 10] [--workers N]
                           [--form columns|records]

For each backend: start `evenflow server` (API process(es) plus its controller process) in a
subprocess on a fresh database, register a host with 64 devices and a 64-worker job, then
  1. plan polling: 256 concurrent pollers each fetch the current plan once a second (the
     runtime's old cadence, full body); report p50/p99 latency and the request rate reached;
  2. plan delivery: 256 long-polls (`known_version` + `wait_s`, what the runtime does now)
     while 5 overrides commit new plans a second apart; report the time from sending an
     override to each poller holding the new plan;
and on a second server:
  3. ingest: 8 concurrent clients post telemetry batches of 500 records as fast as the server
     takes them, as one array per field (``--form columns``, what the runtime posts) or as
     one object per record (``--form records``); report records/s and the batch latency;
  4. plan polling again right after that flood, while the controller digests it.
Latencies are client-observed; beside them, in brackets, the app's own time until its response
started (the `Server-Timing` header every response carries): the rest is the connection,
uvicorn's HTTP parsing, the event loop's queue and the load generator's own scheduling.

The load generator is this process: one asyncio loop, one keep-alive aiohttp connection per
client (`Http`; httpx's pure-Python client cost several times the CPU per request and was most
of the old poll tail), on the same 2 cores as the server, so its scheduling delay is inside the
client-side figures. Run it alone:
`flock /tmp/evenflow-bench.lock python bench/ingest.py`.
Targets (issue 2, 2-core machine): >= 50,000 records/s, p99 <= 20 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from sqlalchemy import create_engine, text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.stack import TOKEN, server  # (a script, or imported by another bench)
from contract.base import PROTOCOL_VERSION

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
            "protocol_version": PROTOCOL_VERSION,
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
    job = int(r.json()["id"])
    # Placed by the controller's placement thread, not by the submission: wait for its plan.
    deadline = time.monotonic() + 60
    while httpx.get(f"{base}/api/v1/jobs/{job}/plan", headers=h).status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job} was not placed within 60 s")
        time.sleep(0.1)
    return job


def bodies(client: int, count: int, form: str = "columns") -> list[bytes]:
    """Pre-encoded batches so the clients spend their CPU on sending, not on JSON; ``columns``
    (one array per field, what the runtime posts) or ``records`` (one object per record)."""
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
        if form == "columns":
            body: dict[str, Any] = {"columns": {f: [r[f] for r in recs] for f in recs[0]}}
        else:
            body = {"records": recs}
        out.append(json.dumps(body).encode())
    return out


class Http:
    """One keep-alive connection through aiohttp (its C-accelerated HTTP client costs a fraction
    of httpx's CPU per request), so the load generator, which shares the 2 cores with the
    server, adds less of its own scheduling delay to what it measures."""

    def __init__(self, base: str, headers: dict[str, str]) -> None:
        self.base, self.headers = base, headers
        self._session: aiohttp.ClientSession | None = None

    async def request(
        self, method: str, path: str, body: bytes = b""
    ) -> tuple[int, dict[str, str], bytes]:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                self.base, headers=self.headers, connector=aiohttp.TCPConnector(limit=1)
            )
        kw: dict[str, Any] = {}
        if body:
            kw = {"data": body, "headers": {"content-type": "application/json"}}
        async with self._session.request(method, path, **kw) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def server_s(headers: dict[str, str], into: list[float]) -> None:
    """The app's own time from the Server-Timing header (``app;dur=ms``), when it sends one."""
    if "server-timing" in headers:
        into.append(float(headers["server-timing"].split("dur=", 1)[1]) / 1000)


def quantiles(values: list[float], prefix: str = "") -> dict[str, float]:
    if not values:
        return {}
    v = sorted(values)
    return {
        f"{prefix}p50_ms": round(1000 * statistics.median(v), 2),
        f"{prefix}p99_ms": round(1000 * v[int(len(v) * 0.99)], 2),
    }


AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def ingest(base: str, job: int, seconds: float, form: str = "columns") -> dict[str, Any]:
    per_client = max(4, int(seconds * 15))
    payloads = [bodies(c, per_client, form) for c in range(CLIENTS)]
    accepted = 0
    latencies: list[float] = []
    server: list[float] = []

    async def client(c: int) -> None:
        nonlocal accepted
        http = Http(base, AUTH)
        for body in payloads[c]:
            t0 = time.perf_counter()
            status, headers, content = await http.request(
                "POST", f"/api/v1/jobs/{job}/telemetry", body
            )
            latencies.append(time.perf_counter() - t0)
            assert status == 200, content
            server_s(headers, server)
            accepted += json.loads(content)["accepted"]
        await http.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(CLIENTS)))
    wall = time.perf_counter() - t0
    total = CLIENTS * per_client * BATCH
    assert accepted == total, f"accepted {accepted} of {total}"
    return {
        "records": total,
        "seconds": round(wall, 2),
        "records_per_s": round(total / wall),
        **quantiles(latencies, "batch_"),
        **quantiles(server, "batch_server_"),
    }


async def poll(base: str, job: int, seconds: float, interval: float = 1.0) -> dict[str, Any]:
    """256 pollers, each fetching the current plan (no known version: the full body) once a
    second, as the runtime did before the long-poll: the issue's target. Each opens its
    keep-alive connection first (one untimed health request, as a running worker holds one),
    and the timed polls start together after that, each at a random phase of the second."""
    lat: list[float] = []
    server: list[float] = []
    end = time.monotonic() + seconds

    async def poller() -> None:
        http = Http(base, AUTH)
        await asyncio.sleep(random.random() * interval)
        await http.request("GET", "/api/v1/health")  # connect first, as a runtime has
        await start.wait()
        await asyncio.sleep(random.random() * interval)
        while time.monotonic() < end:
            t0 = time.perf_counter()
            status, headers, content = await http.request("GET", f"/api/v1/jobs/{job}/plan")
            lat.append(time.perf_counter() - t0)
            assert status == 200, content
            server_s(headers, server)
            await asyncio.sleep(max(0.0, interval - (time.perf_counter() - t0)))
        await http.close()

    async def starter() -> None:
        nonlocal end
        await asyncio.sleep(interval + 0.5)
        end = time.monotonic() + seconds
        start.set()

    start = asyncio.Event()
    await asyncio.gather(starter(), *(poller() for _ in range(POLLERS)))
    return {
        "requests": len(lat),
        "requests_per_s": round(len(lat) / seconds),
        **quantiles(lat),
        **quantiles(server, "server_"),
    }


async def delivery(base: str, job: int, plans: int = 5) -> dict[str, Any]:
    """256 long-polls (`known_version` + `wait_s`) waiting while an operator's override
    commits `plans` new plans one second apart: from sending the override to each poller
    holding the new plan."""
    sent: dict[int, float] = {}
    got: list[tuple[int, float]] = []
    reader = Http(base, AUTH)
    current = json.loads((await reader.request("GET", f"/api/v1/jobs/{job}/plan"))[2])
    await reader.close()
    final = current["version"] + plans

    async def waiter() -> None:
        http = Http(base, AUTH)
        known = current["version"]
        while known < final:
            path = f"/api/v1/jobs/{job}/plan?known_version={known}&wait_s=30"
            status, _, content = await http.request("GET", path)
            if status == 200:
                known = json.loads(content)["version"]
                got.append((known, time.perf_counter()))
        await http.close()

    waiters = [asyncio.create_task(waiter()) for _ in range(POLLERS)]
    await asyncio.sleep(1.0)
    admin = Http(base, AUTH)
    for k in range(plans):
        sizes = [64] * WORKERS
        sizes[k % WORKERS], sizes[(k + 1) % WORKERS] = 60, 68
        body = json.dumps({"kind": "set_batches", "batch_sizes": sizes, "reason": "bench"})
        t0 = time.perf_counter()
        status, _, content = await admin.request(
            "POST", f"/api/v1/jobs/{job}/overrides", body.encode()
        )
        assert status == 201, content  # an override is created
        sent[json.loads(content)["plan"]["version"]] = t0
        await asyncio.sleep(1.0)
    await asyncio.wait_for(asyncio.gather(*waiters), 30)
    await admin.close()
    first = [min(t for v, t in got if v == version) - t0 for version, t0 in sent.items()]
    return {
        "deliveries": len(got),
        **quantiles([t - sent[v] for v, t in got]),
        # What one job's leader sees: the first of the 256 answers (the rest queue behind it).
        "first_median_ms": round(1000 * statistics.median(first), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="sqlite,postgresql")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--no-delivery", action="store_true", help="skip the long-poll phase (older servers)"
    )
    ap.add_argument("--workers", type=int, default=1, help="evenflow server --workers N")
    ap.add_argument(
        "--form",
        choices=("columns", "records"),
        default="columns",
        help="telemetry body form (the runtime posts columns)",
    )
    args = ap.parse_args()
    results: dict[str, Any] = {}
    extra = ["--workers", str(args.workers)] if args.workers > 1 else []
    for backend in args.backends.split(","):
        # Plan polling in steady state, on a server of its own: the target. Then long-polls
        # woken by overrides.
        with database(backend) as url, server(url, args=extra) as base:
            job = setup_job(base)
            steady = asyncio.run(poll(base, job, args.seconds))
            woken = None if args.no_delivery else asyncio.run(delivery(base, job))
        # Ingest, then polling again while the control loop digests that flood (far more than
        # one 64-worker job sends): reported beside the target, not instead of it.
        with database(backend) as url, server(url, args=extra) as base:
            job = setup_job(base)
            flood = asyncio.run(ingest(base, job, args.seconds, args.form))
            results[backend] = {
                "ingest": flood,
                "plan_poll": steady,
                "plan_poll_after_flood": asyncio.run(poll(base, job, args.seconds)),
                "plan_delivery": woken,
            }
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(
        f"{'backend':<11} {'records/s':>9} {'batch p50/p99 (server)':>28}   "
        f"{'poll p50/p99 (server)':>30}   {'after flood p50/p99':>20}   long-poll delivery p50/p99"
    )
    for backend, r in results.items():
        i, p, f, d = r["ingest"], r["plan_poll"], r["plan_poll_after_flood"], r["plan_delivery"]
        print(
            f"{backend:<11} {i['records_per_s']:>9} {_pair(i, 'batch_'):>28}   "
            f"{_pair(p):>30}   {_pair(f, with_server=False):>20}   "
            + (f"{d['p50_ms']} / {d['p99_ms']} (first {d['first_median_ms']})" if d else "-")
        )
    print(
        "targets: >= 50000 records/s; plan fetch p99 <= 20 ms (8 ingest clients, 256 pollers at "
        "1/s); figures in ms, client-observed, the app's own time (Server-Timing) in brackets"
    )


def _pair(r: dict[str, Any], prefix: str = "", with_server: bool = True) -> str:
    text = f"{r[prefix + 'p50_ms']} / {r[prefix + 'p99_ms']}"
    if with_server and f"{prefix}server_p50_ms" in r:
        text += f" ({r[prefix + 'server_p50_ms']} / {r[prefix + 'server_p99_ms']})"
    return text


if __name__ == "__main__":
    main()
