"""What the interpreter's switch interval costs a busy API process's database transactions.

    python bench/gil_switch.py [--seconds 8] [--repeats 2] [--intervals 5,1,0.5] [--busy 0.6]

An API process's event loop handles requests (the heartbeats answered from memory, telemetry
posts, plan polls) while its worker threads run transactions for the requests the database
must answer: a heartbeat that changed something makes about a dozen round trips to
PostgreSQL. After each round trip the thread needs the interpreter back, and while the event
loop is busy it waits up to the switch interval (``sys.setswitchinterval``, Python's default
5 ms) before the loop is made to let go. Would a shorter interval get those transactions
through faster, and at what cost to the loop?

This plays that in one process against the real PostgreSQL: an asyncio loop kept busy in
pure-Python slices for ``--busy`` of its time (the API process ran at 0.6 of a core in the
1,250-host fleet), and 16 threads (``Settings.db_concurrency``) each running transactions of
``--round-trips`` statements back to back. For each switch interval, interleaved over
``--repeats``: the transactions' latency (p50/p99) and rate, and the loop's own work done
(what a shorter interval costs it in switches). This machine is shared and noisy: compare the
intervals within one run. On it, 1 ms and 0.5 ms left the transactions' latency within the
noise of 5 ms and cut the loop's work by 35 to 55%: the servers keep Python's default.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ingest import database

THREADS = 16


def _spin(seconds: float) -> int:
    """Pure-Python work for ``seconds``; returns the loops done."""
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += 1
    return n


async def _busy_loop(busy: float, stop: threading.Event, done: list[int]) -> None:
    """Callbacks of 2 ms of work with idle gaps between, ``busy`` of the time."""
    slice_s = 0.002
    gap = slice_s * (1 - busy) / busy
    while not stop.is_set():
        done[0] += _spin(slice_s)
        await asyncio.sleep(gap)


def _transactions(
    url: str, round_trips: int, stop: threading.Event, out: list[float], ready: threading.Barrier
) -> None:
    with psycopg.connect(url) as conn:
        ready.wait()
        while not stop.is_set():
            t0 = time.perf_counter()
            with conn.transaction():
                for _ in range(round_trips):
                    conn.execute("SELECT 1").fetchall()
            out.append(time.perf_counter() - t0)


def measure(
    url: str, interval_ms: float, seconds: float, busy: float, trips: int
) -> dict[str, Any]:
    sys.setswitchinterval(interval_ms / 1000)
    stop = threading.Event()
    latencies: list[list[float]] = [[] for _ in range(THREADS)]
    ready = threading.Barrier(THREADS + 1)
    threads = [
        threading.Thread(target=_transactions, args=(url, trips, stop, latencies[i], ready))
        for i in range(THREADS)
    ]
    for t in threads:
        t.start()
    ready.wait()
    work = [0]

    async def main() -> None:
        task = asyncio.ensure_future(_busy_loop(busy, stop, work))
        await asyncio.sleep(seconds)
        stop.set()
        await task

    asyncio.run(main())
    for t in threads:
        t.join()
    flat = sorted(x for lat in latencies for x in lat)
    return {
        "interval_ms": interval_ms,
        "transactions_per_s": round(len(flat) / seconds, 1),
        "p50_ms": round(1000 * statistics.median(flat), 1),
        "p99_ms": round(1000 * flat[int(len(flat) * 0.99)], 1),
        "loop_work_per_s": round(work[0] / seconds),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--intervals", default="5,1,0.5", help="switch intervals (ms) to compare")
    ap.add_argument("--busy", type=float, default=0.6, help="the event loop's busy share")
    ap.add_argument("--round-trips", type=int, default=12, help="statements per transaction")
    args = ap.parse_args()
    intervals = [float(x) for x in args.intervals.split(",")]
    before = sys.getswitchinterval()
    runs = []
    with database("postgresql") as url:
        dsn = url.replace("postgresql+psycopg://", "postgresql://")
        for _ in range(args.repeats):
            for ms in intervals:
                runs.append(measure(dsn, ms, args.seconds, args.busy, args.round_trips))
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    sys.setswitchinterval(before)
    print(json.dumps({"busy": args.busy, "round_trips": args.round_trips, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
