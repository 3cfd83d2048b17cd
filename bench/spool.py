"""What the relay's spool costs a worker's post and the agent: the relay without a spool, with
one that does not sync, and with the real one (``fdatasync`` per post), side by side.

    python bench/spool.py [--ranks 8] [--posts 400] [--rows 4] [--rounds 5]

A real :class:`agent.relay.TelemetryRelay` on 127.0.0.1 whose server post is a no-op (so only
the relay is measured); ``--ranks`` workers, each with its own credential and kept-alive
``httpx`` client, post ``--rows``-row telemetry batches (a rank's 2 s of iterations at the
default cadence is 4) from a thread each. The three variants run in turns, ``--rounds`` times,
so that the shared machine's noise falls on all of them alike; the relay flushes (and the
spool deletes what was posted) every 0.2 s throughout.

Reported per variant: a post's latency as the worker sees it (p50, p99, ms), the agent's CPU
per post (the process's, less the workers' threads' share is not separable: the workers run in
this process too, so the figure is relay + worker client), and each figure's ratio to the
relay without a spool; and one :meth:`~agent.spool.Spool.append` on its own, with and without
``fdatasync`` (``append_us``). The spool's directory is on this machine's disk (``--dir``, default a
temporary directory).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.relay import TelemetryRelay
from agent.spool import Spool
from contract.agent import TelemetryAck, TelemetryBatch, TelemetryRecord

VARIANTS = ("memory", "spool-nosync", "spool-fdatasync")


def _body(rank: int, start: int, rows: int) -> bytes:
    records = [
        TelemetryRecord(
            rank=rank,
            iteration=start + i,
            plan_version=1,
            batch_size=32,
            data_ms=1.0,
            compute_ms=20.0,
            sync_ms=2.0,
            ts=time.time(),
        )
        for i in range(rows)
    ]
    return TelemetryBatch(records=records).wire_json().encode()


def _relay(variant: str, directory: Path) -> TelemetryRelay:
    def post(job_id: int, batch: TelemetryBatch) -> TelemetryAck:
        return TelemetryAck(accepted=len(batch.all_records()), duplicates=0)

    spool = None
    if variant != "memory":
        spool = Spool(directory / variant, sync=variant == "spool-fdatasync")
    return TelemetryRelay(post, spool=spool, flush_s=0.2)


def one_round(variant: str, directory: Path, args: argparse.Namespace) -> dict[str, Any]:
    relay = _relay(variant, directory)
    url = relay.start()
    tokens = [f"efw_bench_{variant}_{rank}" for rank in range(args.ranks)]
    for rank, token in enumerate(tokens):
        relay.grant(1, rank, token)
    latencies: list[list[float]] = [[] for _ in tokens]
    go = threading.Barrier(args.ranks + 1)

    def worker(rank: int) -> None:
        headers = {"Authorization": f"Bearer {tokens[rank]}", "Content-Type": "application/json"}
        with httpx.Client(base_url=url, timeout=30.0) as client:
            bodies = [_body(rank, i * args.rows, args.rows) for i in range(args.posts)]
            go.wait()
            for body in bodies:
                t0 = time.perf_counter()
                r = client.post("/api/v1/jobs/1/telemetry", content=body, headers=headers)
                latencies[rank].append((time.perf_counter() - t0) * 1000.0)
                assert r.status_code == 200, r.text

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(args.ranks)]
    for t in threads:
        t.start()
    go.wait()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for t in threads:
        t.join()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    assert relay.close(timeout_s=10)
    posts = args.ranks * args.posts
    flat = sorted(x for per in latencies for x in per)
    return {
        "p50_ms": statistics.median(flat),
        "p99_ms": flat[int(0.99 * (len(flat) - 1))],
        "cpu_ms_per_post": cpu * 1000.0 / posts,
        "posts_per_s": posts / wall,
    }


def appends(directory: Path, sync: bool, n: int, rows: int) -> float:
    """Microseconds of one :meth:`Spool.append` (and its share of the deletes) on its own."""
    spool = Spool(directory / f"raw-{sync}-{time.monotonic_ns()}", sync=sync)
    body = _body(0, 0, rows)
    t0 = time.perf_counter()
    for i in range(n):
        spool.append((1, "telemetry"), body, rows)
        if i % 100 == 99:
            spool.consumed((1, "telemetry"), 100 * rows)
    spent = time.perf_counter() - t0
    spool.close()
    return spent * 1e6 / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--posts", type=int, default=400, help="per rank and round")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=None, help="where the spools go")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
        for _ in range(args.rounds):
            for variant in VARIANTS:
                runs[variant].append(one_round(variant, Path(tmp), args))
        raw = {
            sync: statistics.median(appends(Path(tmp), sync, 2000, args.rows) for _ in range(3))
            for sync in (False, True)
        }
    out: dict[str, Any] = {"ranks": args.ranks, "posts": args.posts, "rows": args.rows}
    out["append_us"] = {"nosync": round(raw[False], 1), "fdatasync": round(raw[True], 1)}
    base = {k: statistics.median(r[k] for r in runs["memory"]) for k in runs["memory"][0]}
    for variant in VARIANTS:
        med = {k: statistics.median(r[k] for r in runs[variant]) for k in runs[variant][0]}
        out[variant] = {
            **{k: round(v, 3) for k, v in med.items()},
            **{f"{k}_ratio": round(med[k] / base[k], 2) for k in med},
        }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
