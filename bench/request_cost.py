"""What one request of each kind costs the server, in CPU: the capacity model behind bench/fleet.py.

    python bench/request_cost.py [--hosts 32] [--requests 2000] [--cycles 4] [--workers 1]

A real `evenflow server` on PostgreSQL with ``--hosts`` simulated hosts of 8 GPUs, filled by four
64-worker jobs (with the default 32 hosts) while the API processes', the controller's and
PostgreSQL's CPU time is metered:

- a job's start and end, per rank, over ``--cycles`` cycles: the jobs submitted, placed, their
  ranks launched (each host's heartbeat handing out credentials) and reported running; then
  their ranks reported succeeded and the hosts told the jobs ended, until no host lists a rank.
  At the fleet's churn (jobs of 30 to 150 s) these are the heartbeats that go to the database;
- then, with the jobs running, one kind at a time, ``--requests`` requests at a concurrency of
  8: a steady heartbeat (8 ranks running, nothing to change: answered from memory,
  ``server.scale.host_answers``), a telemetry post of one rank's 2 s of iterations (4 rows), a host's
  post (8 ranks x 4 rows), and a plan poll that finds the plan unchanged (``wait_s=0``).

Reported: CPU ms per request or rank (API process, controller, PostgreSQL), heartbeats per
rank of a start and an end and how many of them the database answered (the server's
``/metrics``), and what the 1,250-host fleet of issue 16 would keep busy at those costs.
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
PHASES = ("start", "end")
"""Of a job's life, what ``cycles`` meters."""
CPU_KINDS = ("api", "controller", "postgres")
GROUPS = "evenflow_heartbeat_group_heartbeats"
"""The server's histogram of heartbeats worked out together (``server.scale.heartbeat_groups``)."""


async def placed(fleet: Fleet) -> list[Any]:
    """Submit the jobs and heartbeat every host until every rank of them reports running."""
    jobs = []
    for _ in range(JOBS):
        job = await fleet.submit(size=JOB_SIZE)
        assert job is not None, fleet.last_error
        job.started = True  # this bench posts the jobs' telemetry itself, metered
        jobs.append(job)
    deadline = time.monotonic() + 120
    while not all(len(j.ranks) == j.size for j in jobs):
        if time.monotonic() > deadline:
            raise RuntimeError("the jobs were not placed")
        await asyncio.gather(*(fleet.heartbeat(h) for h in fleet.hosts))
        await asyncio.sleep(0.5)
    await asyncio.gather(*(fleet.heartbeat(h) for h in fleet.hosts))  # now reporting running
    return jobs


async def ended(fleet: Fleet, jobs: list[Any]) -> None:
    """The jobs' ranks report succeeded; heartbeat every host until none lists a rank."""
    for job in jobs:
        job.finished = True
    deadline = time.monotonic() + 120
    while any(h.reports for h in fleet.hosts):
        if time.monotonic() > deadline:
            raise RuntimeError("the jobs' ranks were not let go")
        await asyncio.gather(*(fleet.heartbeat(h) for h in fleet.hosts if h.reports))
        await asyncio.sleep(0.2)


async def cycles(srv: Server, fleet: Fleet, db: str, n: int) -> dict[str, Any]:
    """``n`` cycles of the jobs' start and end: CPU per rank of each (API, controller,
    PostgreSQL), and heartbeats per rank, with those the database answered and how many of
    those it worked out together on average (``server.scale.heartbeat_groups``)."""
    counted = (*CPU_KINDS, "heartbeats", "to_database", "groups")
    spent = {p: dict.fromkeys(counted, 0.0) for p in PHASES}
    ranks = 0
    for _ in range(n):
        for phase in PHASES:
            sources0, sent0 = await fleet.heartbeat_sources(), len(fleet.stats.latency["heartbeat"])
            groups0 = await fleet.histogram(GROUPS)
            cpu, t0 = CpuMeter(srv.pid, db), time.monotonic()
            if phase == "start":
                jobs = await placed(fleet)
                ranks += sum(j.size for j in jobs)
            else:
                await ended(fleet, jobs)
            secs, used = time.monotonic() - t0, cpu.cores_used()
            sources1 = await fleet.heartbeat_sources()
            groups1 = await fleet.histogram(GROUPS)
            every = ("", float("inf"))
            spent[phase]["groups"] += groups1.get(every, 0.0) - groups0.get(every, 0.0)
            for kind in CPU_KINDS:
                spent[phase][kind] += used.get(kind, 0.0) * secs
            spent[phase]["heartbeats"] += len(fleet.stats.latency["heartbeat"]) - sent0
            spent[phase]["to_database"] += sources1.get("database", 0.0) - sources0.get(
                "database", 0.0
            )
    return {
        f"job {phase}, per rank": {
            **{f"{k}_cpu_ms": round(1000 * spent[phase][k] / ranks, 2) for k in CPU_KINDS},
            "heartbeats": round(spent[phase]["heartbeats"] / ranks, 3),
            "to_database": round(spent[phase]["to_database"] / ranks, 3),
            "heartbeats_per_group": round(
                spent[phase]["to_database"] / max(1.0, spent[phase]["groups"]), 2
            ),
        }
        for phase in PHASES
    } | {"cycles": n, "ranks_per_cycle": ranks // n}


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
        churn = await cycles(srv, fleet, db, args.cycles)
        jobs = await placed(fleet)
        busy = [h for h in fleet.hosts if h.reports]
        next_iteration = dict.fromkeys((j.id for j in jobs), 0)
        started = sum(j.size for j in jobs)

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
        out |= churn
        out["heartbeat (8 ranks running)"] = await metered(
            srv, db, n, lambda i: fleet.heartbeat(busy[i % len(busy)])
        )
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
    38.7 workers, 3 iterations/s, flushed every 2 s, 30 to 150 s long: about 86 ranks starting
    and as many ending a second) keep busy at the measured costs."""
    heartbeats_per_s = 1250 / 2.0
    ranks, hosts_per_job, jobs, mean_job_s = 200 * 38.7, 5.4, 200, 90.0
    hb = out["heartbeat (8 ranks running)"]["api_cpu_ms"]
    per_rank = out[f"telemetry per rank ({ROWS_PER_POST} rows)"]["api_cpu_ms"]
    per_host = out[f"telemetry per host (8 ranks x {ROWS_PER_POST} rows)"]["api_cpu_ms"]
    churn = sum(out[f"job {phase}, per rank"]["api_cpu_ms"] for phase in PHASES)
    return {
        "heartbeat_cores": round(heartbeats_per_s * hb / 1000, 2),
        "job_start_and_end_cores": round(ranks / mean_job_s * churn / 1000, 2),
        "telemetry_per_rank_cores": round(ranks / 2.0 * per_rank / 1000, 2),
        "telemetry_per_host_cores": round(jobs * hosts_per_job / 2.0 * per_host / 1000, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hosts", type=int, default=32)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--cycles", type=int, default=4, help="of the jobs' start and end")
    ap.add_argument("--workers", type=int, default=1, help="API processes of the server")
    args = ap.parse_args()
    if args.cycles < 1:
        ap.error("--cycles must be at least 1 (the fleet estimate needs a job's start and end)")
    with (
        database("postgresql") as db_url,
        tempfile.TemporaryDirectory() as tmp,
        server(db_url, args.workers, Path(tmp) / "server.log") as srv,
    ):
        out = asyncio.run(run(srv, db_url, args))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
