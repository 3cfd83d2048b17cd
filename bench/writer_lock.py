"""SQLite writers in two processes: a file lock around each transaction against BEGIN
IMMEDIATE with a busy timeout (SQLite's own waiting, a sleeping back-off).

    python bench/writer_lock.py [--json] [--transactions 300]

Two processes (the API and the controller, in miniature) each run write transactions of 500
telemetry-like rows as fast as they can on one WAL database; a third writer does a small
write (one row, like a heartbeat) every 5 ms and reports its latency, since the small writes
that wait behind big ones are what a sleeping back-off hurts. Reports total rows/s and the
small writes' p50/p99/max per mode. ``server.locks.WriterLock`` is the file-lock mode.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from server.locks import WriterLock

ROWS = 500
INSERT = "INSERT INTO t (a, b, c, d) VALUES (?, ?, ?, ?)"


def connect(db: Path, mode: str) -> sqlite3.Connection:
    conn = sqlite3.connect(db, isolation_level=None, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA busy_timeout=30000")
    return conn


def write(conn: sqlite3.Connection, lock: WriterLock | None, rows: list[tuple[Any, ...]]) -> None:
    if lock is not None:
        with lock:
            conn.execute("BEGIN")
            conn.executemany(INSERT, rows)
            conn.execute("COMMIT")
    else:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(INSERT, rows)
        conn.execute("COMMIT")


def bulk_writer(db: Path, mode: str, transactions: int, start: Any) -> None:
    conn = connect(db, mode)
    lock = WriterLock(db.with_name(db.name + ".lock")) if mode == "flock" else None
    rows = [(i, i * 2, 1.5, 2.5) for i in range(ROWS)]
    start.wait()
    for _ in range(transactions):
        write(conn, lock, rows)


def small_writer(db: Path, mode: str, stop: Any, start: Any, out: Any) -> None:
    conn = connect(db, mode)
    lock = WriterLock(db.with_name(db.name + ".lock")) if mode == "flock" else None
    lat = []
    start.wait()
    while not stop.is_set():
        t0 = time.perf_counter()
        write(conn, lock, [(0, 0, 0.0, 0.0)])
        lat.append(time.perf_counter() - t0)
        time.sleep(0.005)
    out.put(lat)


def run(mode: str, transactions: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        db = Path(d) / "w.db"
        connect(db, mode).execute("CREATE TABLE t (id INTEGER PRIMARY KEY, a, b, c, d)")
        ctx = mp.get_context("spawn")
        start, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
        bulk = [
            ctx.Process(target=bulk_writer, args=(db, mode, transactions, start)) for _ in (1, 2)
        ]
        small = ctx.Process(target=small_writer, args=(db, mode, stop, start, out))
        for p in (*bulk, small):
            p.start()
        time.sleep(1.0)  # all connected
        t0 = time.perf_counter()
        start.set()
        for p in bulk:
            p.join()
        wall = time.perf_counter() - t0
        stop.set()
        lat = sorted(out.get())
        small.join()
    return {
        "rows_per_s": round(2 * transactions * ROWS / wall),
        "small_writes": len(lat),
        "small_write_p50_ms": round(1000 * statistics.median(lat), 2),
        "small_write_p99_ms": round(1000 * lat[int(len(lat) * 0.99)], 2),
        "small_write_max_ms": round(1000 * lat[-1], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transactions", type=int, default=300)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results = {mode: run(mode, args.transactions) for mode in ("flock", "begin-immediate")}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{'mode':<16} {'rows/s':>8} {'small writes':>12} {'p50':>8} {'p99':>8} {'max':>8}")
    for mode, r in results.items():
        print(
            f"{mode:<16} {r['rows_per_s']:>8} {r['small_writes']:>12} {r['small_write_p50_ms']:>6}ms "
            f"{r['small_write_p99_ms']:>6}ms {r['small_write_max_ms']:>6}ms"
        )


if __name__ == "__main__":
    main()
