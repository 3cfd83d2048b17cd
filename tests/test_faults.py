"""A job survives a worker killed with SIGKILL: the whole local stack (control plane, two agents,
gloo workers) restarts it from its last checkpoint and it succeeds, having consumed every
global batch exactly once; and a rank out of the all-reduce group that is killed costs no
restart at all."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from contract.enums import JobStatus, PlanSource
from contract.spec import JobSpec
from evenflow.local_cluster import LocalCluster
from server.context import context_of
from server.db import transaction
from server.models import Job
from server.services import plans

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


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_an_excluded_rank_that_dies_leaves_the_job_and_the_others_finish_it(
    tmp_path: Path,
) -> None:
    """Shared membership on the whole local stack: rank 1 is out of the all-reduce group
    (partial all-reduce) when it is killed, so the job goes on without it, with no restart:
    rank 0 on its host keeps running, the end does not wait for it, every batch is used once."""
    iterations, b = 1500, 64
    spec = JobSpec.model_validate(
        {
            "name": "goes-on",
            "workload": {"builtin": "mlp", "seed": 5},
            "global_batch": b,
            "iterations": iterations,
            "workers": 3,  # the minimum: one rank may go
            "max_workers": 4,
            "policy": {"name": "equal"},  # no automatic plan: only the exclusion below
            "max_restarts": 0,  # a restart would fail the job, naming why
        }
    )
    with LocalCluster(tmp_path, workers=4, agents=2) as cluster:
        job = cluster.submit(spec)
        deadline = time.monotonic() + 240
        while cluster.last_iteration(job.id) < 10:
            assert time.monotonic() < deadline, "the job made no progress"
            time.sleep(0.05)
        # What the straggler ladder does to a far slower rank, through the same service:
        # rank 1 out of the all-reduce group, its samples spread over the others.
        context = context_of(cluster.app)
        with context.write_lock, transaction(context.sessions) as s:
            row = s.get(Job, job.id)
            assert row is not None and len(row.workers) == 4
            sizes = plans.equal_split(b, 3)
            version = plans.create(
                s,
                row,
                [sizes[0], 0, sizes[1], sizes[2]],
                PlanSource.AUTOMATIC,
                "straggler ladder (test): rank 1 out of the group",
                by="test",
                excluded=[1],
            ).version
        while not any(
            r.plan_version >= version and r.rank == 0
            for r in cluster.client.telemetry(job.id, since_iteration=0).items
        ):
            assert time.monotonic() < deadline, "the exclusion never came into force"
            time.sleep(0.05)
        hosts = cluster.worker_hosts(job.id)
        assert cluster.last_iteration(job.id) < iterations - 200, "too late to be mid-run"
        os.kill(cluster.worker_pids(job.id)[1], signal.SIGKILL)
        done = cluster.wait(job.id, poll_s=0.25, timeout_s=400)
        newest = cluster.client.plans(job.id).items[0]

    assert done.status is JobStatus.SUCCEEDED, done.error
    assert (done.restarts, done.attempt, done.restart_history) == (0, 0, [])
    (gone,) = done.departures
    assert (gone.rank, gone.attempt) == (1, 0)
    assert gone.reason.startswith("rank 1 killed by SIGKILL")
    assert newest.departed == [1] and 1 in newest.excluded and newest.batch_sizes[1] == 0
    assert {w.rank: w.state.value for w in done.workers} == {
        0: "succeeded",
        1: "failed",
        2: "succeeded",
        3: "succeeded",
    }
    results = {
        rank: json.loads(
            (tmp_path / host / f"job-{job.id}" / f"rank-{rank}.result.json").read_text()
        )
        for rank, host in hosts.items()
        if rank != 1
    }
    assert not (tmp_path / hosts[1] / f"job-{job.id}" / "rank-1.result.json").exists()
    for result in results.values():
        assert result["global_samples"] == iterations * b  # every batch once, none twice
    assert any(h == hosts[1] for r, h in hosts.items() if r != 1)  # a sibling kept running
