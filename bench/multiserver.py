"""Two `evenflow server` instances on one PostgreSQL database and nothing else shared.

    python bench/multiserver.py [--json] [--rounds 100]

Each server has its own runtime directory (so no Unix socket bus can join them): a plan
committed through one reaches the other by LISTEN/NOTIFY. Measured:

- wake: an override applied through server A, until a long-poll held by server B answers with
  the new plan (from A's answer to B's answer, and from the moment the override was sent);
- fail-over: server A (whose controller holds the advisory lock) is killed with SIGKILL, until
  B's standby controller holds the lock.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ingest import PG_ADMIN, database
from bench.stack import TOKEN
from contract.base import PROTOCOL_VERSION
from evenflow.local_cluster import server_process
from server.locks import CONTROLLER_LOCK_KEY

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def env_for(db_url: str, name: str, runtime: str) -> dict[str, str]:
    return {
        **os.environ,
        "EVENFLOW_DATABASE_URL": f"{db_url}?application_name={name}",
        "EVENFLOW_ADMIN_TOKEN": TOKEN,
        "EVENFLOW_HOST_LOST_AFTER_S": "86400",
        "TMPDIR": runtime,
    }


def controller_holder(db_url: str) -> str | None:
    key = CONTROLLER_LOCK_KEY & 0xFFFFFFFFFFFFFFFF
    engine = create_engine(db_url)
    try:
        with engine.connect() as c:
            return c.execute(
                text(
                    "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a "
                    "USING (pid) WHERE l.locktype = 'advisory' AND l.granted "
                    "AND l.objsubid = 1 AND l.classid::bigint = :hi AND l.objid::bigint = :lo"
                ),
                {"hi": (key >> 32) & 0xFFFFFFFF, "lo": key & 0xFFFFFFFF},
            ).scalar()
    finally:
        engine.dispose()


def wait_for_holder(db_url: str, name: str, timeout: float = 30.0) -> float:
    t0 = time.monotonic()
    while controller_holder(db_url) != name:
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"{name} never took the controller lock")
        time.sleep(0.05)
    return time.monotonic() - t0


def job_with_plan(base: str, workers: int = 4) -> int:
    host = {
        "protocol_version": PROTOCOL_VERSION,
        "name": "bench-host",
        "address": "127.0.0.1",
        "devices": [
            {"index": i, "kind": "cpu", "model": "CPU", "memory_mb": 1024} for i in range(workers)
        ],
    }
    httpx.post(f"{base}/api/v1/hosts/register", json=host, headers=AUTH).raise_for_status()
    spec = {
        "name": "bench",
        "workload": {"builtin": "mlp"},
        "global_batch": 64 * workers,
        "iterations": 10**8,
        "workers": workers,
    }
    r = httpx.post(f"{base}/api/v1/jobs", json=spec, headers=AUTH)
    r.raise_for_status()
    job = int(r.json()["id"])
    deadline = time.monotonic() + 30
    while httpx.get(f"{base}/api/v1/jobs/{job}/plan", headers=AUTH).status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError("the job never got a plan")
        time.sleep(0.1)
    return job


def wake_rounds(a: str, b: str, job: int, rounds: int) -> dict[str, Any]:
    """Per round: hold a long-poll on b, override through a, time b's answer."""
    after_ack: list[float] = []
    after_send: list[float] = []
    with httpx.Client(headers=AUTH, timeout=40) as ca, httpx.Client(headers=AUTH, timeout=40) as cb:
        known: int = cb.get(f"{b}/api/v1/jobs/{job}/plan").json()["version"]

        def long_poll(version: int) -> tuple[httpx.Response, float]:
            """b's answer to a long-poll that knows ``version``, and when it came."""
            answer = cb.get(
                f"{b}/api/v1/jobs/{job}/plan",
                params={"known_version": version, "wait_s": 20},
            )
            return answer, time.monotonic()

        with ThreadPoolExecutor(1) as pool:
            for i in range(rounds):
                waiting = pool.submit(long_poll, known)
                time.sleep(0.15)  # the long-poll is held by b before the override is sent
                first = 32 + (i % 2) * 8
                body = {"kind": "set_batches", "batch_sizes": [first, 64 - first, 64, 128]}
                body["reason"] = f"round {i}"
                sent = time.monotonic()
                ca.post(f"{a}/api/v1/jobs/{job}/overrides", json=body).raise_for_status()
                acked = time.monotonic()
                answer, answered = waiting.result(timeout=30)
                if answer.status_code != 200 or answer.json()["version"] <= known:
                    raise RuntimeError(f"round {i}: b answered {answer.status_code}")
                known = answer.json()["version"]
                after_ack.append(max(0.0, answered - acked))
                after_send.append(answered - sent)
    return {"rounds": rounds, **quantiles(after_ack, "after_ack_"), **quantiles(after_send, "")}


def quantiles(values: list[float], prefix: str) -> dict[str, float]:
    v = sorted(values)
    return {
        f"{prefix}p50_ms": round(1000 * statistics.median(v), 2),
        f"{prefix}p99_ms": round(1000 * v[min(len(v) - 1, int(len(v) * 0.99))], 2),
        f"{prefix}max_ms": round(1000 * v[-1], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out: dict[str, Any] = {"postgres": PG_ADMIN.rsplit("@", 1)[-1]}
    with database("postgresql") as db_url, ExitStack() as stack:
        runtime = stack.enter_context(tempfile.TemporaryDirectory())
        servers = {}
        for name in ("server-a", "server-b"):
            Path(runtime, name).mkdir()
            env = env_for(db_url, name, str(Path(runtime, name)))
            servers[name] = stack.enter_context(server_process(env))
            if name == "server-a":
                wait_for_holder(db_url, "server-a")
        (a, proc_a), (b, _) = servers["server-a"], servers["server-b"]
        job = job_with_plan(a)
        out["wake"] = wake_rounds(a, b, job, args.rounds)
        proc_a.kill()
        out["failover_s"] = round(wait_for_holder(db_url, "server-b"), 2)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    w = out["wake"]
    print(f"two servers on one PostgreSQL ({out['postgres']}), {w['rounds']} overrides through A:")
    print(
        f"  B's long-poll answered {w['p50_ms']} ms p50 / {w['p99_ms']} ms p99 / {w['max_ms']} ms"
        f" max after the override was sent ({w['after_ack_p50_ms']} / {w['after_ack_p99_ms']} ms"
        " after A acknowledged it)"
    )
    print(f"  controller fail-over after SIGKILL of A: {out['failover_s']} s")


if __name__ == "__main__":
    main()
