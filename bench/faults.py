"""Issue 13's targets: a job survives the loss of a worker; what a checkpoint costs.

    python bench/faults.py [--json] [--skip-kill] [--skip-host] [--skip-overhead]

1. Recovery, on the whole local stack (control plane, two agents, gloo workers): the demo's
   job (cnn-digits, 4 emulated workers at 1:1:2:4 ms per sample + 5 ms, global batch 256)
   with ``checkpoint: {every_iterations: 20}``; rank 1 is killed with SIGKILL mid-run. Reported:
   whether the job succeeds, the restarts, iterations lost (done after the checkpoint resumed
   from, so run twice; target <= every_iterations), and the recovery time from the kill to the
   new attempt resuming at its checkpoint (rank 0's "resumed" log line) and to its first
   iteration beyond what the old attempt had done (its first new telemetry row).
2. Two faults in one job, on the same stack with each agent a process of its own: rank 1 is
   killed with SIGKILL mid-run as in 1; once the restarted job has gone 40 iterations past what
   it had done, the *other* host goes down as a crash would (SIGKILL to its agent's process
   group and to its workers') and its agent is started again 5 s later with the same name,
   token and workdir. Checkpoints go to a directory both hosts share. Reported for each fault:
   the restart's reason, iterations lost (target <= every_iterations), recovery to the resume
   and to the first iteration beyond what the old attempt had done; for the host, when it was
   placed again after its agent came back; and that the job succeeds having consumed exactly
   its global samples.
3. Checkpoint overhead at the default interval (100 iterations) for the demo workloads (mlp,
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


def demo_spec(iterations: int, checkpoint_path: str | None = None) -> JobSpec:
    checkpoint: dict[str, Any] = {"every_iterations": EVERY}
    if checkpoint_path is not None:
        checkpoint["path"] = checkpoint_path
    return JobSpec.model_validate(
        {
            "name": "faults-bench",
            "workload": {"builtin": "cnn-digits", "seed": 1},
            "global_batch": 256,
            "iterations": iterations,
            "workers": 4,
            "emulation": [{"per_sample_ms": ms, "intercept_ms": 5.0} for ms in DEMO_PATTERN],
            "checkpoint": checkpoint,
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


# --------------------------------------------------------------------------- two faults

SECOND_FAULT_AFTER = 40
"""Iterations past what the job had done at the first fault before the host goes down."""
AGENT_DOWN_S = 5.0

_RESUMED = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .* rank 0: resumed at iteration (\d+)"
)


def _resumes(workdir: Path, job_id: int) -> list[tuple[float, int]]:
    """(unix time, iteration) of every 'rank 0: resumed at iteration' line, whichever host
    rank 0 ran on, oldest first."""
    out = []
    for log in workdir.glob(f"local-*/job-{job_id}/rank-0.log"):
        for line in log.read_text(errors="replace").splitlines():
            m = _RESUMED.match(line)
            if m:
                ts = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                out.append((ts, int(m.group(2))))
    return sorted(out)


def worker_then_host(workdir: Path, iterations: int = 360) -> dict[str, Any]:
    """Issue 13's second fault scenario; see the module docstring (2)."""
    spec = demo_spec(iterations, checkpoint_path=str(workdir / "shared-checkpoints"))
    faults: list[dict[str, Any]] = []
    placed_again_at: float | None = None
    with LocalCluster(workdir, workers=4, agents=2, agent_processes=True) as cluster:
        job = cluster.submit(spec)
        deadline = time.monotonic() + 300
        while cluster.last_iteration(job.id) < KILL_AT:
            if time.monotonic() > deadline:
                raise RuntimeError("the job made no progress")
            time.sleep(0.05)
        victim_host = cluster.worker_hosts(job.id)[1]
        pid = cluster.worker_pids(job.id)[1]
        faults.append({"fault": f"kill -9 of rank 1 (worker pid {pid} on {victim_host})"})
        faults[0]["at"] = time.time()
        os.kill(pid, signal.SIGKILL)
        faults[0]["killed_after_iteration"] = cluster.last_iteration(job.id) + 1
        target = faults[0]["killed_after_iteration"] + SECOND_FAULT_AFTER
        deadline = time.monotonic() + 600
        while cluster.client.job(job.id).restarts < 1 or cluster.last_iteration(job.id) < target:
            if time.monotonic() > deadline:
                raise RuntimeError("the job did not recover from the worker's kill")
            time.sleep(0.05)
        host = next(n for n in cluster.agents_by_name if n != victim_host)
        faults.append({"fault": f"host {host} down (agent and workers SIGKILLed), back in 5 s"})
        faults[1]["at"] = time.time()
        killed = cluster.kill_agent(host)
        faults[1]["killed_after_iteration"] = cluster.last_iteration(job.id) + 1
        faults[1]["pids_killed"] = len(killed)
        time.sleep(AGENT_DOWN_S)
        faults[1]["agent_restarted_at"] = time.time()
        cluster.start_agent(host)
        deadline = time.monotonic() + 900
        while True:
            out = cluster.client.job(job.id)
            if placed_again_at is None and out.restarts >= 2 and out.status.value != "pending":
                placed_again_at = time.time()
            if out.status.terminal:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job.id} did not finish")
            time.sleep(0.1)
        rows = cluster.client.telemetry(job.id).items
        plans = cluster.client.plans(job.id).items
    resumes = _resumes(workdir, job.id)
    versions = [
        min((p.version for p in plans if p.created_at >= r.at), default=None)
        for r in out.restart_history
    ]
    for i, fault in enumerate(faults):
        restart = out.restart_history[i] if i < len(out.restart_history) else None
        lo = versions[i - 1] if i > 0 else 0
        hi = versions[i] if i < len(versions) else None
        old = [
            r for r in rows if r.plan_version >= (lo or 0) and (hi is None or r.plan_version < hi)
        ]
        new = [r for r in rows if hi is not None and r.plan_version >= hi]
        old_done = max(r.iteration for r in old) + 1 if old else fault["killed_after_iteration"]
        resumed = next(((ts, it) for ts, it in resumes if ts >= fault["at"]), None)
        at = fault.pop("at")
        fault.update(
            {
                "restart_reason": restart.reason if restart else None,
                "resumed_from": resumed[1] if resumed else None,
                "done_by_old_attempt": old_done,
                "iterations_lost": old_done - resumed[1] if resumed else None,
                "iterations_lost_recorded": restart.iterations_lost if restart else None,
                "recovery_to_resume_s": round(resumed[0] - at, 2) if resumed else None,
                "recovery_to_new_progress_s": (
                    round(min(r.ts for r in new) - at, 2) if new else None
                ),
            }
        )
        if "agent_restarted_at" in fault:
            back = fault.pop("agent_restarted_at")
            fault["placed_again_after_agent_back_s"] = (
                round(placed_again_at - back, 2) if placed_again_at else None
            )
    results = sorted(
        workdir.glob(f"local-*/job-{job.id}/rank-0.result.json"), key=lambda p: p.stat().st_mtime
    )
    result = json.loads(results[-1].read_text()) if results else {}
    sampler = GlobalBatchSampler(1797, 256)
    return {
        "status": out.status.value,
        "succeeded": out.status is JobStatus.SUCCEEDED,
        "error": out.error,
        "restarts": out.restarts,
        "every_iterations": EVERY,
        "faults": faults,
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
    parser.add_argument("--skip-host", action="store_true")
    parser.add_argument("--skip-overhead", action="store_true")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    if not args.skip_kill:
        with tempfile.TemporaryDirectory(prefix="ef-faults-") as tmp:
            results["kill_one_worker"] = kill_one_worker(Path(tmp))
    if not args.skip_host:
        with tempfile.TemporaryDirectory(prefix="ef-faults-") as tmp:
            results["worker_then_host"] = worker_then_host(Path(tmp))
    if not args.skip_overhead:
        results["checkpoint_overhead"] = checkpoint_overhead()
    if args.json:
        print(json.dumps(results, indent=2))
        return
    _print(results)


def _print(results: dict[str, Any]) -> None:
    k = results.get("kill_one_worker")
    if k:
        print("kill -9 of rank 1 mid-job (4 emulated workers, checkpoint every 20):")
        for key, value in k.items():
            print(f"  {key}: {value}")
    h = results.get("worker_then_host")
    if h:
        print("kill -9 of rank 1, then the other host down for 5 s (one job, checkpoint every 20):")
        for key, value in h.items():
            if key != "faults":
                print(f"  {key}: {value}")
        for fault in h["faults"]:
            print(f"  {fault['fault']}:")
            for key, value in fault.items():
                if key != "fault":
                    print(f"    {key}: {value}")
    for row in results.get("checkpoint_overhead", []):
        print(
            f"  {row['workload']:<10} {row['speed']:<16} iteration {row['iteration_ms']:7.2f} ms"
            f"  checkpoint {row['checkpoint_kib']:6.1f} KiB in {row['write_ms']:5.2f} ms"
            f"  overhead {row['overhead_pct']:.3f}% at every 100"
            f"  (wall with/without {row['wall_with_vs_without_pct']:+.2f}%)"
        )


if __name__ == "__main__":
    main()
