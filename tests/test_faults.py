"""A job survives a worker killed with SIGKILL: the whole local stack (control plane, two agents,
gloo workers) restarts it from its last checkpoint and it succeeds, having consumed every
global batch exactly once."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from contract.enums import JobStatus
from contract.spec import JobSpec
from evenflow.local_cluster import LocalCluster

B, ITERATIONS, EVERY = 64, 160, 10


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_job_survives_a_worker_killed_mid_run(tmp_path: Path) -> None:
    spec = JobSpec.model_validate(
        {
            "name": "survivor",
            "workload": {"builtin": "mlp", "seed": 3},
            "global_batch": B,
            "iterations": ITERATIONS,
            "workers": 2,
            "policy": {"name": "equal"},
            # slow enough on a loaded machine that the kill lands mid-run
            "emulation": [{"per_sample_ms": 1.0}, {"per_sample_ms": 1.0}],
            "checkpoint": {"every_iterations": EVERY},
        }
    )
    with LocalCluster(tmp_path, workers=2, agents=2) as cluster:
        job = cluster.submit(spec)
        deadline = time.monotonic() + 240
        while cluster.last_iteration(job.id) < 35 or not cluster.client.checkpoints(job.id).items:
            assert time.monotonic() < deadline, "the job made no progress"
            time.sleep(0.2)
        os.kill(cluster.worker_pids(job.id)[1], signal.SIGKILL)
        done = cluster.wait(job.id, timeout_s=400)
        checkpoints = cluster.client.checkpoints(job.id).items

    assert done.status is JobStatus.SUCCEEDED, done.error
    assert done.restarts == 1 and done.attempt == 1
    (restart,) = done.restart_history
    assert restart.reason.startswith("rank 1 killed by SIGKILL")
    assert restart.resumed_from is not None and restart.resumed_from >= 30
    assert restart.iterations_lost is not None and restart.iterations_lost <= 2 * EVERY
    assert {c.attempt for c in checkpoints} == {0, 1}
    result = json.loads((tmp_path / "local-a" / f"job-{job.id}" / "rank-0.result.json").read_text())
    assert result["resumed_from"] == restart.resumed_from
    assert result["iterations"] == ITERATIONS - restart.resumed_from
    assert result["global_samples"] == ITERATIONS * B  # every batch once, none twice
    assert (tmp_path / "local-a" / f"job-{job.id}" / "checkpoints" / "final.pt").exists()
