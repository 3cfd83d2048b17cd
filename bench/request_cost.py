"""What one request of each kind costs the server, in CPU: the capacity model behind bench/fleet.py.

    python bench/request_cost.py [--hosts 32] [--requests 2000] [--workers 1]

A real `evenflow server` on PostgreSQL with ``--hosts`` simulated hosts of 8 GPUs and four
64-worker jobs placed and running on them (the agents' heartbeats report their ranks running).
Then, one kind at a time, ``--requests`` requests at a concurrency of 8 while the API processes'
and PostgreSQL's CPU time is metered: a steady heartbeat (8 ranks running, nothing to change: answered from memory,
``server.host_answers``), one the database works out (the same ranks, listed in another order
than the last heartbeat),
a telemetry post of one rank's 2 s of iterations (4 rows), a host's post (8 ranks x 4 rows), and
a plan poll that finds the plan unchanged (``wait_s=0``). Reported: CPU ms per request (API
process, PostgreSQL) and what the 1,250-host fleet of issue 16 would keep busy at that cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from sqlalchemy import make_url

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fleet import CpuMeter, Fleet, Server, server
from bench.http_client import LeanClient
from bench.ingest import database

JOBS, JOB_SIZE, ROWS_PER_POST = 4, 64, 4


async def placed(fleet: Fleet) -> None:
    """Submit the jobs and heartbeat every host until every rank of them reports running."""
    for _ in range(JOBS):
        job = await fleet.submit(size=JOB_SIZE)
        assert job is not None, fleet.last_error
        job.started = True  # this bench posts the jobs' telemetry itself, metered
    deadline = time.monotonic() + 120
    while not all(len(j.ranks) == j.size for j in fleet.jobs.values()):
        if time.monotonic() > deadline:
            raise RuntimeError("the jobs were not placed")
        await asyncio.gather(*(fleet.heartbeat(h) for h in fleet.hosts))
        await asyncio.sleep(0.5)
    await asyncio.gather(*(fleet.heartbeat(h) for h in fleet.hosts))  # now reporting running


async def metered(
    srv: Server, database: str, n: int, make: Callable[[int], Awaitable[Any]]
) -> dict[str, float]:
    sem = asyncio.Semaphore(8)

    async def one(i: int) -> None:
        async with sem:
            await make(i)

    cpu = CpuMeter(srv.pid, database)
    t0 = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(n)))
    secs = time.monotonic() - t0
    used = cpu.cores_used()
    return {
        "api_cpu_ms": round(1000 * used["api"] * secs / n, 2),
        "postgres_cpu_ms": round(1000 * used.get("postgres", 0.0) * secs / n, 2),
        "per_s": round(n / secs),
    }


async def run(srv: Server, db_url: str, args: argparse.Namespace) -> dict[str, Any]:
    # the jobs train for an hour: longer than the measurement
    ns = argparse.Namespace(
        hosts=args.hosts, gpus=8, telemetry_per="rank", jobs=JOBS, job_seconds=(3600.0, 3600.0)
    )
    fleet = Fleet(srv.base, ns, db_url)
    fleet.http = LeanClient(srv.base, 64)
    try:
        await fleet.register()
        db = make_url(db_url).database or ""
        cpu, t0 = CpuMeter(srv.pid, db), time.monotonic()
        await placed(fleet)
        jobs = list(fleet.jobs.values())
        busy = [h for h in fleet.hosts if h.reports]
        next_iteration = dict.fromkeys((j.id for j in jobs), 0)
        started, secs, used = sum(j.size for j in jobs), time.monotonic() - t0, cpu.cores_used()
        per_rank = {  # the burst of a job's start: placement, launch and the running reports
            "api_cpu_ms": round(1000 * used["api"] * secs / started, 2),
            "controller_cpu_ms": round(1000 * used.get("controller", 0.0) * secs / started, 2),
            "postgres_cpu_ms": round(1000 * used.get("postgres", 0.0) * secs / started, 2),
        }

        async def rows(job: Any, ranks: list[int]) -> None:
            first = next_iteration[job.id]
            next_iteration[job.id] = first + ROWS_PER_POST
            cols: dict[str, list[Any]] = {k: [] for k in COLUMNS}
            for rank in ranks:
                for it in range(first, first + ROWS_PER_POST):
                    for k, v in zip(
                        COLUMNS, (rank, it, 1, 64, 1.0, 30.0, 5.0, time.time()), strict=True
                    ):
                        cols[k].append(v)
            status, _ = await fleet.request(
                "telemetry",
                "POST",
                f"/api/v1/jobs/{job.id}/telemetry",
                job.ranks[ranks[0]].token,
                json={"columns": cols},
            )
            assert status in (200, 201, 202), fleet.last_error

        async def poll(i: int) -> None:
            job = jobs[i % len(jobs)]
            params = {"known_version": str(job.version), "wait_s": "0"}
            await fleet.request("plan-poll", "GET", f"/api/v1/jobs/{job.id}/plan", params=params)

        n = args.requests
        out: dict[str, Any] = {"hosts": args.hosts, "ranks_running": started}
        out["job start, per rank (placed, launched, reported running)"] = per_rank
        out["heartbeat (8 ranks running)"] = await metered(
            srv, db, n, lambda i: fleet.heartbeat(busy[i % len(busy)])
        )

        async def changed(i: int) -> None:
            """A heartbeat that is not the host's last one (its ranks listed in the other
            order): answered by the database, as one after a change is."""
            host = busy[i % len(busy)]
            status = await fleet.heartbeat(host, reverse=(i // len(busy)) % 2 == 0)
            assert status == 200, fleet.last_error

        out["heartbeat worked out (not the last one)"] = await metered(srv, db, n, changed)
        # One rank per post; the jobs' ranks in turn (a job's posts are ordered by iteration).
        out[f"telemetry per rank ({ROWS_PER_POST} rows)"] = await metered(
            srv, db, n, lambda i: rows(jobs[i % len(jobs)], [(i // len(jobs)) % JOB_SIZE])
        )
        out[f"telemetry per host (8 ranks x {ROWS_PER_POST} rows)"] = await metered(
            srv, db, n // 4, lambda i: rows(jobs[i % len(jobs)], list(range(8)))
        )
        out["plan poll (unchanged, wait_s=0)"] = await metered(srv, db, n, poll)
        errors = dict(fleet.stats.errors)
    finally:
        await fleet.http.close()
    out["errors"] = errors
    out["fleet_of_issue_16"] = fleet_cost(out)
    return out


COLUMNS = (
    "rank",
    "iteration",
    "plan_version",
    "batch_size",
    "data_ms",
    "compute_ms",
    "sync_ms",
    "ts",
)


def fleet_cost(out: dict[str, Any]) -> dict[str, Any]:
    """API cores that 1,250 hosts (2 s heartbeats) and 200 jobs of the fleet bench's mix (mean
    38.7 workers, 3 iterations/s, flushed every 2 s) keep busy at the measured costs."""
    heartbeats_per_s = 1250 / 2.0
    ranks, hosts_per_job, jobs = 200 * 38.7, 5.4, 200
    hb = out["heartbeat (8 ranks running)"]["api_cpu_ms"]
    per_rank = out[f"telemetry per rank ({ROWS_PER_POST} rows)"]["api_cpu_ms"]
    per_host = out[f"telemetry per host (8 ranks x {ROWS_PER_POST} rows)"]["api_cpu_ms"]
    return {
        "heartbeat_cores": round(heartbeats_per_s * hb / 1000, 2),
        "telemetry_per_rank_cores": round(ranks / 2.0 * per_rank / 1000, 2),
        "telemetry_per_host_cores": round(jobs * hosts_per_job / 2.0 * per_host / 1000, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hosts", type=int, default=32)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=1, help="API processes of the server")
    args = ap.parse_args()
    with (
        database("postgresql") as db_url,
        tempfile.TemporaryDirectory() as tmp,
        server(db_url, args.workers, Path(tmp) / "server.log") as srv,
    ):
        out = asyncio.run(run(srv, db_url, args))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
