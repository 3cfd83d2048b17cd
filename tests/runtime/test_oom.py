"""Out-of-memory recovery inside an iteration: a rank whose pass does not fit redoes its share in
smaller passes (gradients accumulated), the update stays exact, and one that cannot fit even a
single sample fails the job with that reason."""

from __future__ import annotations

import weakref

import pytest
import torch

from agent.runtime.context import EvenflowContext
from agent.runtime.emulation import Emulator
from agent.runtime.oom import MAX_SINGLE_SAMPLE_OOMS, MemoryGuard, OutOfMemoryFailure
from agent.runtime.plan_sync import PlanAgreement, RuntimePlan
from agent.runtime.trainer import run_workload, train_workload
from agent.runtime.workloads import Workload
from contract.agent import TelemetryRecord
from contract.spec import EmulatedWorker, JobSpec


def _run(
    memory_mb: int | None, caps: tuple[int, ...] = ()
) -> tuple[EvenflowContext, list[TelemetryRecord]]:
    spec = JobSpec.model_validate(
        {
            "name": "oom",
            "workload": {"builtin": "mlp", "seed": 3, "args": {"samples": 256}},
            "global_batch": 32,
            "iterations": 6,
            "workers": 1,
        }
    )
    worker = EmulatedWorker(
        per_sample_ms=0.0, memory_mb=memory_mb, memory_base_mb=100.0, memory_per_sample_mb=10.0
    )
    records: list[TelemetryRecord] = []
    agreement = PlanAgreement(
        RuntimePlan(1, (32,), 32, (), caps), rank=0, world_size=1, global_batch=32, pipelined=False
    )
    ctx = EvenflowContext(
        spec, agreement, rank=0, world_size=1, emulator=Emulator(worker), submit=records.append
    )
    run_workload(ctx)
    return ctx, records


def _params(ctx: EvenflowContext) -> list[torch.Tensor]:
    assert ctx.model is not None
    return [p.detach().clone() for p in ctx.model.parameters()]


def test_a_pass_that_does_not_fit_is_redone_smaller_and_the_update_is_unchanged() -> None:
    reference, _ = _run(memory_mb=None)  # no memory limit: one pass of 32
    # 100 + 10 b <= 250 fits b <= 15: a pass of 32 fails, then 16 fails, then passes of 8 fit.
    ctx, records = _run(memory_mb=250)
    assert ctx.stats.ooms == [(0, 32), (0, 16)]  # only in the first iteration: the cap holds
    assert ctx.stats.iterations == 6 and ctx.stats.samples_seen == 6 * 32  # nothing lost
    assert records[0].oom_batch == 16 and all(r.oom_batch is None for r in records[1:])
    assert [r.peak_memory_mb for r in records] == [180.0] * 6  # passes of 8: 100 + 10 * 8
    assert [r.pass_size for r in records] == [8] * 6  # what the peak belongs to
    for a, b in zip(_params(ctx), _params(reference), strict=True):
        assert (a - b).abs().max().item() < 1e-6  # the same SGD update, to 1e-6
    assert [loss for _, loss in ctx.stats.losses] == pytest.approx(
        [loss for _, loss in reference.stats.losses], rel=1e-5
    )


def test_a_plan_cap_avoids_the_error_altogether() -> None:
    ctx, records = _run(memory_mb=250, caps=(15,))  # passes of 15, 15, 2
    assert ctx.stats.ooms == [] and all(r.oom_batch is None for r in records)
    assert {r.peak_memory_mb for r in records} == {250.0}


def test_a_rank_that_cannot_fit_one_sample_fails_the_job_with_the_reason() -> None:
    with pytest.raises(OutOfMemoryFailure, match="single sample per pass"):
        _run(memory_mb=50)  # the base (100 MB) alone does not fit


def test_guard_lowers_below_the_failing_size_and_keeps_it_for_later_plans() -> None:
    guard = MemoryGuard(rank=1)
    plan = RuntimePlan(3, (40, 40), 80, (), (0, 64))
    assert guard.cap(plan) == 64
    assert guard.failed(3, 64, MemoryError()) == 32
    assert guard.cap(plan) == 32  # lowered while this plan is in force
    later = RuntimePlan(4, (40, 40), 80, (), (0, 100))
    assert guard.cap(later) == 63  # a new plan's cap, but never the size that failed
    for _ in range(MAX_SINGLE_SAMPLE_OOMS - 1):
        assert guard.failed(4, 1, MemoryError()) == 1
    with pytest.raises(OutOfMemoryFailure):
        guard.failed(4, 1, MemoryError())


class _Hungry(torch.nn.Module):
    """A layer whose activations are tracked: a pass of more than ``fits`` samples runs out of
    memory in its forward, as CUDA's allocator raises it, while its activations are alive."""

    def __init__(self, fits: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(32, 1)
        self.fits = fits
        self.failed_activations: list[weakref.ref[torch.Tensor]] = []
        self.alive_at_retry: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.alive_at_retry.append(sum(r() is not None for r in self.failed_activations))
        activation = torch.tanh(x).repeat(1, 64)  # what the failed pass holds on the device
        if len(x) > self.fits:
            self.failed_activations.append(weakref.ref(activation))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 294.00 MiB.")
        return self.linear(activation[:, :32])


def test_the_failed_pass_memory_is_freed_before_the_share_is_redone() -> None:
    """A pass that runs out of device memory holds almost all of it in its activations and graph,
    which its exception's traceback keeps alive: the retry must not start while they are held
    (on a real H100 the retry's first input copy ran out of memory and failed the job)."""
    spec = JobSpec.model_validate(
        {
            "name": "oom-frees",
            "workload": {"builtin": "mlp", "args": {"samples": 256}},
            "global_batch": 32,
            "iterations": 3,
            "workers": 1,
        }
    )
    agreement = PlanAgreement(
        RuntimePlan(1, (32,)), rank=0, world_size=1, global_batch=32, pipelined=False
    )
    ctx = EvenflowContext(spec, agreement, rank=0, world_size=1, submit=lambda r: None)
    hungry = _Hungry(fits=10)
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(256, 32, generator=g), torch.randn(256, 1, generator=g))
    train_workload(ctx, Workload(hungry, data, lambda out, y: ((out - y) ** 2).sum()))
    assert ctx.stats.ooms == [(0, 32), (0, 16)] and ctx.stats.iterations == 3
    assert len(hungry.failed_activations) == 2
    assert hungry.alive_at_retry and max(hungry.alive_at_retry) == 0
