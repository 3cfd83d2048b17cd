"""What the controller's per-job sweep costs in CPU, by phase, for steady jobs of fleet sizes.

    python bench/controller_cost.py [--sizes 8,16,32,64,128,256] [--rounds 20] [--warmup 12]
                                    [--policy adaptive] [--round-s 2] [--profile out.pstats]
                                    [--json]

An in-process app on a throw-away PostgreSQL database (``bench.ingest.database``; its
controller does not run on its own), hosts of 8 CPU devices, one job per ``--sizes`` entry
placed on them (jobs of ``--policy``, the fleet's default ``adaptive``), each at 1-5
iterations/s (by job). Every round posts each job's ``--round-s`` (2 s) of iterations through
the telemetry API (what the agents' relay posts), with per-rank speeds that differ and a little
noise, the batch sizes following the job's current plan, then runs one controller round
(``Controller.sweep``: every job has new data, so every job is swept). After ``--warmup``
rounds (exploration, the first plans: jobs are settled), ``--rounds`` rounds are measured:

  - controller CPU ms per swept job (``time.thread_time`` of the sweeping thread), split by
    phase: rows (``control_loop.take_in``: the job's new telemetry rows, read once and taken
    in by the tracker, the fit window and the watch), rebalance (``_rebalance``:
    due/propose/apply), detect (``stragglers.detect``: the straggler detector fed and its
    events stored), watch (``stragglers.follow_up``: the normal-model refresh and the ladder,
    also as sub-phases) and the rest (the job's load, transactions);
  - PostgreSQL CPU ms per swept job: the CPU time of this database's backends across the
    round (``psutil``), which includes autovacuum now and then.

At the end it prints each job's plan version and stored straggler events, so two runs
(main's code and a branch) can be checked for the same decisions. ``--profile`` writes a
cProfile of the measured rounds (controller side). Keep it under 2 minutes on a shared box.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("EVENFLOW_LOG_LEVEL", "warning")

from fastapi.testclient import TestClient
from sqlalchemy import event as sa_event
from sqlalchemy import func, select

from bench.ingest import database
from bench.stack import job_spec
from contract.base import MAX_TELEMETRY_RECORDS, PROTOCOL_VERSION
from server.app import create_app
from server.config import Settings
from server.context import context_of
from server.controller import Controller
from server.db import transaction
from server.models import StragglerEvent
from server.services import control_loop, plans, rebalancer, scheduler, stragglers

TOKEN = "ef_bench-admin-token-0123456789"
H = {"Authorization": f"Bearer {TOKEN}"}
GPUS = 8
ROUND_S = 2.0
"""Seconds of training a round covers by default: the relay's flush. At fleet scale a round
over every job takes longer, and each sweep sees that much more (``--round-s``)."""
RATES = [1.0, 2.0, 3.0, 4.0, 5.0]

# ------------------------------------------------------------------ phase timers

_spent: dict[str, float] = defaultdict(float)
_calls: dict[str, int] = defaultdict(int)
_measuring = False


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*a: Any, **kw: Any) -> Any:
        if not _measuring:
            return fn(*a, **kw)
        t0 = time.thread_time()
        try:
            return fn(*a, **kw)
        finally:
            _spent[name] += time.thread_time() - t0
            _calls[name] += 1

    return wrapper


_statements: dict[str, int] = defaultdict(int)
_SERVER = str(Path(__file__).resolve().parents[1] / "server")


def _count_statement(*_: Any) -> None:
    """A statement sent while measuring, counted by the server code that sent it (the first
    frame in ``server/`` outside its database helpers)."""
    if not _measuring:
        return
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_SERVER) and not path.endswith(("/db.py", "/host_answers.py")):
            name = f"{Path(path).stem}.{frame.f_code.co_name}:{frame.f_lineno}"
            _statements[name] += 1
            return
        frame = frame.f_back
    _statements["(elsewhere)"] += 1


def instrument() -> None:
    """Wrap the phases where the control loop looks them up (module globals, at call time)."""
    for name, label in (
        ("take_in", "rows"),  # one read of the new rows for the three below
        ("_rebalance", "rebalance"),
        ("detect", "detect"),
        ("follow_up", "watch"),
    ):
        if hasattr(control_loop, name):
            setattr(control_loop, name, _timed(label, getattr(control_loop, name)))
    for name, label in (
        ("_refresh_normal", "watch.refresh_normal"),
        ("_mitigate", "watch.ladder"),
        ("_take", "detect.timings"),
    ):
        if hasattr(stragglers, name):
            setattr(stragglers, name, _timed(label, getattr(stragglers, name)))
    rebalancer.fits = _timed("fits (any caller)", rebalancer.fits)
    rebalancer.propose = _timed("rebalance.propose", rebalancer.propose)


# ------------------------------------------------------------------ the simulated fleet


class Sim:
    def __init__(
        self, client: TestClient, sizes: list[int], policy: str, seed: int, round_s: float
    ) -> None:
        self.client = client
        self.round_s = round_s
        self.rng = random.Random(seed)
        self.jobs: dict[int, dict[str, Any]] = {}
        hosts = -(-sum(sizes) // GPUS)
        for h in range(hosts):
            body = {
                "protocol_version": PROTOCOL_VERSION,
                "name": f"host-{h}",
                "address": "127.0.0.1",
                "devices": [
                    {"index": i, "kind": "cuda", "model": "A100", "memory_mb": 81920}
                    for i in range(GPUS)
                ],
            }
            r = client.post("/api/v1/hosts/register", json=body, headers=H)
            r.raise_for_status()
        for n, size in enumerate(sizes):
            spec = job_spec(size, policy={"name": policy})
            r = client.post("/api/v1/jobs", json=spec, headers=H)
            r.raise_for_status()
            job_id = int(r.json()["id"])
            self.jobs[job_id] = {
                "size": size,
                "rate": RATES[n % len(RATES)],
                "next": 0,
                "carry": 0.0,
                # per-sample ms of each rank: a heterogeneous fleet
                "speed": [self.rng.choice([0.10, 0.14, 0.2, 0.3]) for _ in range(size)],
            }
        ctx = context_of(client.app)  # type: ignore[arg-type]
        with transaction(ctx.sessions) as s:
            scheduler.place_pending(s, datetime.now(UTC))

    def post_round(self) -> int:
        """Each job's ``round_s`` of iterations, its batch sizes from its current plan. Returns
        rows."""
        ctx = context_of(self.client.app)  # type: ignore[arg-type]
        rows = 0
        with transaction(ctx.sessions) as s:
            current = {j: plans.current(s, j) for j in self.jobs}
            snapshot = {j: (p.version, list(p.batch_sizes)) for j, p in current.items()}
        for job_id, job in self.jobs.items():
            version, sizes = snapshot[job_id]
            job["carry"] += job["rate"] * self.round_s
            n = int(job["carry"])
            job["carry"] -= n
            first = job["next"]
            step = max(1, MAX_TELEMETRY_RECORDS // job["size"])  # iterations per post
            for start in range(first, first + n, step):
                rows += self._post(job_id, job, version, sizes, start, min(first + n, start + step))
            job["next"] = first + n
        return rows

    def _post(
        self, job_id: int, job: dict[str, Any], version: int, sizes: list[int], lo: int, hi: int
    ) -> int:
        """Iterations [lo, hi) of every rank of the job, in one post."""
        cols: dict[str, list[Any]] = defaultdict(list)
        now = time.time()
        for rank in range(job["size"]):
            b = sizes[rank]
            for it in range(lo, hi):
                compute = (2.0 + job["speed"][rank] * b) * self.rng.uniform(0.98, 1.02)
                cols["rank"].append(rank)
                cols["iteration"].append(it)
                cols["plan_version"].append(version)
                cols["batch_size"].append(b)
                cols["data_ms"].append(1.0)
                cols["compute_ms"].append(round(compute, 3))
                cols["sync_ms"].append(5.0)
                cols["ts"].append(now)
        r = self.client.post(f"/api/v1/jobs/{job_id}/telemetry", json={"columns": cols}, headers=H)
        r.raise_for_status()
        return len(cols["rank"])


class PgCpu:
    """CPU seconds of the PostgreSQL backends serving ``dbname``."""

    def __init__(self, dbname: str) -> None:
        self.dbname = dbname

    def read(self) -> float:
        total = 0.0
        for p in psutil.process_iter(["name", "cmdline"]):
            with contextlib.suppress(psutil.Error):
                if p.info["name"] == "postgres" and f" {self.dbname} " in " ".join(
                    p.info["cmdline"] or []
                ):
                    t = p.cpu_times()
                    total += t.user + t.system
        return total


@contextlib.contextmanager
def app_on(url: str) -> Iterator[TestClient]:
    settings = Settings(
        database_url=url,
        admin_token=TOKEN,
        controller="none",
        reaper_interval_s=3600,
        rebalance_interval_s=3600,
    )
    with TestClient(create_app(settings)) as client:
        ctx = context_of(client.app)  # type: ignore[arg-type]
        ctx.wake_controller = lambda _job_id: None
        yield client


def run(args: argparse.Namespace) -> dict[str, Any]:
    global _measuring
    sizes = [int(s) for s in args.sizes.split(",")]
    instrument()
    with database("postgresql") as url, app_on(url) as client:
        ctx = context_of(client.app)  # type: ignore[arg-type]
        sim = Sim(client, sizes, args.policy, args.seed, args.round_s)
        controller = Controller(ctx.settings, engine=ctx.engine, sessions=ctx.sessions)
        sa_event.listen(ctx.engine, "before_cursor_execute", _count_statement)
        controller.state.min_decision_interval_s = 0.0  # rounds stand for 2 s apart
        pg = PgCpu(url.rsplit("/", 1)[1])
        for _ in range(args.warmup):
            sim.post_round()
            controller.sweep()
        profile = cProfile.Profile() if args.profile else None
        cpu = pg_cpu = 0.0
        swept = rows = 0
        per_size: dict[int, float] = defaultdict(float)
        sweep_job = controller._sweep_job

        def timed_sweep_job(job_id: int) -> None:
            t0 = time.thread_time()
            sweep_job(job_id)
            per_size[sim.jobs[job_id]["size"]] += time.thread_time() - t0

        controller._sweep_job = timed_sweep_job  # type: ignore[method-assign]
        for _ in range(args.rounds):
            rows += sim.post_round()
            _measuring = True
            p0, t0 = pg.read(), time.thread_time()
            if profile:
                profile.enable()
            controller.sweep()
            if profile:
                profile.disable()
            cpu += time.thread_time() - t0
            pg_cpu += pg.read() - p0
            _measuring = False
            swept += len(sim.jobs)
        if profile:
            profile.dump_stats(args.profile)
        with transaction(ctx.sessions) as s:
            outcome = {
                f"job{j}x{job['size']}": {
                    "plan": plans.current(s, j).version,
                    "events": s.scalar(select(func.count()).where(StragglerEvent.job_id == j)),
                    "iterations": job["next"],
                }
                for j, job in sim.jobs.items()
            }

    def ms(seconds: float) -> float:
        return round(1000 * seconds / swept, 2)

    phases = {name: ms(t) for name, t in sorted(_spent.items())}
    top = sum(_spent[k] for k in ("rows", "detect", "rebalance", "watch"))
    phases["rest"] = ms(cpu - top)
    return {
        "sizes": sizes,
        "policy": args.policy,
        "rounds": args.rounds,
        "swept": swept,
        "rows_per_round": rows // args.rounds,
        "controller_cpu_ms_per_swept_job": ms(cpu),
        "postgres_cpu_ms_per_swept_job": ms(pg_cpu),
        "phases_ms_per_swept_job": phases,
        "calls": dict(sorted(_calls.items())),
        "statements_per_swept_job": round(sum(_statements.values()) / swept, 2),
        "statements_per_swept_job_by_caller": {
            name: round(n / swept, 2)
            for name, n in sorted(_statements.items(), key=lambda kv: -kv[1])
        },
        "controller_cpu_ms_per_sweep_by_size": {
            size: round(1000 * t / args.rounds, 2) for size, t in sorted(per_size.items())
        },
        "outcome": outcome,
        "load": os.getloadavg(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8,16,32,64,128,256")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=12)
    ap.add_argument("--policy", default="adaptive")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--round-s",
        type=float,
        default=ROUND_S,
        help="seconds of training each round posts per job (a fleet's rounds take 10-20 s)",
    )
    ap.add_argument("--profile", default=None, help="write a cProfile of the measured rounds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = run(args)
    if args.json:
        print(json.dumps(out))
        return
    for k, v in out.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
