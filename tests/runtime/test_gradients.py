"""The distributed update equals single-process SGD on the same global batch (to 1e-6)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from agent.runtime.context import EvenflowContext
from agent.runtime.gradients import Exchange, GradientSync, broadcast_module
from agent.runtime.plan_sync import PlanAgreement, RuntimePlan
from agent.runtime.sampler import GlobalBatchSampler
from contract.spec import JobSpec

from .spawn import run_ranks

N, B, LR = 45, 12, 0.2
# One plan per iteration: a change after iteration 1, a rank with 0 samples, and (N % B = 9) a
# final partial global batch at iteration 3 split by largest remainder.
PLANS = [[5, 4, 3], [5, 4, 3], [0, 9, 3], [6, 0, 6], [2, 2, 8]]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(N, 5, generator=g), torch.randn(N, 2, generator=g)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))


def _loss_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y, reduction="sum")


def _exact_worker(
    rank: int, world: int, exchange: Exchange = "auto", direct_max: int = 2**20
) -> list[list[float]]:
    x, y = _data()
    model = _model(seed=100 + rank)  # different on purpose: the broadcast must fix it
    broadcast_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sync = GradientSync(model.parameters(), exchange=exchange, direct_max_elements=direct_max)
    # "auto" takes the direct exchange for a small CPU buffer on gloo, all_reduce past the bound.
    small = sync.numel * world <= direct_max
    method = "direct" if exchange == "direct" or (exchange == "auto" and small) else "all_reduce"
    sampler = GlobalBatchSampler(N, B, seed=1)
    for it, plan in enumerate(PLANS):
        idx = sampler.local_indices(it, plan, rank)
        loss = None
        if len(idx):  # a rank with 0 samples runs no forward, only joins the collective
            loss = _loss_sum(model, x[idx], y[idx])
            loss.backward()
        sync.all_reduce(sampler.global_count(it), loss)
        assert sync.last_method == method
        opt.step()
        sync.zero_grad()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def _naive_worker(rank: int, world: int) -> list[list[float]]:
    """DDP's rule: per-rank mean loss, gradients averaged with equal weight per rank."""
    x, y = _data()
    model = _model(seed=100)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sampler = GlobalBatchSampler(N, B, seed=1)
    for it, plan in enumerate(PLANS):
        idx = sampler.local_indices(it, plan, rank)
        opt.zero_grad(set_to_none=False)
        if len(idx):
            (_loss_sum(model, x[idx], y[idx]) / len(idx)).backward()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


CAPPED = [
    RuntimePlan(1, (5, 4, 3), B, (), (2, 0, 1)),  # rank 0: passes of 2, 2, 1; rank 2: 1, 1, 1
    RuntimePlan(2, (0, 9, 3), B, (), (1, 4, 0)),  # rank 1 runs 9 samples as 4 + 4 + 1
    RuntimePlan(3, (6, 0, 6), B, (), (5, 5, 6)),  # rank 0: 5 + 1; rank 2 fits in one pass
]
"""The same plans with memory caps: shares above a cap run as accumulated micro-batches."""


def _context_worker(
    rank: int, world: int, capped: bool = False, sync: str = "coalesced"
) -> tuple[list[list[float]], list[tuple[int, int]]]:
    """The same through the runtime's loop: plans arrive from rank 0's proposer mid-run."""
    spec = JobSpec.model_validate(
        {
            "name": "exact",
            "workload": {"builtin": "mlp", "learning_rate": LR, "seed": 1},
            "global_batch": B,
            "iterations": len(PLANS),
            "workers": world,
        }
    )
    plans = (
        CAPPED
        if capped
        else [
            RuntimePlan(1, (5, 4, 3)),
            *(RuntimePlan(v, p) for v, p in ((2, (0, 9, 3)), (3, (6, 0, 6)))),
        ]
    )
    proposals = iter([None, plans[1], plans[2], None, None])
    agreement = PlanAgreement(
        plans[0],
        rank=rank,
        world_size=world,
        global_batch=B,
        propose=lambda: next(proposals),
    )
    ctx = EvenflowContext(spec, agreement, rank=rank, world_size=world, gradient_sync=sync)
    model, _ = ctx.prepare(_model(seed=100 + rank))
    assert isinstance(model, DistributedDataParallel) == (sync == "overlap")
    for xb, yb in ctx.batches(_data()):
        if capped:
            cap = agreement.current.cap_of(rank)
            assert cap is None or len(xb) <= cap  # no pass ever holds more than the cap
        ctx.step(_loss_sum(model, xb, yb))
    return [p.detach().flatten().tolist() for p in model.parameters()], agreement.history


def _both_worker(rank: int, world: int) -> tuple[object, ...]:
    return (
        _exact_worker(rank, world),
        _naive_worker(rank, world),
        _context_worker(rank, world),
        _exact_worker(rank, world, "all_reduce"),
        _exact_worker(rank, world, "auto", direct_max=10),
        _context_worker(rank, world, capped=True),
    )


def _single_process() -> list[torch.Tensor]:
    x, y = _data()
    model = _model(seed=100)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sampler = GlobalBatchSampler(N, B, seed=1)
    for it in range(len(PLANS)):
        epoch, k = sampler.position(it)
        idx = sampler.permutation(epoch)[k * B : k * B + sampler.global_count(it)]
        opt.zero_grad()
        (_loss_sum(model, x[idx], y[idx]) / len(idx)).backward()
        opt.step()
    return [p.detach().flatten() for p in model.parameters()]


def _max_diff(a: list[list[float]], b: list[torch.Tensor]) -> float:
    return max((torch.tensor(p) - q).abs().max().item() for p, q in zip(a, b, strict=True))


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_unequal_batches_match_single_process_sgd_and_naive_mean_does_not() -> None:
    """Directly with GradientSync (both ways of summing), and through the runtime's loop."""
    reference = _single_process()
    results = run_ranks(_both_worker, 3)
    for exact in ([r[0] for r in results], [r[3] for r in results], [r[4] for r in results]):
        for rank_params in exact:
            assert _max_diff(rank_params, reference) < 1e-6
        assert exact[0] == exact[1] == exact[2]  # bitwise: the ranks never drift apart
    naive = results[0][1]
    assert _max_diff(naive, reference) > 1e-3
    for params, history in (r[2] for r in results):
        assert history == [(0, 1), (2, 2), (3, 3)]  # a change, then a rank with 0 samples
        assert _max_diff(params, reference) < 1e-6
    for params, history in (r[5] for r in results):  # gradient accumulation under memory caps
        assert history == [(0, 1), (2, 2), (3, 3)]
        assert _max_diff(params, reference) < 1e-6


def _overlap_worker(rank: int, world: int) -> tuple[object, ...]:
    return (
        _context_worker(rank, world, sync="overlap"),
        _context_worker(rank, world, capped=True, sync="overlap"),
    )


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_ddp_with_the_exact_hook_matches_single_process_sgd() -> None:
    """PyTorch's DDP (bucketed all-reduces in backward) under the same plans: a plan change, a
    rank with 0 samples (it all-reduces zeros), and shares run as accumulated passes under
    no_sync on some ranks and not others."""
    reference = _single_process()
    for params, history in (r for result in run_ranks(_overlap_worker, 3) for r in result):
        assert history == [(0, 1), (2, 2), (3, 3)]
        assert _max_diff(params, reference) < 1e-6


def test_sync_keeps_grads_as_views_and_recovers_from_set_to_none() -> None:
    model = _model(seed=0)
    sync = GradientSync(model.parameters())
    x, y = _data()
    _loss_sum(model, x, y).backward()
    expected = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    mean = sync.all_reduce(N, _loss_sum(model, x, y))  # no process group: world of one
    assert mean.item() == pytest.approx(_loss_sum(model, x, y).item() / N, rel=1e-6)
    for p, e in zip(model.parameters(), expected, strict=True):
        assert p.grad is not None
        assert torch.allclose(p.grad, e / N)
    torch.optim.SGD(model.parameters(), lr=0.1).zero_grad(set_to_none=True)
    _loss_sum(model, x, y).backward()  # grads now live outside the buffer
    sync.all_reduce(N)
    # Gradients, then loss, count, stop and withdrawal slots and a checksum pair per rank.
    assert sync.numel == sum(p.numel() for p in model.parameters()) + 1 + 3 + 2
    flat = sync._buckets[0].flat
    for p in model.parameters():
        assert p.grad is not None
        assert p.grad.data_ptr() >= flat.data_ptr()  # rebound into the buffer
    sync.zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def _flag_worker(rank: int, world: int) -> list[bool]:
    model = _model(seed=0)
    sync = GradientSync(model.parameters(), control_slots=3, flag=True)
    assert sync.has_flag
    seen = []
    for it in range(5):
        if it == 2 and rank == 1:
            sync.raise_flag()
        if it == 3:  # several ranks at once count once
            sync.raise_flag()
        sync.send_control([it, -it, 7] if rank == 0 else None)
        sync.all_reduce(1)
        assert sync.received_control() == [it, -it, 7]  # the flag leaves the control slots be
        seen.append(sync.flag_seen())
        assert not sync.flag_seen()  # read once
    return seen


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_any_rank_raises_the_flag_and_every_rank_sees_it_once() -> None:
    for seen in run_ranks(_flag_worker, 3):
        assert seen == [False, False, True, True, False]
