"""Bounded telemetry on PostgreSQL: a long finished job before and after its roll-up.

    python bench/retention.py [--iterations 500000] [--ranks 8] [--json]

A job of ``--ranks`` workers with ``--iterations`` iterations of telemetry (inserted with one
``INSERT ... SELECT generate_series``, as if the fleet had posted it) is rolled up by the
controller's own code (``Controller.roll_up_telemetry``) with the default window (20,000
iterations). Measured:

- the dashboard's series request (``GET /api/v1/jobs/{id}/series``, 500 points) before,
  right after the roll-up (dead index entries of the deleted rows still there) and after a
  ``VACUUM ANALYZE`` (what autovacuum does next), median of 5 (target: < 1 s);
- the telemetry tables' size (after ``VACUUM FULL``, so freed pages are not counted), per raw
  row and per rollup row, and what a worker-day costs at 2 iterations/s with and without
  retention (the retained job keeps its window raw plus one rollup row per 100 iterations).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ingest import database
from bench.stack import TOKEN
from contract.base import PROTOCOL_VERSION
from server.app import create_app
from server.config import Settings
from server.context import context_of
from server.controller import Controller
from server.services import retention

AUTH = {"Authorization": f"Bearer {TOKEN}"}
ITERATIONS_PER_S = 2.0
SECONDS_PER_DAY = 86_400


def _setup(client: TestClient, ranks: int) -> int:
    agent = client.post(
        "/api/v1/tokens", json={"name": "a", "role": "agent", "host": "h"}, headers=AUTH
    ).json()["token"]
    r = client.post(
        "/api/v1/hosts/register",
        json={
            "protocol_version": PROTOCOL_VERSION,
            "name": "h",
            "address": "127.0.0.1",
            "devices": [
                {"index": i, "kind": "cpu", "model": "CPU", "memory_mb": 1024} for i in range(ranks)
            ],
        },
        headers={"Authorization": f"Bearer {agent}"},
    )
    r.raise_for_status()
    spec = {
        "name": "long",
        "workload": {"builtin": "mlp"},
        "global_batch": 64 * ranks,
        "iterations": 100,
    }
    r = client.post("/api/v1/jobs", json={**spec, "workers": ranks}, headers=AUTH)
    r.raise_for_status()
    return int(r.json()["id"])


def quiet_settings(url: str) -> Settings:
    """A bench app on ``url`` whose controller and reaper do not run on their own (the bench
    drives them)."""
    return Settings(
        database_url=url,
        admin_token=TOKEN,
        controller="none",
        reaper_interval_s=3600,
    )


def _fill(
    client: TestClient, job: int, ranks: int, iterations: int, status: str = "succeeded"
) -> None:
    ctx = context_of(client.app)  # type: ignore[arg-type]
    with ctx.engine.begin() as c:
        c.execute(
            text(
                "INSERT INTO iteration_telemetry (job_id, rank, iteration, plan_version, "
                "batch_size, data_ms, compute_ms, sync_ms, ts, probe) "
                "SELECT :job, r, i::bigint, 1 + i / 50000, 64, 1.0 + (i % 7) * 0.1, "
                "50.0 + ((i * 13 + r * 7) % 29), 3.0 + ((i * 5 + r) % 11), "
                "1.0e9 + i * 0.5, false "
                "FROM generate_series(0, :its - 1) AS i, generate_series(0, :ranks - 1) AS r"
            ),
            {"job": job, "its": iterations, "ranks": ranks},
        )
        c.execute(
            text("UPDATE jobs SET status = :status WHERE id = :job"), {"job": job, "status": status}
        )


def _series_s(client: TestClient, job: int, repeat: int = 5) -> tuple[float, int]:
    times, points = [], 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        r = client.get(f"/api/v1/jobs/{job}/series?points=500", headers=AUTH)
        times.append(time.perf_counter() - t0)
        r.raise_for_status()
        points = len(r.json()["ranks"][0]["iteration"])
    return statistics.median(times), points


def _vacuum(client: TestClient) -> None:
    ctx = context_of(client.app)  # type: ignore[arg-type]
    with ctx.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        c.execute(text("VACUUM ANALYZE iteration_telemetry, telemetry_rollups"))


def _sizes(client: TestClient) -> dict[str, int]:
    ctx = context_of(client.app)  # type: ignore[arg-type]
    out = {}
    with ctx.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
        for table in ("iteration_telemetry", "telemetry_rollups"):
            c.execute(text(f"VACUUM FULL {table}"))
            size = c.execute(text(f"SELECT pg_total_relation_size('{table}')")).scalar()
            rows = c.execute(text(f"SELECT count(*) FROM {table}")).scalar()
            out[f"{table}_bytes"] = int(size or 0)
            out[f"{table}_rows"] = int(rows or 0)
    return out


def run(iterations: int, ranks: int) -> dict[str, Any]:
    with database("postgresql") as url:
        settings = quiet_settings(url)
        with TestClient(create_app(settings)) as client:
            job = _setup(client, ranks)
            t0 = time.perf_counter()
            _fill(client, job, ranks, iterations)
            fill_s = time.perf_counter() - t0
            before_s, before_points = _series_s(client, job)
            before = _sizes(client)
            ctx = context_of(client.app)  # type: ignore[arg-type]
            controller = Controller(settings, engine=ctx.engine, sessions=ctx.sessions)
            t0 = time.perf_counter()
            removed = 0
            while moved := controller.roll_up_telemetry(budget_s=60.0):
                removed += moved
            roll_up_s = time.perf_counter() - t0
            after_s, after_points = _series_s(client, job)
            _vacuum(client)  # what autovacuum does after a large delete
            vacuumed_s, _ = _series_s(client, job)
            after = _sizes(client)
    raw_row = before["iteration_telemetry_bytes"] / max(1, before["iteration_telemetry_rows"])
    rollup_row = after["telemetry_rollups_bytes"] / max(1, after["telemetry_rollups_rows"])
    per_day = ITERATIONS_PER_S * SECONDS_PER_DAY
    window = Settings().telemetry_keep_iterations
    return {
        "iterations": iterations,
        "ranks": ranks,
        "fill_s": round(fill_s, 1),
        "series_before_s": round(before_s, 3),
        "series_after_s": round(after_s, 3),
        "series_after_vacuum_s": round(vacuumed_s, 3),
        "points_per_rank": [before_points, after_points],
        "roll_up_s": round(roll_up_s, 1),
        "raw_rows_removed": removed,
        "raw_bytes_per_row": round(raw_row, 1),
        "rollup_bytes_per_rank_bucket": round(rollup_row * (ranks + 1) / ranks, 1),
        "size_before_mb": round(before["iteration_telemetry_bytes"] / 2**20, 1),
        "size_after_mb": round(
            (after["iteration_telemetry_bytes"] + after["telemetry_rollups_bytes"]) / 2**20, 1
        ),
        "mb_per_worker_day_raw": round(per_day * raw_row / 2**20, 2),
        "mb_per_worker_day_retained": round(
            per_day / retention.BUCKET * rollup_row * (ranks + 1) / ranks / 2**20, 3
        ),
        "window_mb_per_worker": round(window * raw_row / 2**20, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=500_000)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = run(args.iterations, args.ranks)
    if args.json:
        print(json.dumps(out))
        return
    print(f"job: {args.ranks} ranks x {args.iterations:,} iterations (filled in {out['fill_s']} s)")
    print(
        f"series (500 points): {out['series_before_s']:.3f} s before, "
        f"{out['series_after_s']:.3f} s right after the roll-up ({out['roll_up_s']} s), "
        f"{out['series_after_vacuum_s']:.3f} s once vacuumed"
    )
    print(
        f"telemetry tables: {out['size_before_mb']} MB -> {out['size_after_mb']} MB; "
        f"{out['raw_bytes_per_row']} B per raw row"
    )
    print(
        f"per worker-day at {ITERATIONS_PER_S:g} it/s: {out['mb_per_worker_day_raw']} MB raw, "
        f"{out['mb_per_worker_day_retained']} MB retained (+ a fixed "
        f"{out['window_mb_per_worker']} MB window per worker)"
    )


if __name__ == "__main__":
    main()
