"""The whole stack: a local control plane, an agent and two real worker processes training with
their own per-rank credentials; the job's loss curve is then on the API, one point per
iteration from the leader, falling."""

from __future__ import annotations

from pathlib import Path

import pytest

from contract.spec import JobSpec
from evenflow.local_cluster import LocalCluster

ITERATIONS = 40


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_job_run_by_the_agent_ends_with_its_loss_curve_on_the_api(tmp_path: Path) -> None:
    spec = JobSpec.model_validate(
        {
            "name": "curves",
            "workload": {"builtin": "mlp", "learning_rate": 0.05},
            "global_batch": 32,
            "iterations": ITERATIONS,
            "workers": 2,
            "policy": {"name": "equal"},
        }
    )
    with LocalCluster(tmp_path, workers=2, agents=1) as cluster:
        job = cluster.submit(spec)
        done = cluster.wait(job.id, timeout_s=180)
        assert done.status.value == "succeeded", done.error
        metrics = cluster.client.metrics(job.id, points=1000)
    assert metrics.names == ["loss"]
    (loss,) = metrics.series
    assert loss.rank == 0 and loss.iteration == list(range(ITERATIONS))
    assert loss.last_iteration == ITERATIONS - 1 and loss.last_value == loss.value[-1]
    assert loss.value[-1] < 0.5 * loss.value[0]
