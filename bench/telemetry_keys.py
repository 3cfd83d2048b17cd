"""What the telemetry table's keys cost PostgreSQL per stored row: before migration 0028 and after.

    python bench/telemetry_keys.py [--rounds 6] [--groups 40] [--jobs 100] [--json]

Two throw-away PostgreSQL databases (``bench.ingest.database``): one migrated to 0027 (four
b-trees a row: the id, the unique (job_id, rank, iteration), (job_id, iteration) and (job_id,
id)), one to the newest (three: the unique key in (job_id, iteration, rank) order replaces the
first two's pair). Each gets the same ``--jobs`` jobs (submitted through the app, so the rows'
foreign keys hold), then rounds of telemetry groups of the 1,250-host fleet's shape: ``--groups``
groups a round, each the posts the API's writer takes together (20 posts of 8 ranks x 6
iterations, 960 rows), stored through the server's own insert (``telemetry._insert_postgresql``,
its advisory lock and commit included). The two databases take turns, round by round, so the
machine's noise falls on both; their tables grow as a fleet's does.

Reported per database: per stored row, the wall time, the CPU of the PostgreSQL backend that
stored it (``psutil``) and the WAL it wrote (``pg_current_wal_lsn`` before and after: the
cluster's, so nothing else may write meanwhile), each as the median over the rounds with the
range; and the table's size with its indexes at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("EVENFLOW_LOG_LEVEL", "warning")

from alembic import command
from fastapi.testclient import TestClient
from sqlalchemy import Connection

from bench.ingest import database
from bench.stack import job_spec
from contract.base import PROTOCOL_VERSION
from server.app import create_app
from server.config import Settings
from server.db import alembic_config, make_engine
from server.services import telemetry
from server.services.telemetry import COLUMNS

TOKEN = "ef_bench-admin-token-0123456789"
RANKS = 8
ITERATIONS = 6
POSTS = 20
OLD = "0027_departures"


def _jobs(url: str, n: int, *, migrate: bool) -> list[int]:
    """``n`` jobs submitted through the app (one host of ``RANKS`` devices: the first may
    start, the rest queue), their ids."""
    settings = Settings(database_url=url, admin_token=TOKEN, run_migrations=migrate)
    with TestClient(create_app(settings)) as client:
        h = {"Authorization": f"Bearer {TOKEN}"}
        devices = [
            {"index": i, "kind": "cpu", "model": "CPU", "memory_mb": 1024} for i in range(RANKS)
        ]
        host = {"protocol_version": PROTOCOL_VERSION, "name": "h", "address": "127.0.0.1"}
        r = client.post("/api/v1/hosts/register", json={**host, "devices": devices}, headers=h)
        assert r.status_code == 201, r.text
        ids = []
        for _ in range(n):
            r = client.post("/api/v1/jobs", json=job_spec(RANKS), headers=h)
            assert r.status_code == 201, r.text
            ids.append(int(r.json()["id"]))
    return ids


def _group(jobs: list[int], first_post: int, iteration: int) -> telemetry._Rows:
    """One writer's group: ``POSTS`` posts, each a host's ``RANKS`` ranks of one job over
    ``ITERATIONS`` iterations, as the relay sends them."""
    rows = telemetry._Rows([], [[] for _ in COLUMNS], {})
    for p in range(POSTS):
        job = jobs[(first_post + p) % len(jobs)]
        its = [iteration + i for i in range(ITERATIONS) for _ in range(RANKS)]
        ranks = [r for _ in range(ITERATIONS) for r in range(RANKS)]
        n = len(its)
        values: dict[str, list[Any]] = {
            "rank": ranks,
            "iteration": its,
            "plan_version": [1] * n,
            "batch_size": [64] * n,
            "data_ms": [1.5] * n,
            "compute_ms": [20.0 + (r % 3) for r in ranks],
            "sync_ms": [2.0] * n,
            "ts": [1.7e9 + i for i in its],
            "probe": [False] * n,
            "peak_memory_mb": [None] * n,
            "oom_batch": [None] * n,
            "pass_size": [None] * n,
        }
        rows._add(p, job, tuple(values[c] for c in COLUMNS))
    return rows


def _backend(conn: Connection) -> psutil.Process:
    pid = int(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())
    conn.commit()
    return psutil.Process(pid)


def _lsn(conn: Connection) -> int:
    """The cluster's WAL position, in bytes."""
    at = int(conn.exec_driver_sql("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").scalar_one())
    conn.commit()
    return at


def _round(conn: Connection, jobs: list[int], groups: int, base: int) -> dict[str, float]:
    backend = _backend(conn)
    wal0, cpu0, t0 = _lsn(conn), sum(backend.cpu_times()[:2]), time.perf_counter()
    stored = 0
    for g in range(groups):
        rows = _group(jobs, g * POSTS, base + (g * POSTS // len(jobs)) * ITERATIONS)
        with conn.begin():
            stored += sum(telemetry._insert_postgresql(conn, rows).values())
    wall = time.perf_counter() - t0
    cpu = sum(backend.cpu_times()[:2]) - cpu0
    wal = _lsn(conn) - wal0
    return {
        "rows": stored,
        "wall_us": 1e6 * wall / stored,
        "backend_cpu_us": 1e6 * cpu / stored,
        "wal_bytes": wal / stored,
    }


def _size(conn: Connection) -> dict[str, float]:
    q = (
        "SELECT pg_relation_size('iteration_telemetry'), "
        "pg_indexes_size('iteration_telemetry'), count(*) FROM iteration_telemetry"
    )
    heap, indexes, rows = conn.exec_driver_sql(q).one()
    return {"rows": rows, "heap_mb": heap / 2**20, "indexes_mb": indexes / 2**20}


def _summary(rounds: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("wall_us", "backend_cpu_us", "wal_bytes"):
        values = [r[key] for r in rounds]
        out[key] = {
            "median": round(statistics.median(values), 2),
            "range": [round(min(values), 2), round(max(values), 2)],
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--groups", type=int, default=40, help="writer groups per round")
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with database("postgresql") as old_url, database("postgresql") as new_url:
        old_engine, new_engine = make_engine(old_url), make_engine(new_url)
        command.upgrade(alembic_config(old_engine), OLD)
        jobs = {
            "0027 (four b-trees)": (old_engine, _jobs(old_url, args.jobs, migrate=False)),
            "0028 (three b-trees)": (new_engine, _jobs(new_url, args.jobs, migrate=True)),
        }
        rounds: dict[str, list[dict[str, float]]] = {name: [] for name in jobs}
        conns = {name: engine.connect() for name, (engine, _) in jobs.items()}
        per_round = args.groups * POSTS // args.jobs * ITERATIONS
        for r in range(args.rounds):
            order = list(jobs) if r % 2 == 0 else list(reversed(jobs))
            for name in order:
                result = _round(conns[name], jobs[name][1], args.groups, 1 + r * per_round)
                rounds[name].append(result)
                if not args.json:
                    print(
                        f"round {r} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in result.items())
                    )
        out = {name: {**_summary(rounds[name]), "table": _size(conns[name])} for name in jobs}
        for conn in conns.values():
            conn.close()
        old_engine.dispose()
        new_engine.dispose()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
