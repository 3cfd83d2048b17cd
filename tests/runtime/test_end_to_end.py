"""Three gloo ranks with emulated speeds 1:2:4, a fake control plane that re-plans mid-run."""

from __future__ import annotations

import statistics
import threading
from datetime import UTC, datetime

import pytest

from agent.runtime.sampler import GlobalBatchSampler
from agent.runtime.trainer import RunResult, RuntimeOptions, run_training
from contract.agent import PlanOut, TelemetryAck, TelemetryBatch
from contract.enums import PlanSource
from contract.spec import JobSpec

from .spawn import run_ranks

B, ITERATIONS, SWITCH_AFTER, SAMPLES = 56, 48, 12, 2048  # 2048 % 56 = 32: a partial batch
PER_SAMPLE_MS = [0.8, 0.4, 0.2]  # speeds 1 : 2 : 4
EQUAL, BALANCED = [19, 19, 18], [8, 16, 32]


def spec() -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "e2e",
            "workload": {"builtin": "mlp", "learning_rate": 0.05, "args": {"samples": SAMPLES}},
            "global_batch": B,
            "iterations": ITERATIONS,
            "workers": 3,
            "emulation": [{"per_sample_ms": ms} for ms in PER_SAMPLE_MS],
        }
    )


def plan(version: int, sizes: list[int]) -> PlanOut:
    return PlanOut(
        job_id=1,
        version=version,
        batch_sizes=sizes,
        global_batch=B,
        source=PlanSource.INITIAL if version == 1 else PlanSource.AUTOMATIC,
        reason="test",
        created_at=datetime.now(UTC),
    )


class FakeControlPlane:
    """In-memory stand-in for the server: stores telemetry (deduplicated on (rank, iteration))
    and, once it has rows past ``SWITCH_AFTER``, serves a plan balanced for the speeds."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rows: dict[tuple[int, int], tuple[int, int, float]] = {}
        self.plan = plan(1, EQUAL)

    def fetch_plan(self) -> PlanOut:
        with self.lock:
            return self.plan

    def post_telemetry(self, batch: TelemetryBatch) -> TelemetryAck:
        with self.lock:
            dup = 0
            for r in batch.all_records():
                key = (r.rank, r.iteration)
                dup += key in self.rows
                self.rows[key] = (r.plan_version, r.batch_size, r.compute_ms)
            if any(i >= SWITCH_AFTER for _, i in self.rows) and self.plan.version == 1:
                self.plan = plan(2, BALANCED)
            return TelemetryAck(accepted=len(batch.all_records()) - dup, duplicates=dup)


def _worker(rank: int, world: int) -> tuple[RunResult, dict[tuple[int, int], tuple]]:
    server = FakeControlPlane()  # each rank's "server" holds that rank's rows
    options = RuntimeOptions(
        plan_poll_s=0.01, telemetry_flush_records=4, telemetry_flush_s=0.05, close_deadline_s=5
    )
    result = run_training(
        spec(),
        fetch_plan=server.fetch_plan,
        post_telemetry=server.post_telemetry,
        initial_plan=server.fetch_plan(),
        options=options,
    )
    return result, server.rows


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_emulated_heterogeneous_run_with_a_mid_run_plan_change() -> None:
    results = run_ranks(_worker, 3, timeout=90)
    rows: dict[tuple[int, int], tuple] = {}
    for r, server_rows in results:
        assert r.emulated and r.iterations == ITERATIONS
        assert r.agreement_transport == "channel"  # rode in the gradient all-reduce
        assert r.telemetry is not None and r.telemetry.pending == 0 and r.telemetry.dropped == 0
        rows.update(server_rows)
    # every telemetry row arrived
    assert set(rows) == {(rank, i) for rank in range(3) for i in range(ITERATIONS)}
    # the same plan version on every rank at every iteration, and sizes summing to B (to the
    # samples left in the epoch at its last, partial, global batch)
    counts = [GlobalBatchSampler(SAMPLES, B).global_count(i) for i in range(ITERATIONS)]
    assert counts.count(B) == ITERATIONS - 1
    for i in range(ITERATIONS):
        versions = {rows[(rank, i)][0] for rank in range(3)}
        assert len(versions) == 1
        assert sum(rows[(rank, i)][1] for rank in range(3)) == counts[i]
    histories = [r.plan_history for r, _ in results]
    assert histories[0] == histories[1] == histories[2]
    assert [v for _, v in histories[0]] == [1, 2]
    switch = histories[0][1][0]
    assert SWITCH_AFTER < switch < ITERATIONS - 10

    # the switch removed the imbalance: compute times were ~4:1 under the equal split, ~1:1 after
    def ratio(iterations: range) -> float:
        per_rank = [statistics.median(rows[(k, i)][2] for i in iterations) for k in range(3)]
        return max(per_rank) / min(per_rank)

    assert ratio(range(1, switch)) > 2.5
    assert ratio(range(switch + 1, ITERATIONS)) < 1.5
    # training made progress and every rank agrees on the global loss
    losses = [r.losses for r, _ in results]
    assert losses[0] == losses[1] == losses[2]
    first, last = losses[0][0][1], losses[0][-1][1]
    assert last < 0.5 * first
    assert sum(r.samples_seen for r, _ in results) == sum(counts)
    assert all(r.global_samples == sum(counts) for r, _ in results)
