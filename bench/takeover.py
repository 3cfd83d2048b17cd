"""What a controller starting, or a standby taking over, costs per running job: its first sweep.

    python bench/takeover.py [--iterations 20000] [--ranks 64] [--repeat 3] [--json]

A placed job of ``--ranks`` CPU workers with ``--iterations`` iterations of raw telemetry (the
default retention window: 20,000 iterations a job), inserted with one ``INSERT ... SELECT
generate_series`` on a throw-away PostgreSQL database, is swept by a fresh control loop
(``control_loop.sweep_job`` on a new ``LoopState``, as after a restart or a fail-over), then
once more with nothing new (the loop's first decision comes then). Measured, median of
``--repeat``: the first sweep's wall time and the controller's CPU time
(``time.thread_time``), the telemetry rows it read, how much the process's resident memory grew
over the first sweep (the controller keeps it afterwards, as Python rarely hands memory back),
and the second sweep's wall time. At 10,000 GPUs a standby taking over sweeps every job first.
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

import psutil
from fastapi.testclient import TestClient
from sqlalchemy import event

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ingest import database
from bench.retention import _fill, _setup, quiet_settings
from server.app import create_app
from server.context import context_of
from server.db import transaction
from server.services import control_loop, scheduler


def _rows_read(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
    if "FROM iteration_telemetry" in statement and cursor.rowcount and cursor.rowcount > 0:
        _rows_read.count += cursor.rowcount  # type: ignore[attr-defined]


_rows_read.count = 0  # type: ignore[attr-defined]


def run(iterations: int, ranks: int, repeat: int) -> dict[str, Any]:
    with database("postgresql") as url:
        settings = quiet_settings(url)
        with TestClient(create_app(settings)) as client:
            ctx = context_of(client.app)  # type: ignore[arg-type]
            job = _setup(client, ranks)
            with transaction(ctx.sessions) as s:
                scheduler.place_pending(s, datetime.now(UTC))
            _fill(client, job, ranks, iterations, status="running")
            event.listen(ctx.engine, "after_cursor_execute", _rows_read)
            first_s, first_cpu, rows, grew, again_s = [], [], [], [], []
            me = psutil.Process()
            for _ in range(repeat):
                state = control_loop.LoopState()
                _rows_read.count = 0  # type: ignore[attr-defined]
                rss, t0, c0 = me.memory_info().rss, time.perf_counter(), time.thread_time()
                with transaction(ctx.sessions) as s:
                    control_loop.sweep_job(s, state, job)
                first_s.append(time.perf_counter() - t0)
                first_cpu.append(time.thread_time() - c0)
                grew.append((me.memory_info().rss - rss) / 2**20)
                rows.append(_rows_read.count)  # type: ignore[attr-defined]
                t0 = time.perf_counter()
                with transaction(ctx.sessions) as s:
                    control_loop.sweep_job(s, state, job)
                again_s.append(time.perf_counter() - t0)
    return {
        "iterations": iterations,
        "ranks": ranks,
        "raw_rows": iterations * ranks,
        "first_sweep_s": round(statistics.median(first_s), 3),
        "first_sweep_cpu_s": round(statistics.median(first_cpu), 3),
        "telemetry_rows_read": int(statistics.median(rows)),
        "resident_mb_grown": round(max(grew), 1),
        "second_sweep_s": round(statistics.median(again_s), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=20_000)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = run(args.iterations, args.ranks, args.repeat)
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
