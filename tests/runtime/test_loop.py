"""The loop people write: ``ctx.backward``, ``ctx.sync_gradients``, their own step, on real gloo
ranks; exact against one process, and never silently different."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from agent.runtime.context import EvenflowContext, ReplicaDivergence
from agent.runtime.plan_sync import PlanAgreement, RuntimePlan
from agent.runtime.sampler import GlobalBatchSampler
from contract.spec import JobSpec

from .spawn import run_ranks

N, B, VOCAB, ITERATIONS, LR, CLIP = 90, 16, 23, 14, 0.02, 0.5

# (iteration from which the leader proposes it, plan): unequal shares, a change, rank 1 given
# nothing for a while, then rank 0 capped at 3 samples per pass (its share comes as passes).
SCRIPT = [
    (2, RuntimePlan(2, (11, 5), B)),
    (5, RuntimePlan(3, (16, 0), B)),
    (8, RuntimePlan(4, (9, 7), B, memory_caps=(3, 0))),
]


class Tokens(Dataset[dict[str, torch.Tensor]]):
    """Variable-length sequences (3..12 tokens), as text is."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        lengths = torch.randint(3, 13, (N,), generator=g)
        self.seqs = [torch.randint(1, VOCAB, (int(n),), generator=g) for n in lengths]

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"ids": self.seqs[i]}


def pad(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The padding collate: pad to the batch's longest, with a mask."""
    longest = max((len(it["ids"]) for it in items), default=1)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    mask = torch.zeros(len(items), longest, dtype=torch.bool)
    for j, it in enumerate(items):
        ids[j, : len(it["ids"])] = it["ids"]
        mask[j, : len(it["ids"])] = True
    return {"ids": ids, "mask": mask}


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(VOCAB, 12)
        self.mix = nn.Linear(12, 12)
        self.head = nn.Linear(12, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(ids))))


def token_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
    """Next-token cross-entropy summed over the real tokens, and how many there are."""
    logits = model(batch["ids"][:, :-1])
    target = batch["ids"][:, 1:]
    keep = batch["mask"][:, 1:]
    losses = nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
    return (losses * keep).sum(), keep.sum()


def spec(world: int, iterations: int = ITERATIONS) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "loop",
            "workload": {"entrypoint": "x:y", "seed": 4},
            "global_batch": B,
            "iterations": iterations,
            "workers": world,
        }
    )


class Script:
    """The leader's proposer: the newest scripted plan due at the context's iteration."""

    def __init__(self, script: list[tuple[int, RuntimePlan]]) -> None:
        self.script = script
        self.ctx: EvenflowContext | None = None

    def __call__(self) -> RuntimePlan | None:
        assert self.ctx is not None
        due = [p for at, p in self.script if self.ctx.iteration >= at]
        return due[-1] if due else None


def context(
    rank: int, world: int, script: list[tuple[int, RuntimePlan]], **kwargs: Any
) -> EvenflowContext:
    proposer = Script(script)
    initial = RuntimePlan(1, (8, 8) if world == 2 else (B,), B)
    agreement = PlanAgreement(
        initial, rank=rank, world_size=world, global_batch=B, propose=proposer, pipelined=False
    )
    iterations = kwargs.pop("iterations", ITERATIONS)
    ctx = EvenflowContext(spec(world, iterations), agreement, rank=rank, world_size=world, **kwargs)
    proposer.ctx = ctx
    return ctx


def _optimizer(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=ITERATIONS)
    return opt, sched


def _exact_worker(rank: int, world: int, workers: int, sync: str) -> dict[str, Any]:
    ctx = context(rank, world, SCRIPT, gradient_sync=sync)
    model = TinyLM()
    opt, sched = _optimizer(model)  # built before prepare, as a DDP script does
    model, _ = ctx.prepare(model, opt)
    loader = DataLoader(Tokens(), batch_size=4, collate_fn=pad, num_workers=workers)
    rows = []
    for batch in ctx.batches(loader):
        rows.append((ctx.iteration, batch["ids"].shape[0]))
        loss, tokens = token_loss(model, batch)
        ctx.backward(loss, count=tokens)
        if ctx.sync_gradients:
            nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            sched.step()
            opt.zero_grad()
    return {
        "params": [p.detach().tolist() for p in model.parameters()],
        "rows": rows,
        "history": ctx.agreement.history,
        "lr": sched.get_last_lr(),
        "checks": ctx.stats.replica_checks,
    }


def _single_process() -> list[torch.Tensor]:
    """The same global batches, in one process, as the user's own loop would train them."""
    data, model = Tokens(), TinyLM()
    opt, sched = _optimizer(model)
    sampler = GlobalBatchSampler(N, B, seed=4)
    for it in range(ITERATIONS):
        epoch, k = sampler.position(it)
        idx = sampler.permutation(epoch)[k * B : k * B + sampler.global_count(it)]
        loss, tokens = token_loss(model, pad([data[i] for i in idx.tolist()]))
        (loss / tokens).backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("workers", "sync"), [(0, "coalesced"), (2, "coalesced"), (0, "overlap")])
def test_a_per_token_loss_with_clipping_and_a_schedule_equals_one_process(
    workers: int, sync: str
) -> None:
    """With the coalesced all-reduce, and with DDP (overlap): the same model either way."""
    runs = run_ranks(_exact_worker, 2, workers, sync, timeout=100)
    reference = _single_process()
    for run in runs:
        assert run["history"] == [(0, 1), (3, 2), (6, 3), (9, 4)]
        for p, q in zip(run["params"], reference, strict=True):
            assert torch.allclose(torch.tensor(p), q, rtol=1e-5, atol=1e-7)
    # every rank ran the body every iteration (rank 1 on empty batches while its share was 0),
    # so both stepped the schedule the same number of times
    assert runs[0]["lr"] == runs[1]["lr"]
    r1 = dict(runs[1]["rows"])
    assert [r1[i] for i in (6, 7, 8)] == [0, 0, 0]
    r0 = [n for it, n in runs[0]["rows"] if it == 10]
    assert r0 == [3, 3, 3]  # 9 samples in passes of at most 3
    assert runs[0]["checks"] == runs[1]["checks"] == 1  # at the last iteration


def _divergent_worker(rank: int, world: int) -> str:
    ctx = context(rank, world, [], replica_check_every=4)
    model = TinyLM()
    opt, sched = _optimizer(model)
    model, _ = ctx.prepare(model, opt)
    try:
        for batch in ctx.batches(DataLoader(Tokens(), collate_fn=pad)):
            loss, tokens = token_loss(model, batch)
            ctx.backward(loss, count=tokens)
            if ctx.sync_gradients:
                opt.step()
                if rank == 0:  # a port that steps the schedule on rank 0 only
                    sched.step()
                opt.zero_grad()
    except ReplicaDivergence as exc:
        return f"{ctx.iteration} {exc}"
    return "trained"


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_replicas_that_drift_apart_fail_the_job_naming_the_iteration_and_rank() -> None:
    for outcome in run_ranks(_divergent_worker, 2, timeout=80):
        # the first check (before iteration 3's update) finds them apart, on both ranks
        assert outcome.startswith("3 the replicas' parameters differ before iteration 3")
        assert "rank(s) [1] differ from rank 0" in outcome


def _stopping_worker(rank: int, world: int, leave: str, sync: str) -> dict[str, Any]:
    ctx = context(rank, world, [(1, RuntimePlan(2, (12, 4), B))], iterations=40, gradient_sync=sync)
    model = TinyLM()
    opt, _ = _optimizer(model)
    model, _ = ctx.prepare(model, opt)
    bodies = 0
    for batch in ctx.batches(DataLoader(Tokens(), collate_fn=pad)):
        bodies += 1
        loss, tokens = token_loss(model, batch)
        if leave == "stop" and rank == 1 and ctx.iteration == 6:
            ctx.stop()  # before the last backward: this iteration is the last
        ctx.step(loss, count=tokens)
        if leave == "break" and rank == 0 and ctx.iteration == 9:
            break  # rank 0 alone leaves; rank 1 goes on to iteration 10's all-reduce
    return {
        "iterations": ctx.stats.iterations,
        "stopped_at": ctx.stats.stopped_at,
        "bodies": bodies,
        "params": [p.detach().tolist() for p in model.parameters()],
    }


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("sync", ["coalesced", "overlap"])
def test_a_stop_or_a_break_on_one_rank_ends_the_job_on_every_rank(sync: str) -> None:
    stopped = run_ranks(_stopping_worker, 2, "stop", sync, timeout=80)
    for run in stopped:
        assert (run["iterations"], run["stopped_at"], run["bodies"]) == (7, 7, 7)
    left = run_ranks(_stopping_worker, 2, "break", sync, timeout=80)
    # rank 0 completed iteration 9 and left; rank 1 ran iteration 10's body, whose update
    # was not made (rank 0's gradients never came): both hold the model of 10 updates
    assert [(r["iterations"], r["stopped_at"]) for r in left] == [(10, 10), (10, 10)]
    assert [r["bodies"] for r in left] == [10, 11]
    assert left[0]["params"] == left[1]["params"]


def _metric_worker(rank: int, world: int) -> list[float]:
    ctx = context(rank, world, [(1, RuntimePlan(2, (13, 3), B))], iterations=4)
    model = TinyLM()
    model, _ = ctx.prepare(model)
    out = []
    for batch in ctx.batches(DataLoader(Tokens(), collate_fn=pad)):
        loss, tokens = token_loss(model, batch)
        ctx.step(loss, count=tokens)
        out.append(ctx.all_reduce(batch["ids"].shape[0]))
        out.append(float(ctx.all_reduce(torch.tensor([float(rank)]), op="max")))
    return out


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_global_metric_is_one_call() -> None:
    for out in run_ranks(_metric_worker, 2, timeout=50):
        assert out == [B, 1.0] * 4


def test_misuse_of_backward_and_step_is_an_error_that_says_what_to_do() -> None:
    ctx = context(0, 1, [(0, RuntimePlan(2, (16,), B, memory_caps=(5,)))], iterations=3)
    model = TinyLM()
    opt, _ = _optimizer(model)
    model, _ = ctx.prepare(model, opt)
    data = DataLoader(Tokens(), collate_fn=pad)
    with pytest.raises(RuntimeError, match=r"before this iteration's gradients were all-reduced"):
        for batch in ctx.batches(data):  # 16 samples in passes of at most 5
            loss, tokens = token_loss(model, batch)
            ctx.backward(loss, count=tokens)
            opt.step()  # the plain loop's habit: a step after every backward

    ctx = context(0, 1, [(0, RuntimePlan(2, (16,), B, memory_caps=(5,)))], iterations=3)
    model, opt = ctx.prepare(TinyLM())
    with pytest.raises(RuntimeError, match="zeroed between two passes"):
        for batch in ctx.batches(data):
            opt.zero_grad()  # at the top of the body: would drop the earlier passes
            ctx.step(token_loss(model, batch)[0])

    ctx = context(0, 1, [], iterations=3)
    model, _ = ctx.prepare(TinyLM())
    batches = ctx.batches(data)
    batch = next(batches)
    loss, _ = token_loss(model, batch)
    with pytest.raises(ValueError, match="summed to one value, got \\(2,\\)"):
        ctx.backward(torch.stack([loss, loss]))
    ctx.backward(loss)
    with pytest.raises(RuntimeError, match="a second time for one batch"):
        ctx.backward(loss)


class Corpus(torch.utils.data.IterableDataset[dict[str, torch.Tensor]]):
    """Twelve shards of 30 token sequences; sample k of shard s is tagged 1000*s + k."""

    num_shards = 12

    def read_shard(self, shard: int, start: int) -> Any:
        g = torch.Generator().manual_seed(shard)
        for k in range(30):
            ids = torch.randint(1, VOCAB, (3 + k % 5,), generator=g)
            if k >= start:
                yield {"ids": ids, "tag": torch.tensor([1000 * shard + k])}

    def __iter__(self) -> Any:
        for shard in range(self.num_shards):
            yield from self.read_shard(shard, 0)


def _tagged(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    batch = pad(items)
    batch["tag"] = torch.cat([it["tag"] for it in items]) if items else torch.zeros(0)
    return batch


def _sharded_worker(
    rank: int, world: int, path: str, iterations: int, script: list[tuple[int, RuntimePlan]]
) -> list[tuple[int, list[int]]]:
    from agent.runtime.checkpoint import Checkpointer, CheckpointStore
    from agent.runtime.membership import ExclusionOptions

    initial = RuntimePlan(1, (8, 8) if world == 2 else (6, 5, 5), B)
    proposer = Script(script)
    agreement = PlanAgreement(
        initial, rank=rank, world_size=world, global_batch=B, propose=proposer
    )
    ctx = EvenflowContext(
        spec(world, iterations),
        agreement,
        rank=rank,
        world_size=world,
        checkpointer=Checkpointer(CheckpointStore(path), every=5),
        exclusion=ExclusionOptions(probe_every=1, poll_s=0.001),
    )
    proposer.ctx = ctx
    model, _ = ctx.prepare(TinyLM())
    ctx.probe_loss = lambda batch: token_loss(model, batch)[0]
    trained = []
    for batch in ctx.batches(DataLoader(Corpus(), batch_size=4, collate_fn=_tagged, num_workers=1)):
        trained.append((ctx.iteration, batch["tag"].tolist()))
        ctx.step(token_loss(model, batch)[0])
    return trained


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_sharded_stream_resumes_every_shard_where_it_stood(tmp_path: Any) -> None:
    # three ranks; rank 2 excluded from iteration 4 (its shards stand still), checkpoints at
    # 5 and 10 while it is out; the job stops after 12 and resumes from 10 on two ranks
    exclude = [(3, RuntimePlan(2, (9, 7, 0), B, (2,)))]
    first = run_ranks(_sharded_worker, 3, str(tmp_path), 12, exclude, timeout=100)
    second = run_ranks(_sharded_worker, 2, str(tmp_path), 20, [], timeout=100)
    kept = [t for run in first for it, tags in run if it < 10 for t in tags]
    redone = [t for run in second for it, tags in run for t in tags]
    assert min(it for run in second for it, _ in run) == 10
    everything = kept + redone
    assert len(everything) == len(set(everything)) == 20 * B  # none twice
    by_shard: dict[int, list[int]] = {}
    for t in everything:
        by_shard.setdefault(t // 1000, []).append(t % 1000)
    for shard, ks in by_shard.items():  # none skipped: each shard read from its start, in turn
        assert sorted(ks) == list(range(len(ks))), shard
    # rank 2 read only its own shards before it sat out (2, 5, 8, 11); after the resume,
    # its shard 2 went on from where it stood (rank 0's now)
    assert {t // 1000 for it, tags in first[2] for t in tags} <= {2, 5, 8, 11}
    assert any(t // 1000 == 2 for run in second for _, tags in run for t in tags)
