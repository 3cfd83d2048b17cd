"""``engine: fsdp``: the model sharded by FSDP2 over real gloo ranks, unequal shares weighted
exactly, every rank running the same passes, sharded checkpoints resumed on another world size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from agent.runtime.checkpoint import (
    CheckpointEngineError,
    Checkpointer,
    CheckpointStore,
)
from agent.runtime.context import EvenflowContext
from agent.runtime.fsdp import ShardingError, equal_passes, find_blocks
from agent.runtime.plan_sync import PlanAgreement, RuntimePlan
from agent.runtime.sampler import GlobalBatchSampler
from contract.spec import JobSpec

from .spawn import run_ranks
from .test_loop import VOCAB, Script, Tokens, pad, token_loss

B, LR, CLIP = 16, 0.02, 0.5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ff = nn.Linear(12, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.ff(x))


class LayeredLM(nn.Module):
    """Embedding, a stack of blocks in a ModuleList (what fsdp shards by default), a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(VOCAB, 12)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(12, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _spec(world: int, iterations: int, engine: str = "fsdp") -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "sharded",
            "workload": {"entrypoint": "x:y", "seed": 4},
            "global_batch": B,
            "iterations": iterations,
            "workers": world,
            "engine": engine,
        }
    )


def _plans(world: int) -> list[tuple[int, RuntimePlan]]:
    """Unequal shares, a change, a rank with nothing, then a cap on rank 0 (every rank then
    runs as many passes as rank 0 needs)."""
    if world == 2:
        return [
            (2, RuntimePlan(2, (11, 5), B)),
            (4, RuntimePlan(3, (16, 0), B)),
            (6, RuntimePlan(4, (9, 7), B, memory_caps=(3, 0))),
        ]
    return [
        (2, RuntimePlan(2, (8, 5, 3), B)),
        (4, RuntimePlan(3, (10, 0, 6), B)),
        (6, RuntimePlan(4, (4, 5, 7), B, memory_caps=(0, 0, 2))),
    ]


def _context(
    rank: int,
    world: int,
    iterations: int,
    script: list[tuple[int, RuntimePlan]],
    checkpointer: Checkpointer | None = None,
    engine: str = "fsdp",
) -> EvenflowContext:
    proposer = Script(script)
    first = RuntimePlan(1, tuple(B // world + (r < B % world) for r in range(world)), B)
    agreement = PlanAgreement(
        first, rank=rank, world_size=world, global_batch=B, propose=proposer, pipelined=False
    )
    ctx = EvenflowContext(
        _spec(world, iterations, engine),
        agreement,
        rank=rank,
        world_size=world,
        checkpointer=checkpointer,
    )
    proposer.ctx = ctx
    return ctx


def _local(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's part on this rank (a whole tensor under ddp)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _train(ctx: EvenflowContext, scheduled: bool) -> dict[str, Any]:
    layered = LayeredLM()
    full = sum(p.numel() for p in layered.parameters())
    opt = torch.optim.AdamW(layered.parameters(), lr=LR, weight_decay=0.01)  # before prepare
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=ctx.spec.iterations)
    model, _ = ctx.prepare(layered, opt)
    passes: list[tuple[int, int]] = []
    for batch in ctx.batches(DataLoader(Tokens(), collate_fn=pad)):
        passes.append((ctx.iteration, batch["ids"].shape[0]))
        loss, tokens = token_loss(model, batch)
        ctx.backward(loss, count=tokens)
        if ctx.sync_gradients:
            nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            if scheduled:
                sched.step()
            opt.zero_grad()
    local = sum(_local(p).numel() for p in model.parameters())
    moments = sum(
        _local(t).numel()
        for s in opt.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    final = ctx.save_final(str(Path(ctx.output_dir) / "final.pt"))
    return {
        "passes": passes,
        "history": ctx.agreement.history,
        "local": local,
        "full": full,
        "moments": moments,
        "final": final,
    }


def _exact_worker(rank: int, world: int, out: str) -> dict[str, Any]:
    ctx = _context(rank, world, 10, _plans(world))
    ctx._output_dir = out
    return _train(ctx, scheduled=True)


def _reference(iterations: int, scheduled: bool) -> dict[str, torch.Tensor]:
    data, model = Tokens(), LayeredLM()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=iterations)
    sampler = GlobalBatchSampler(len(data), B, seed=4)
    for it in range(iterations):
        epoch, k = sampler.position(it)
        idx = sampler.permutation(epoch)[k * B : k * B + sampler.global_count(it)]
        loss, tokens = token_loss(model, pad([data[i] for i in idx.tolist()]))
        (loss / tokens).backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        if scheduled:
            sched.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _assert_close(path: str, reference: dict[str, torch.Tensor]) -> None:
    final = torch.load(path, weights_only=True)
    assert final.keys() == reference.keys()  # the user's names, no wrapper prefix
    for name, ref in reference.items():
        torch.testing.assert_close(final[name], ref, rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_training_with_unequal_shares_equals_one_process(
    world: int, tmp_path: Path
) -> None:
    runs = run_ranks(_exact_worker, world, str(tmp_path), timeout=140)
    _assert_close(str(tmp_path / "final.pt"), _reference(10, scheduled=True))
    for rank, run in enumerate(runs):
        assert run["history"] == [(0, 1), (3, 2), (5, 3), (7, 4)]  # (blocking agreement)
        # each rank holds its shard: at most 1/world of the parameters (+ rounding per tensor)
        assert run["local"] <= run["full"] / world + 12 * 6
        assert run["moments"] == 2 * run["local"]  # AdamW's two moments, sharded the same
        per_it: dict[int, list[int]] = {}
        for it, n in run["passes"]:
            per_it.setdefault(it, []).append(n)
        # shares differ, pass counts do not: under the cap, every rank ran as many passes as
        # the capped rank needed (rank 0 at 3 per pass: 3; rank 2 at 2 per pass: 4)
        assert all(len(per_it[it]) == (3 if world == 2 else 4) for it in range(7, 10))
        assert all(len(per_it[it]) == 1 for it in range(7))
        # plan 3 gave rank 1 nothing: it still ran its (empty) pass (iteration 5 is the
        # epoch's short last batch of 10)
        assert sum(per_it[6]) == _plans(world)[1][1].batch_sizes[rank]
    # identical pass counts on every rank, every iteration
    per_rank = [[it for it, _ in run["passes"]] for run in runs]
    assert all(p == per_rank[0] for p in per_rank)


def _resume_worker(rank: int, world: int, path: str, iterations: int) -> dict[str, Any]:
    cp = Checkpointer(_store(path), every=5)
    ctx = _context(rank, world, iterations, [], checkpointer=cp)
    ctx._output_dir = path
    result = _train(ctx, scheduled=False)
    result["resumed"] = ctx.stats.resumed_from
    return result


def _store(path: str) -> CheckpointStore:
    store = CheckpointStore(path)
    store.check_writable()  # (the trainer's check; it creates the directory)
    return store


def _ddp_then_fsdp(rank: int, world: int, path: str) -> str:
    cp = Checkpointer(_store(path), every=2)
    ctx = _context(rank, world, 2, [], checkpointer=cp, engine="ddp")
    ctx._output_dir = path
    _train(ctx, scheduled=False)
    ctx = _context(rank, world, 4, [], checkpointer=Checkpointer(_store(path), every=2))
    try:
        _train(ctx, scheduled=False)
    except CheckpointEngineError as exc:
        return str(exc)
    return "resumed"


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_a_sharded_checkpoint_resumes_on_another_world_size(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    first = run_ranks(_resume_worker, 2, path, 10, timeout=100)  # checkpoints at 5 and 10
    assert first[0]["resumed"] is None
    assert (tmp_path / "ckpt" / "ckpt-000000000010.shards").is_dir()
    second = run_ranks(_resume_worker, 3, path, 16, timeout=100)  # resharded onto three
    assert [r["resumed"] for r in second] == [10, 10, 10]
    _assert_close(str(tmp_path / "ckpt" / "final.pt"), _reference(16, scheduled=False))
    # a checkpoint of the other engine is refused, fatally, naming both
    reasons = run_ranks(_ddp_then_fsdp, 2, str(tmp_path / "mixed"), timeout=100)
    assert all("written by a job of engine ddp; this job's engine is fsdp" in r for r in reasons)


def test_blocks_and_passes() -> None:
    assert len(find_blocks(LayeredLM(), None)) == 3
    assert len(find_blocks(LayeredLM(), [Block])) == 3
    with pytest.raises(ShardingError, match="has no block to shard"):
        find_blocks(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)), None)
    with pytest.raises(ShardingError, match="has no Block to shard"):
        find_blocks(nn.Sequential(nn.Linear(2, 2)), [Block])
    idx = torch.arange(7)
    # rank 1 needs ceil(7/2) = 4 passes, so rank 0 runs its 9 as 4 too; a 0 share runs 4 empty
    assert [len(c) for c in equal_passes((9, 7, 0), (None, 2, None), 1, idx)] == [2, 2, 2, 1]
    assert [len(c) for c in equal_passes((9, 7, 0), (None, 2, None), 2, idx[:0])] == [0] * 4
    assert [len(c) for c in equal_passes((9, 7), (None, None), 0, torch.arange(9))] == [9]


def _misuse_worker(rank: int, world: int) -> list[str]:
    from torch.nn.parallel import DistributedDataParallel

    seen = []
    for wrap in ("ddp", "fsdp"):
        ctx = _context(rank, world, 2, [], engine=wrap)
        model = LayeredLM()
        wrapped = DistributedDataParallel(model) if wrap == "ddp" else model
        if wrap == "fsdp":
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
        try:
            ctx.prepare(wrapped)
        except TypeError as exc:
            seen.append(str(exc))
    # DDP's overlap: a loss computed with the module it wraps never reaches DDP
    spec = _spec(world, 2, "ddp").model_copy(update={"gradient_sync": "overlap"})
    agreement = PlanAgreement(
        RuntimePlan(1, (8, 8), B), rank=rank, world_size=world, global_batch=B
    )
    ctx = EvenflowContext(spec, agreement, rank=rank, world_size=world)
    inner = LayeredLM()
    ctx.prepare(inner)  # (the DDP wrapper it returns goes unused: the mistake)
    try:
        for batch in ctx.batches(DataLoader(Tokens(), collate_fn=pad)):
            ctx.backward(token_loss(inner, batch)[0])
    except RuntimeError as exc:
        seen.append(str(exc))
    return seen


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_a_model_wrapped_twice_or_bypassed_is_an_error_that_says_what_to_do() -> None:
    for seen in run_ranks(_misuse_worker, 2, timeout=80):
        assert "already wrapped in DistributedDataParallel: pass your module itself" in seen[0]
        assert "already wrapped in FSDPLayeredLM" in seen[1]
        assert (
            "did not reach DDP: compute the loss with the model ctx.prepare() returned" in seen[2]
        )
