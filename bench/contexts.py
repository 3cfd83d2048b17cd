"""A job's shipped code reaching many agents, and what it costs the server's memory.

    PYTHONPATH=. python bench/contexts.py [--mib 50] [--agents 8] [--json]

Starts ``evenflow server`` (its API and controller processes, SQLite by default, or
``EVENFLOW_DATABASE_URL`` with ``{run}`` in it, which becomes ``tiny`` and ``big``: one empty
database per run, e.g. ``postgresql+psycopg://postgres@127.0.0.1/ctx_{run}``) and ``--agents`` agent processes of one CPU slot each, all on this
machine; uploads a context of ``--mib`` MiB (a package plus incompressible bytes, so the archive
is that big), submits a job of one rank per agent that runs from it, and samples the resident
memory of the server's processes every 50 ms from before the upload until every rank has
reported its first iteration. The same job with a context of a few KiB, on a fresh server, runs
first: starting a job of that many ranks costs the server memory of its own (its caches, the
ranks' first telemetry), and the difference between the two is what the context's bytes cost.
Target: less than the context's size (the upload and every agent's download are streamed a
piece at a time, never held whole, let alone once per agent).

Prints what it measured; ``--json`` prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from agent.client import ApiClient, make_http
from contract.api import TokenCreate
from contract.enums import Role
from evenflow import contexts
from evenflow.local_cluster import server_process

ENTRY = """
import torch
from torch import nn


def main(ctx):
    print("rank", ctx.rank, "runs the shipped code", flush=True)
    x = torch.randn(64, 4)
    model, _ = ctx.prepare(nn.Linear(4, 1))
    for xb in ctx.batches(x):
        ctx.step(model(xb).pow(2).sum())
"""


class Sampler:
    """The summed resident memory of a process and its children, sampled in a thread."""

    def __init__(self, pid: int, every_s: float = 0.05) -> None:
        self.root, self.every_s = psutil.Process(pid), every_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        total = 0
        for p in [self.root, *self.root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), self.rss()))
            time.sleep(self.every_s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _context(directory: Path, mib: int) -> contexts.PackedContext:
    code = directory / "code"
    pkg = code / "shipped_bench"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(ENTRY)
    (code / "weights.bin").write_bytes(os.urandom(mib * 2**20))
    return contexts.pack_directory(code, directory / "context.tar.gz")


def _first_iterations(admin: ApiClient, job_id: int, ranks: int, timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        page = admin.telemetry(job_id, since_iteration=0, limit=1000)
        if len({r.rank for r in page.items}) >= ranks:
            return time.monotonic()
        job = admin.job(job_id)
        if job.status.terminal and job.status.value != "succeeded":
            raise RuntimeError(f"job {job_id} {job.status.value}: {job.error}")
        time.sleep(0.2)
    raise TimeoutError(f"the ranks of job {job_id} did not all report in {timeout_s} s")


def run(name: str, mib: int, agents: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="evenflow-bench-contexts-") as d:
        root = Path(d)
        packed = _context(root, mib)
        admin_token = "ef_" + secrets.token_urlsafe(24)
        env = {
            **os.environ,
            "EVENFLOW_ADMIN_TOKEN": admin_token,
            "EVENFLOW_DATABASE_URL": os.environ.get(
                "EVENFLOW_DATABASE_URL", f"sqlite:///{root / 'evenflow.db'}"
            ).replace("{run}", name),
            "EVENFLOW_CONTEXT_MAX_BYTES": str(max(64, 2 * mib) * 2**20),
        }
        with server_process(env) as (url, server):
            admin = ApiClient(make_http(url, admin_token, timeout=60.0), admin_token)
            procs = []
            try:
                for i in range(agents):
                    name = f"bench-{i}"
                    token = admin.create_token(
                        TokenCreate(name=f"agent-{name}", role=Role.AGENT, host=name)
                    ).token
                    cmd = [sys.executable, "-m", "evenflow.cli", "agent", "--server", url]
                    cmd += ["--name", name, "--address", "127.0.0.1", "--cpu-workers", "1"]
                    cmd += ["--workdir", str(root / name), "--log-level", "warning"]
                    agent_env = {**env, "EVENFLOW_TOKEN": token, "OMP_NUM_THREADS": "1"}
                    log = (root / f"{name}.log").open("wb")
                    procs.append(
                        subprocess.Popen(cmd, env=agent_env, stdout=log, stderr=subprocess.STDOUT)
                    )
                while len(admin.hosts().items) < agents:
                    time.sleep(0.2)
                time.sleep(1.0)
                with Sampler(server.pid) as memory:
                    time.sleep(0.5)
                    baseline = max(rss for _, rss in memory.samples)
                    t0 = time.monotonic()
                    admin.upload_context(packed.path, packed.sha256)
                    uploaded = time.monotonic()
                    job = admin.submit(
                        {
                            "name": "shipped",
                            "workload": {
                                "entrypoint": "shipped_bench.train:main",
                                "context": packed.sha256,
                            },
                            "global_batch": 8 * agents,
                            "iterations": 20,
                            "workers": agents,
                        }
                    )
                    reached = _first_iterations(admin, job.id, agents, timeout_s=600)
                peak = max(rss for t, rss in memory.samples if t >= t0)
                after_upload = max(
                    (rss for t, rss in memory.samples if t0 <= t <= uploaded), default=baseline
                )
            finally:
                for p in procs:
                    p.terminate()
                for p in procs:
                    try:
                        p.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        p.kill()
    growth = peak - baseline
    return {
        "context_mib": round(packed.size_bytes / 2**20, 1),
        "agents": agents,
        "upload_s": round(uploaded - t0, 2),
        "first_iteration_everywhere_s": round(reached - t0, 2),
        "server_rss_baseline_mib": round(baseline / 2**20, 1),
        "server_rss_peak_mib": round(peak / 2**20, 1),
        "server_growth_by_the_upload_mib": round((after_upload - baseline) / 2**20, 1),
        "server_growth_mib": round(growth / 2**20, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=50)
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    small, big = run("tiny", 0, a.agents), run("big", a.mib, a.agents)
    cost = big["server_growth_mib"] - small["server_growth_mib"]
    report = {
        "tiny_context": small,
        "big_context": big,
        "growth_due_to_the_context_mib": round(cost, 1),
        "growth_due_to_the_context_vs_its_size": round(cost / big["context_mib"], 3),
    }
    print(json.dumps(report, indent=None if a.json else 2))


if __name__ == "__main__":
    main()
