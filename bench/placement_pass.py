"""What one placement pass costs the controller at fleet scale (``scheduler.place_pending``).

    python bench/placement_pass.py [--hosts 1250] [--gpus 8] [--burst 200] [--then 10]
                                   [--repeat 3] [--json]

On a throw-away PostgreSQL database, an app whose controller does not run on its own registers
``--hosts`` hosts of ``--gpus`` GPUs (the fleet bench's three models, one per host) and takes
``--burst`` pending jobs of the fleet bench's sizes (2 to 256 workers): a fleet's start, or a
controller back after an outage. Measured, median of ``--repeat``:

  - **burst**: one pass over all of them (the controller's placement thread runs it), its wall
    time and CPU time (``time.thread_time``), how many jobs it placed, and where the CPU went
    (building each job's candidates, choosing among them, the flush of workers and devices);
  - a digest of every rank's device, the same in two runs when the placements are, and what
    the placements are worth: their predicted samples/s and hosts, summed over the jobs;
  - **then**: with the burst placed and committed, ``--then`` more jobs pending (a fleet's
    submissions between two passes): the same figures.

Each measured pass is rolled back, so every repeat sees the same state. Keep it under 2 minutes
on a shared box.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import select

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fleet import GPU_MODELS, SIZE_WEIGHTS, SIZES
from bench.ingest import database
from bench.retention import quiet_settings
from bench.stack import TOKEN, job_spec
from contract.base import PROTOCOL_VERSION
from server.app import create_app
from server.context import context_of
from server.db import transaction
from server.models import Worker
from server.services import scheduler

AUTH = {"Authorization": f"Bearer {TOKEN}"}

_spent: dict[str, float] = defaultdict(float)


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*a: Any, **kw: Any) -> Any:
        t0 = time.thread_time()
        try:
            return fn(*a, **kw)
        finally:
            _spent[name] += time.thread_time() - t0

    return wrapper


def instrument() -> None:
    """Time the pass's phases where ``scheduler`` looks them up (module globals, at call time);
    a name this version of the code does not have is left out."""
    for name in ("candidates", "_best_of_kinds", "free_devices"):
        if hasattr(scheduler, name):
            setattr(scheduler, name, _timed(name, getattr(scheduler, name)))
    if hasattr(scheduler, "Pool"):  # where the candidates are made once per pass
        pool = scheduler.Pool
        pool.candidates = _timed("candidates", pool.candidates)  # type: ignore[method-assign]


def register(client: TestClient, hosts: int, gpus: int) -> None:
    for h in range(hosts):
        model, _ = GPU_MODELS[h % len(GPU_MODELS)]
        body = {
            "protocol_version": PROTOCOL_VERSION,
            "name": f"host-{h:05d}",
            "address": f"10.0.{h // 250}.{h % 250}",
            "devices": [
                {"index": i, "kind": "cuda", "model": model, "memory_mb": 81920}
                for i in range(gpus)
            ],
        }
        client.post("/api/v1/hosts/register", json=body, headers=AUTH).raise_for_status()


def submit(client: TestClient, rng: random.Random, n: int) -> int:
    workers = 0
    for _ in range(n):
        size = rng.choices(SIZES, SIZE_WEIGHTS)[0]
        client.post("/api/v1/jobs", json=job_spec(size), headers=AUTH).raise_for_status()
        workers += size
    return workers


def measure(client: TestClient, repeat: int) -> dict[str, Any]:
    """``repeat`` passes over the same pending jobs, each rolled back."""
    ctx = context_of(client.app)  # type: ignore[arg-type]
    walls, cpus, placed = [], [], []
    digests: set[str] = set()
    quality: set[tuple[int, int]] = set()
    phases: list[dict[str, float]] = []
    for _ in range(repeat):
        _spent.clear()
        with ctx.sessions() as s:
            t0, c0 = time.perf_counter(), time.thread_time()
            jobs = scheduler.place_pending(s, datetime.now(UTC))
            s.flush()
            walls.append(time.perf_counter() - t0)
            cpus.append(time.thread_time() - c0)
            placed.append(len(jobs))
            ranks = s.execute(
                select(Worker.job_id, Worker.rank, Worker.device_id).order_by(
                    Worker.job_id, Worker.rank
                )
            ).all()
            digests.add(hashlib.sha256(repr([tuple(r) for r in ranks]).encode()).hexdigest()[:12])
            chosen = s.info.get("placements", {}).values()
            quality.add(
                (
                    round(sum(c["predicted_samples_per_s"] for c in chosen)),
                    sum(c["hosts"] for c in chosen),
                )
            )
            s.rollback()
        phases.append(dict(_spent))
    return {
        "wall_s": round(statistics.median(walls), 3),
        "cpu_s": round(statistics.median(cpus), 3),
        "jobs_placed": statistics.median(placed),
        "placement_digest": ",".join(sorted(digests)),
        "predicted_samples_per_s_and_hosts": sorted(quality),
        "cpu_s_by_phase": {
            k: round(statistics.median(p.get(k, 0.0) for p in phases), 3)
            for k in sorted({k for p in phases for k in p})
        },
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(11)
    out: dict[str, Any] = {"hosts": args.hosts, "devices": args.hosts * args.gpus}
    with database("postgresql") as url, TestClient(create_app(quiet_settings(url))) as client:
        register(client, args.hosts, args.gpus)
        out["burst_workers"] = submit(client, rng, args.burst)
        instrument()
        out["burst"] = {"jobs": args.burst, **measure(client, args.repeat)}
        ctx = context_of(client.app)  # type: ignore[arg-type]
        with transaction(ctx.sessions) as s:
            scheduler.place_pending(s, datetime.now(UTC))
        submit(client, rng, args.then)
        out["then"] = {"jobs": args.then, **measure(client, args.repeat)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, default=1250)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--burst", type=int, default=200)
    ap.add_argument("--then", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print the result as JSON only")
    args = ap.parse_args()
    out = run(args)
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['hosts']} hosts, {out['devices']} GPUs; burst of {out['burst_workers']} workers")
    for key in ("burst", "then"):
        r = out[key]
        phases = ", ".join(f"{k} {v:.3f}" for k, v in r["cpu_s_by_phase"].items())
        print(
            f"  {key:5s} {r['jobs']:4d} pending: placed {r['jobs_placed']:.0f} in "
            f"{r['wall_s']:.2f} s wall, {r['cpu_s']:.2f} s CPU ({phases}); "
            f"placements {r['placement_digest']}; predicted samples/s and hosts used, all jobs "
            f"{r['predicted_samples_per_s_and_hosts']}"
        )


if __name__ == "__main__":
    main()
