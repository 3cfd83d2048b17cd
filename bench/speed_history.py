"""What a placement pass pays to know each device's measured speed on a workload.

    python bench/speed_history.py [--jobs 50] [--ranks 32] [--iterations 2000] [--repeat 5]

``--jobs`` finished jobs of one workload, ``--ranks`` CPU workers each, with ``--iterations``
iterations of raw telemetry per rank (inserted with ``INSERT ... SELECT generate_series`` on a
throw-away PostgreSQL database: 3.2 million rows by default, what 50 such jobs of a fleet leave
within the retention window), and one running job of the same workload posting a fleet pass's
worth of new rows (2 s at 5 iterations/s) between passes. Measured, median of ``--repeat``:

- ``whole``: summing every recent job's whole history (``scheduler.measured_speeds``), as every
  placement pass did before ``scheduler.SpeedHistory``;
- ``first``: a fresh ``SpeedHistory``'s first use (a controller starting), the same sum once;
- ``kept``: a kept ``SpeedHistory`` after a pass's new rows: what each pass now pays.

Wall time of the call, the controller's side; PostgreSQL's own work is in it (its backend runs
the statements while the call waits). It also checks that both give the same speeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ingest import database
from bench.retention import AUTH, quiet_settings
from contract.base import PROTOCOL_VERSION
from server.app import create_app
from server.context import context_of
from server.db import transaction
from server.models import Job
from server.services import scheduler

PASS_ITERATIONS = 10
"""New iterations of the running job between two passes (2 s at 5 iterations/s)."""


def _setup(client: TestClient, jobs: int, ranks: int) -> list[int]:
    """Hosts of 64 devices with a device per rank of every job, and ``jobs + 1`` jobs placed
    on them."""
    total = (jobs + 1) * ranks
    for h in range(0, total, 64):
        name = f"h{h // 64}"
        agent = client.post(
            "/api/v1/tokens", json={"name": name, "role": "agent", "host": name}, headers=AUTH
        ).json()["token"]
        devices = [
            {"index": i, "kind": "cpu", "model": "CPU", "memory_mb": 1024}
            for i in range(min(64, total - h))
        ]
        body = {"protocol_version": PROTOCOL_VERSION, "name": name, "address": "127.0.0.1"}
        r = client.post(
            "/api/v1/hosts/register",
            json={**body, "devices": devices},
            headers={"Authorization": f"Bearer {agent}"},
        )
        r.raise_for_status()
    spec = {"name": "j", "workload": {"builtin": "mlp"}, "global_batch": 64 * ranks}
    ids = []
    for _ in range(jobs + 1):
        r = client.post(
            "/api/v1/jobs", json={**spec, "workers": ranks, "iterations": 10**6}, headers=AUTH
        )
        r.raise_for_status()
        ids.append(int(r.json()["id"]))
    ctx = context_of(client.app)  # type: ignore[arg-type]
    with transaction(ctx.sessions) as s:
        scheduler.place_pending(s, datetime.now(UTC))
    return ids


_FILL = text(
    "INSERT INTO iteration_telemetry (job_id, rank, iteration, plan_version, batch_size, "
    "data_ms, compute_ms, sync_ms, ts, probe) "
    "SELECT :job, r, i::bigint, 1, 48 + (i / 100) % 3 * 16, 1.0, "
    "5.0 + (48 + (i / 100) % 3 * 16) * (0.5 + (:job % 5) * 0.1 + r * 0.01) + (i * 13 % 7) * 0.1, "
    "3.0, 1.0e9 + i * 0.2, false "
    "FROM generate_series(CAST(:first AS integer), CAST(:last AS integer)) AS i, "
    "generate_series(0, CAST(:ranks AS integer) - 1) AS r"
)


def _fill(client: TestClient, job: int, ranks: int, first: int, last: int) -> None:
    ctx = context_of(client.app)  # type: ignore[arg-type]
    with ctx.engine.begin() as c:
        c.execute(_FILL, {"job": job, "ranks": ranks, "first": first, "last": last})


def _timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run(jobs: int, ranks: int, iterations: int, repeat: int) -> dict[str, Any]:
    with database("postgresql") as url, TestClient(create_app(quiet_settings(url))) as client:
        ctx = context_of(client.app)  # type: ignore[arg-type]
        *done, running = _setup(client, jobs, ranks)
        for job in done:
            _fill(client, job, ranks, 0, iterations - 1)
        with ctx.engine.begin() as c:
            c.execute(
                text("UPDATE jobs SET status = 'succeeded' WHERE id = ANY(:ids)"), {"ids": done}
            )
            c.execute(text("UPDATE jobs SET status = 'running' WHERE id = :id"), {"id": running})
        with ctx.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
            c.execute(text("VACUUM ANALYZE iteration_telemetry"))
        with transaction(ctx.sessions) as s:
            running_job = s.get(Job, running)
            assert running_job is not None
            workload = running_job.spec["workload"]
        whole_s: list[float] = []
        first_s: list[float] = []
        kept_s: list[float] = []
        history_cls = getattr(scheduler, "SpeedHistory", None)  # absent in the code before it
        history = history_cls() if history_cls is not None else None
        worst = 0.0
        newest = -1
        for _ in range(repeat):
            _fill(client, running, ranks, newest + 1, newest + PASS_ITERATIONS)
            newest += PASS_ITERATIONS
            with transaction(ctx.sessions) as s:
                took, whole = _timed(lambda: scheduler.measured_speeds(s, workload))
                whole_s.append(took)
                if history_cls is None or history is None:
                    continue
                took, _ = _timed(lambda: history_cls().speeds(s, workload))
                first_s.append(took)
                took, kept = _timed(lambda: history.speeds(s, workload))
                kept_s.append(took)
                assert kept.keys() == whole.keys()
                worst = max([worst, *(abs(kept[d] / whole[d] - 1) for d in whole)])
        rows = (jobs * iterations + newest + 1) * ranks
        out: dict[str, Any] = {
            "jobs": jobs + 1,
            "ranks": ranks,
            "raw_rows": rows,
            "whole_s": round(statistics.median(whole_s), 4),
        }
        if first_s:
            out |= {
                "first_s": round(statistics.median(first_s), 4),
                "kept_s": round(statistics.median(kept_s), 4),
                "kept_rows_per_pass": PASS_ITERATIONS * ranks,
                "largest_relative_difference": worst,
            }
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--jobs", type=int, default=50)
    ap.add_argument("--ranks", type=int, default=32)
    ap.add_argument("--iterations", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(json.dumps(run(args.jobs, args.ranks, args.iterations, args.repeat), indent=2))


if __name__ == "__main__":
    main()
