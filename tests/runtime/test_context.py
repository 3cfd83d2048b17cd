"""The per-rank engine and the entrypoint API, without a process group (world of one rank, or
one rank of several whose collectives are no-ops)."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest
import torch
from torch import nn

from agent.runtime.context import MAX_LOSSES, ContextStats, EvenflowContext, dataset_size
from agent.runtime.errors import EntrypointError
from agent.runtime.plan_sync import PlanAgreement, RuntimePlan
from agent.runtime.telemetry import JumpWatch
from agent.runtime.trainer import run_workload
from agent.runtime.workloads import builtin, load_entrypoint
from contract.agent import TelemetryRecord
from contract.spec import JobSpec, WorkloadSpec


def spec(workload: dict[str, object], world: int = 1, **extra: object) -> JobSpec:
    return JobSpec.model_validate(
        {"name": "t", "workload": workload, "global_batch": 32, "workers": world}
        | ({"iterations": 20} if "epochs" not in extra else {})
        | extra
    )


def context(
    job: JobSpec, plan: tuple[int, ...] = (32,), rank: int = 0
) -> tuple[EvenflowContext, list[TelemetryRecord]]:
    records: list[TelemetryRecord] = []
    agreement = PlanAgreement(
        RuntimePlan(1, plan), rank=rank, world_size=len(plan), global_batch=32, pipelined=False
    )
    ctx = EvenflowContext(job, agreement, rank=rank, world_size=len(plan), submit=records.append)
    return ctx, records


@pytest.fixture
def user_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def test_entrypoint_returning_a_workload_trains(user_module: None) -> None:
    ctx, records = context(spec({"entrypoint": "user_workload:make"}, epochs=4))
    run_workload(ctx)
    assert ctx.stats.iterations == 4 * 19  # 600 samples, B = 32: 18 full batches and 1 of 24
    assert ctx.stats.samples_seen == 4 * 600
    assert ctx.stats.losses[-1][1] < 0.1 * ctx.stats.losses[0][1]
    assert [r.iteration for r in records] == list(range(4 * 19))
    assert {r.batch_size for r in records} == {32, 24}
    assert isinstance(ctx.optimizer, torch.optim.SGD) and ctx.optimizer.defaults["momentum"] == 0.5


def test_user_loop_and_a_rank_given_zero_samples(user_module: None) -> None:
    import user_workload

    user_workload.BODY_RUNS.clear()
    user_workload.BATCH_ROWS.clear()
    job = spec({"entrypoint": "user_workload:train"}, world=2)
    ctx, records = context(job, plan=(32, 0), rank=1)  # this rank's share is always 0
    run_workload(ctx)
    # The body runs every iteration, on an empty batch: the same steps as the other rank.
    assert list(range(20)) == user_workload.BODY_RUNS
    assert user_workload.BATCH_ROWS == [0] * 20
    assert ctx.stats.iterations == 20 and ctx.stats.samples_seen == 0
    assert [r.batch_size for r in records] == [0] * 20
    assert all(r.compute_ms < 5 for r in records)

    user_workload.BODY_RUNS.clear()
    ctx, _ = context(job, plan=(32, 0), rank=0)
    run_workload(ctx)
    assert list(range(20)) == user_workload.BODY_RUNS
    assert ctx.stats.samples_seen == 18 * 32 + 24 + 32  # epoch 0 ends with a batch of 24


def test_entrypoint_errors(user_module: None) -> None:
    with pytest.raises(TypeError, match="returned int"):
        run_workload(context(spec({"entrypoint": "user_workload:not_a_workload"}))[0])
    with pytest.raises(RuntimeError, match="neither returned a Workload"):
        run_workload(context(spec({"entrypoint": "user_workload:does_nothing"}))[0])
    with pytest.raises(EntrypointError, match="no attribute 'missing'"):
        load_entrypoint("user_workload:missing")
    with pytest.raises(EntrypointError, match="ModuleNotFoundError: No module named 'no_such"):
        load_entrypoint("no_such_module_xyz:f")


def test_an_entrypoint_that_returns_before_the_jobs_end_names_its_rank(user_module: None) -> None:
    import user_workload

    with pytest.raises(RuntimeError, match="rank 0's entrypoint returned at iteration 0, before"):
        run_workload(context(spec({"entrypoint": "user_workload:train_and_leave"}))[0])
    user_workload.HELD.clear()


def test_misuse_of_the_loop_is_an_error() -> None:
    ctx, _ = context(spec({"builtin": "mlp", "args": {"samples": 64}}))
    x, y = torch.randn(64, 3), torch.randn(64, 1)
    with pytest.raises(RuntimeError, match="prepare"):
        next(iter(ctx.batches((x, y))))
    ctx.prepare(nn.Linear(3, 1))
    with pytest.raises(RuntimeError, match="outside the loop"):
        ctx.step(torch.tensor(1.0, requires_grad=True))
    with pytest.raises(RuntimeError, match=r"went without ctx\.backward"):
        for _ in ctx.batches((x, y)):
            pass  # forgot ctx.step


def test_builtin_workloads_shapes_and_determinism() -> None:
    m = builtin(WorkloadSpec(builtin="mlp", seed=3, args={"samples": 100, "features": 5}))
    assert m.dataset[0].shape == (100, 5) and m.dataset[1].shape == (100, 1)
    m2 = builtin(WorkloadSpec(builtin="mlp", seed=3, args={"samples": 100, "features": 5}))
    assert torch.equal(m.dataset[0], m2.dataset[0])
    assert all(
        torch.equal(a, b) for a, b in zip(m.model.parameters(), m2.model.parameters(), strict=True)
    )
    c = builtin(WorkloadSpec(builtin="cnn-digits"))
    x, y = c.dataset
    assert x.shape == (1797, 1, 8, 8) and y.shape == (1797,) and int(y.max()) == 9
    out = c.model(x[:5])
    assert out.shape == (5, 10)
    assert c.loss_fn(out, y[:5]).item() == pytest.approx(
        5 * nn.functional.cross_entropy(out, y[:5]).item(), rel=1e-5
    )  # a SUM, not a mean
    with pytest.raises(ValueError, match="samples must be int"):
        builtin(WorkloadSpec(builtin="mlp", args={"samples": "many"}))


def test_dataset_size() -> None:
    assert dataset_size((torch.zeros(7, 2), torch.zeros(7))) == 7
    assert dataset_size(torch.zeros(5, 1)) == 5
    with pytest.raises(ValueError, match="disagree"):
        dataset_size((torch.zeros(7, 2), torch.zeros(6)))


def test_loss_history_stays_bounded_and_keeps_the_last() -> None:
    stats = ContextStats()
    n = 10 * MAX_LOSSES + 7
    for i in range(n):
        stats.record_loss(i * 20, float(i), last=i == n - 1)
    assert MAX_LOSSES // 2 <= len(stats.losses) <= MAX_LOSSES
    assert stats.losses[0] == (0, 0.0)
    assert stats.losses[-1] == ((n - 1) * 20, float(n - 1))
    iterations = [i for i, _ in stats.losses]
    assert iterations == sorted(iterations)
    gaps = {b - a for a, b in pairwise(iterations[:-1])}  # the last may be off the stride
    assert len(gaps) == 1  # evenly spread


def test_a_compute_jump_asks_the_sender_to_flush_now() -> None:
    """An emulated 3x slowdown from iteration 10: its first 3 iterations ask for a flush, as do
    the job's first 3 and (world of one: the rank sees its own flag come back in the next
    all-reduce) the iteration after each jump. Nothing else does, unless the machine itself
    made a compute time jump: replayed below."""
    from agent.runtime.emulation import Emulator
    from contract.spec import EmulatedWorker

    job = spec({"builtin": "mlp"})
    records: list[TelemetryRecord] = []
    flushed: list[int] = []
    agreement = PlanAgreement(RuntimePlan(1, (32,)), rank=0, world_size=1, global_batch=32)
    worker = EmulatedWorker.model_validate(
        {
            "per_sample_ms": 0.2,
            "intercept_ms": 40,
            "slowdowns": [{"from_iteration": 10, "to_iteration": 20, "factor": 3}],
        }
    )
    ctx = EvenflowContext(
        job,
        agreement,
        rank=0,
        world_size=1,
        emulator=Emulator(worker),
        submit=records.append,
        flush=lambda: flushed.append(records[-1].iteration),
    )
    run_workload(ctx)
    compute, whole = JumpWatch(), JumpWatch()
    jumps = {
        r.iteration
        for r in records
        if whole.observe(r.plan_version, r.data_ms + r.compute_ms + r.sync_ms)
        | compute.observe(r.batch_size, r.compute_ms)
    }
    early = {0, 1, 2}
    assert set(flushed) == early | jumps | {i + 1 for i in jumps if i + 1 < len(records)}
    assert {10, 11, 12} <= jumps
