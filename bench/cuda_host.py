"""A real CUDA host end to end: the control plane, an agent that finds the GPUs through torch, and
jobs on them (NCCL) and on the same host's CPU (gloo), as a user on a GPU machine runs them.

    PYTHONPATH=. python bench/cuda_host.py [--iterations 40] [--global-batch 1024] [--json]

Needs a machine with a CUDA GPU; it is not part of ``make test`` or ``make bench`` (this project's
machine has none). Two scenarios, each on its own local stack (SQLite, agents as threads):

1. ``nccl``: the agent registers every CUDA device torch sees (name and memory as torch gives
   them); a ResNet-50 job (224 px, fp32, synthetic images, torchvision) runs on all of them with
   NCCL. The default global batch, 1024 on one 80 GB card, does not fit one pass (about
   4.6 GB + 91 MB a sample on an H100, ``tests/data/h100_tb_curves.csv``): its first pass runs
   out of real device memory, and the runtime must redo it in smaller passes, losing no
   iteration, while the control plane caps the rank. Reported: the process group each rank
   formed (from its log), out-of-memory errors and iterations lost, the final plan's memory
   caps, the fitted speed and memory models against the H100 figures, the peak memory fraction
   and steady samples/s against the same step in plain PyTorch at the same pass size.
2. ``cpu``: two CPU ranks on the same host (``cnn-digits``): each must run gloo on the CPU with
   no GPU in sight (a CPU rank that picked NCCL on a CUDA host failed before).

Prints one JSON object with ``--json``, else a short summary per scenario.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench import torchvision_workload as tv
from bench.memory import BASE_MB, PER_SAMPLE_MB
from contract.api import TelemetryOut
from contract.enums import PolicyName
from contract.spec import JobSpec, PolicySpec, WorkloadSpec
from evenflow.experiment import measure
from evenflow.local_cluster import LocalCluster

H100_RESNET50_FP32 = {
    "memory_base_mb": BASE_MB,
    "memory_per_sample_mb": PER_SAMPLE_MB,
    "per_sample_ms": 0.53,
}
"""ResNet-50 224 px fp32 on one H100 80GB (tests/data/h100_tb_curves.csv): peak memory fit and
the step time's slope past b = 32."""
GROUP_LINE = re.compile(r"rank (\d+) of (\d+): (\w+) process group on (\S+)")


def process_groups(workdir: Path, job_id: int) -> dict[int, str]:
    """rank -> "backend on device", as each rank's log says it formed its process group."""
    out: dict[int, str] = {}
    for log in workdir.glob(f"*/job-{job_id}/rank-*.log"):
        for m in GROUP_LINE.finditer(log.read_text(errors="replace")):
            out[int(m.group(1))] = f"{m.group(3)} on {m.group(4)}"
    return out


def log_tail(workdir: Path, job_id: int, lines: int = 40) -> dict[str, list[str]]:
    """The last lines of each rank's log, for a job that failed."""
    return {
        log.name: log.read_text(errors="replace").splitlines()[-lines:]
        for log in sorted(workdir.glob(f"*/job-{job_id}/rank-*.log"))
    }


def iterations_lost(rows: list[TelemetryOut], iterations: int, global_batch: int) -> int:
    """Iterations missing or trained on fewer samples than the global batch."""
    samples: dict[int, int] = {}
    for r in rows:
        samples[r.iteration] = samples.get(r.iteration, 0) + r.batch_size
    return sum(1 for it in range(iterations) if samples.get(it) != global_batch)


def plain_samples_per_s(
    global_batch: int, pass_size: int, iterations: int, threads: int
) -> dict[str, float]:
    """The same training step without Evenflow, on this process's first GPU: plain PyTorch,
    ``global_batch`` random images a step from the same CPU dataset, in passes of
    ``pass_size`` whose gradients accumulate, one SGD step; samples/s over ``iterations``
    after two warm-ups, with ``threads`` CPU threads (the agent gives each worker
    ``OMP_NUM_THREADS``, 1 unless set); also the host time of the input gather and copy."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    device = torch.device("cuda:0")
    x, y = tv.images(2 * global_batch, 0)
    net = tv.model(0).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(2)

    data_s = 0.0

    def step() -> None:
        nonlocal data_s
        idx = torch.randperm(len(x), generator=g)[:global_batch]
        opt.zero_grad(set_to_none=True)
        for part in idx.split(pass_size):
            t = time.perf_counter()
            xb, yb = x[part].to(device), y[part].to(device)
            data_s += time.perf_counter() - t
            (tv.loss(net(xb), yb) / global_batch).backward()
        opt.step()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    data_s = 0.0
    t0 = time.perf_counter()
    for _ in range(iterations):
        step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    torch.set_num_threads(before)
    return {
        "threads": threads,
        "samples_per_s": global_batch * iterations / elapsed,
        "input_wall_ms": data_s / iterations * 1000,  # gather + copy, waits included
    }


def nccl(
    iterations: int, global_batch: int, entrypoint: str = "bench.torchvision_workload:resnet50"
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d, LocalCluster(Path(d), cuda=True) as cluster:
        devices = [dev for h in cluster.client.hosts().items for dev in h.devices]
        spec = JobSpec(
            name="resnet50-cuda",
            workload=WorkloadSpec(entrypoint=entrypoint, args={"images": 2 * global_batch}),
            global_batch=global_batch,
            iterations=iterations,
            workers=len(devices),
            policy=PolicySpec(name=PolicyName.ADAPTIVE, rebalance_every=10),
            max_restarts=0,
        )
        job = cluster.wait(cluster.submit(spec).id, timeout_s=900)
        out: dict[str, Any] = {
            "devices": [
                {"kind": dev.kind.value, "model": dev.model, "memory_mb": dev.memory_mb}
                for dev in devices
            ],
            "status": job.status.value,
            "error": job.error,
            "process_groups": process_groups(Path(d), job.id),
        }
        if job.status.value != "succeeded":
            out["log_tail"] = log_tail(Path(d), job.id)
            return out
        rows = list(cluster.client.telemetry(job.id).items)
        m = measure(rows, [dev.memory_mb for dev in devices])
        plans = cluster.client.plans(job.id).items
        models = cluster.client.models(job.id).items
        steady = [r for r in rows if r.iteration >= iterations // 2]
        out.update(
            samples_per_s=m.samples_per_s,
            median_data_ms=statistics.median(r.data_ms for r in steady),
            median_compute_ms=statistics.median(r.compute_ms for r in steady),
            median_sync_ms=statistics.median(r.sync_ms for r in steady),
            median_iteration_s=statistics.median(
                b.ts - a.ts for a, b in itertools.pairwise(sorted(steady, key=lambda r: r.ts))
            ),
            median_pass_size=statistics.median(r.pass_size or r.batch_size for r in steady),
            ooms=m.ooms,
            oom_pass_sizes=sorted({r.oom_batch for r in rows if r.oom_batch is not None}),
            iterations_lost=iterations_lost(rows, iterations, global_batch),
            peak_memory_mb=max((r.peak_memory_mb or 0.0) for r in rows),
            peak_memory_fraction=m.peak_memory_fraction,
            plans=[(p.version, p.batch_sizes, p.memory_caps, p.reason) for p in plans],
            models=[mo.model_dump(mode="json") for mo in models],
            h100_reference=H100_RESNET50_FP32,
        )
    if len(devices) != 1:
        return out
    # The GPU is free again: the same step as plain PyTorch, at the job's steady pass size.
    pass_size = int(out["median_pass_size"])
    plain = [
        plain_samples_per_s(global_batch, pass_size, max(5, iterations // 4), threads)
        for threads in (1, torch.get_num_threads())
    ]
    for p in plain:
        p["evenflow_over_plain"] = out["samples_per_s"] / p["samples_per_s"]
    out["plain_pytorch"] = {"pass_size": pass_size, "runs": plain}
    return out


def cpu(iterations: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d, LocalCluster(Path(d), workers=2, agents=1) as cluster:
        spec = JobSpec(
            name="digits-cpu-on-cuda-host",
            workload=WorkloadSpec(builtin="cnn-digits"),
            global_batch=128,
            iterations=iterations,
            workers=2,
            policy=PolicySpec(name=PolicyName.MINMAX),
            max_restarts=0,
        )
        job = cluster.wait(cluster.submit(spec).id, timeout_s=600)
        return {
            "cuda_available_here": torch.cuda.is_available(),
            "status": job.status.value,
            "error": job.error,
            "process_groups": process_groups(Path(d), job.id),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--global-batch", type=int, default=1024)
    ap.add_argument("--scenarios", default="nccl,cpu")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    chosen = args.scenarios.split(",")
    results: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if "nccl" in chosen:
        if not torch.cuda.is_available():
            raise SystemExit("the nccl scenario needs a CUDA GPU (torch sees none)")
        results["nccl"] = nccl(args.iterations, args.global_batch)
    if "cpu" in chosen:
        results["cpu"] = cpu(max(20, args.iterations))
    if args.json:
        print(json.dumps(results, indent=2, default=str))
        return
    for name, r in results.items():
        print(f"== {name}: {json.dumps(r, default=str)}")


if __name__ == "__main__":
    main()
