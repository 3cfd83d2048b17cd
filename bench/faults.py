"""Issue 13's targets: a job survives the loss of a worker; what a checkpoint costs.

    python bench/faults.py [--json] [--skip-kill] [--skip-overhead]

1. Recovery, on the whole local stack (control plane, two agents, gloo workers): the demo's
   job (cnn-digits, 4 emulated workers at 1:1:2:4 ms per sample + 5 ms, global batch 256)
   with ``checkpoint: {every_iterations: 20}``; rank 1 is killed with SIGKILL mid-run. Reported:
   whether the job succeeds, the restarts, iterations lost (done after the checkpoint resumed
   from, so run twice; target <= every_iterations), and the recovery time from the kill to the
   new attempt resuming at its checkpoint (rank 0's "resumed" log line) and to its first
   iteration beyond what the old attempt had done (its first new telemetry row).
2. Checkpoint overhead at the default interval (100 iterations) for the demo workloads (mlp,
   cnn-digits), one gloo rank in this process, real compute and at the demo's emulated speed:
   the mean write time of a checkpoint over the default interval's iteration time (target
   <= 2%), and the same job's wall time with and without checkpoints (noisier on a shared
   machine).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import torch.distributed as dist

from agent.runtime.plan_sync import RuntimePlan
from agent.runtime.sampler import GlobalBatchSampler
from agent.runtime.trainer import RuntimeOptions, run_training
from contract.enums import JobStatus
from contract.spec import JobSpec
from evenflow.local_cluster import LocalCluster

EVERY = 20
KILL_AT = 60
DEMO_PATTERN = [1.0, 1.0, 2.0, 4.0]


def demo_spec(iterations: int) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "faults-bench",
            "workload": {"builtin": "cnn-digits", "seed": 1},
            "global_batch": 256,
            "iterations": iterations,
            "workers": 4,
            "emulation": [{"per_sample_ms": ms, "intercept_ms": 5.0} for ms in DEMO_PATTERN],
            "checkpoint": {"every_iterations": EVERY},
        }
    )


def _resumed_at(log: Path, after: float) -> float | None:
    """Unix time of the first 'resumed at iteration' line logged after ``after``."""
    pattern = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .* resumed at iteration")
    for line in log.read_text(errors="replace").splitlines():
        m = pattern.match(line)
        if m:
            ts = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if ts >= after:
                return ts
    return None


def kill_one_worker(workdir: Path, iterations: int = 240) -> dict[str, Any]:
    with LocalCluster(workdir, workers=4, agents=2) as cluster:
        job = cluster.submit(demo_spec(iterations))
        deadline = time.monotonic() + 300
        while cluster.last_iteration(job.id) < KILL_AT:
            if time.monotonic() > deadline:
                raise RuntimeError("the job made no progress")
            time.sleep(0.05)
        pids = cluster.worker_pids(job.id)
        killed_at = time.time()
        os.kill(pids[1], signal.SIGKILL)
        done_before = cluster.last_iteration(job.id) + 1
        out = cluster.wait(job.id, poll_s=0.25, timeout_s=600)
        rows = cluster.client.telemetry(job.id).items
        plans = cluster.client.plans(job.id).items
    restart = out.restart_history[0] if out.restart_history else None
    jobdir = workdir / "local-a" / f"job-{job.id}"
    result = json.loads((jobdir / "rank-0.result.json").read_text())
    resumed_from = result.get("resumed_from")
    restart_version = min(
        (p.version for p in plans if restart is not None and p.created_at >= restart.at),
        default=None,
    )
    old = [r for r in rows if restart_version is None or r.plan_version < restart_version]
    new = [r for r in rows if restart_version is not None and r.plan_version >= restart_version]
    old_done = max(r.iteration for r in old) + 1 if old else done_before
    resumed_ts = _resumed_at(jobdir / "rank-0.log", killed_at)
    sampler = GlobalBatchSampler(1797, 256)  # the digits: every epoch ends on 5 samples
    return {
        "status": out.status.value,
        "succeeded": out.status is JobStatus.SUCCEEDED,
        "restarts": out.restarts,
        "reason": restart.reason if restart else None,
        "every_iterations": EVERY,
        "killed_after_iteration": done_before,
        "resumed_from": resumed_from,
        "iterations_lost": None if resumed_from is None else old_done - resumed_from,
        "iterations_lost_recorded": restart.iterations_lost if restart else None,
        "recovery_to_resume_s": None if resumed_ts is None else round(resumed_ts - killed_at, 2),
        "recovery_to_new_progress_s": (
            round(min(r.ts for r in new) - killed_at, 2) if new else None
        ),
        "global_samples": result.get("global_samples"),
        "expected_global_samples": sum(map(sampler.global_count, range(iterations))),
    }


# --------------------------------------------------------------------------- overhead


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _overhead_spec(workload: str, iterations: int, emulated: bool, path: str | None) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "overhead",
            "workload": {"builtin": workload},
            "global_batch": 64,  # one of the demo's four workers' share of 256
            "iterations": iterations,
            "workers": 1,
            "emulation": [{"per_sample_ms": 1.0, "intercept_ms": 5.0}] if emulated else None,
            "checkpoint": {"path": path} if path else None,  # the default interval
        }
    )


def checkpoint_overhead(iterations: int = 400) -> list[dict[str, Any]]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    out = []
    try:
        for workload in ("mlp", "cnn-digits"):
            for emulated in (False, True):
                n = iterations if not emulated else iterations // 2
                walls: dict[bool, list[float]] = {False: [], True: []}
                writes: list[float] = []
                sizes: list[int] = []
                for _ in range(2):
                    for with_ckpt in (False, True):
                        path = tempfile.mkdtemp(prefix="ef-ckpt-") if with_ckpt else None
                        r = run_training(
                            _overhead_spec(workload, n, emulated, path),
                            initial_plan=RuntimePlan(1, (64,)),
                            options=RuntimeOptions(close_deadline_s=1),
                        )
                        walls[with_ckpt].append(r.wall_s / n * 1000.0)
                        writes += [ms for _, _, ms in r.checkpoints]
                        sizes += [b for _, b, _ in r.checkpoints]
                iteration_ms = statistics.median(walls[False])
                write_ms = statistics.median(writes)
                out.append(
                    {
                        "workload": workload,
                        "speed": "emulated (demo)" if emulated else "real compute",
                        "iteration_ms": round(iteration_ms, 2),
                        "checkpoint_kib": round(statistics.median(sizes) / 1024, 1),
                        "write_ms": round(write_ms, 2),
                        "overhead_pct": round(100 * write_ms / (100 * iteration_ms), 3),
                        "wall_with_vs_without_pct": round(
                            100 * (statistics.median(walls[True]) / iteration_ms - 1), 2
                        ),
                    }
                )
    finally:
        dist.destroy_process_group()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--skip-kill", action="store_true")
    parser.add_argument("--skip-overhead", action="store_true")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    if not args.skip_kill:
        with tempfile.TemporaryDirectory(prefix="ef-faults-") as tmp:
            results["kill_one_worker"] = kill_one_worker(Path(tmp))
    if not args.skip_overhead:
        results["checkpoint_overhead"] = checkpoint_overhead()
    if args.json:
        print(json.dumps(results, indent=2))
        return
    k = results.get("kill_one_worker")
    if k:
        print("kill -9 of rank 1 mid-job (4 emulated workers, checkpoint every 20):")
        for key, value in k.items():
            print(f"  {key}: {value}")
    for row in results.get("checkpoint_overhead", []):
        print(
            f"  {row['workload']:<10} {row['speed']:<16} iteration {row['iteration_ms']:7.2f} ms"
            f"  checkpoint {row['checkpoint_kib']:6.1f} KiB in {row['write_ms']:5.2f} ms"
            f"  overhead {row['overhead_pct']:.3f}% at every 100"
            f"  (wall with/without {row['wall_with_vs_without_pct']:+.2f}%)"
        )


if __name__ == "__main__":
    main()
