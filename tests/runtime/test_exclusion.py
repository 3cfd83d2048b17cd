"""Partial all-reduce on three gloo ranks: exclusion, probing, readmission.

One scripted run goes through every kind of membership change: a rank excluded and readmitted,
rank 0 (the leader) excluded so rank 1 leads, a second rank excluded while one is out (a group
made while a rank is away, replayed at its join), rank 0 readmitted while rank 2 stays out, and
the job ending with rank 2 still excluded. Bad plans on the way are refused everywhere.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from agent.runtime.checkpoint import Checkpointer, CheckpointStore
from agent.runtime.context import EvenflowContext
from agent.runtime.emulation import Emulator
from agent.runtime.membership import ExclusionOptions
from agent.runtime.plan_sync import PlanAgreement, RuntimePlan
from agent.runtime.resync import resync
from agent.runtime.sampler import GlobalBatchSampler
from agent.runtime.trainer import _settle_before_checkpoints
from contract.agent import TelemetryRecord
from contract.spec import EmulatedWorker, JobSpec, Slowdown

from .spawn import run_ranks

N, B, LR, MOMENTUM, EPOCHS = 117, 12, 0.05, 0.9, 2  # 117 % 12 = 9: a partial last batch
PER_EPOCH = -(-N // B)
STEP_LR, GAMMA = 4, 0.8
ITERATIONS = EPOCHS * PER_EPOCH

# (iteration from which the leader proposes it, plan); the channel and pipelined transports put
# a candidate seen at boundary i in force at i + 1, the blocking one at i.
SCRIPT = [
    (1, RuntimePlan(2, (6, 0, 6), B, (1,))),  # exclude rank 1
    (2, RuntimePlan(3, (0, 0, 0), B, (0, 1, 2))),  # refused: every rank excluded
    (3, RuntimePlan(4, (4, 4, 4), B, (2,))),  # refused: an excluded rank given samples
    (4, RuntimePlan(5, (3, 0, 9), B, (1,))),  # new sizes, same group
    (6, RuntimePlan(6, (3, 5, 4), B)),  # readmit rank 1
    (8, RuntimePlan(7, (0, 6, 6), B, (0,))),  # exclude rank 0: rank 1 leads
    (10, RuntimePlan(8, (0, 12, 0), B, (0, 2))),  # exclude rank 2 as well: group {1} made without 0
    (12, RuntimePlan(9, (6, 0, 6), B, (1,))),  # refused: no rank of {1} stays active
    (13, RuntimePlan(10, (5, 7, 0), B, (2,))),  # readmit rank 0 (it replays group {1}); 2 stays out
]
HISTORY = [(0, 1), (2, 2), (5, 5), (7, 6), (9, 7), (11, 8), (14, 10)]
EXCLUSIONS = {0: [(9, 14)], 1: [(2, 7)], 2: [(11, ITERATIONS)]}
TRANSPORTS = {  # name: (PlanAgreement options, piggyback, switch delay)
    "channel": ({}, True, 0),
    "pipelined": ({"pipelined": True}, False, 0),
    "blocking": ({"pipelined": False}, False, -1),
}


def _shift(delay: int) -> tuple[list[tuple[int, int]], dict[int, list[tuple[int, int]]]]:
    """The expected switch points and exclusion windows of a transport."""
    history = [HISTORY[0]] + [(i + delay, v) for i, v in HISTORY[1:]]
    exclusions = {
        r: [(a + delay, b if b == ITERATIONS else b + delay) for a, b in w]
        for r, w in EXCLUSIONS.items()
    }
    return history, exclusions


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(N, 5, generator=g), torch.randn(N, 2, generator=g), torch.arange(N)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))


def _loss_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y, reduction="sum")


def _spec(world: int, iterations: int) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "exclusion",
            "workload": {"builtin": "mlp", "learning_rate": LR, "seed": 1},
            "global_batch": B,
            "iterations": iterations,
            "workers": world,
        }
    )


class Script:
    """The leader's proposer: the newest scripted plan due at the context's iteration."""

    def __init__(self) -> None:
        self.ctx: EvenflowContext | None = None

    def __call__(self) -> RuntimePlan | None:
        assert self.ctx is not None
        due = [p for at, p in SCRIPT if self.ctx.iteration >= at]
        return due[-1] if due else None


def _scripted_worker(
    rank: int,
    world: int,
    transport: str,
    checkpoints: str | None = None,
    sync: str = "coalesced",
) -> dict[str, object]:
    script = Script()
    options, piggyback, _ = TRANSPORTS[transport]
    agreement = PlanAgreement(
        RuntimePlan(1, (4, 4, 4), B),
        rank=rank,
        world_size=world,
        global_batch=B,
        propose=script,
        **options,
    )
    records: list[TelemetryRecord] = []
    checkpointer = None
    if checkpoints is not None:  # every iteration, settled as the trainer does
        checkpointer = Checkpointer(CheckpointStore(checkpoints, keep=ITERATIONS), every=1)
        _settle_before_checkpoints(checkpointer, [], lambda: agreement.group)
    ctx = EvenflowContext(
        _spec(world, ITERATIONS),
        agreement,
        rank=rank,
        world_size=world,
        submit=records.append,
        piggyback=piggyback,
        exclusion=ExclusionOptions(probe_every=1, poll_s=0.001),
        checkpointer=checkpointer,
        gradient_sync=sync,
    )
    script.ctx = ctx
    model = _model(seed=100 + rank)  # different on purpose: prepare's broadcast fixes it
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    # Stepped in the loop on the active ranks only: a rank that sat out gets it at its join.
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=STEP_LR, gamma=GAMMA)
    ctx.register_state("sched", sched)
    model, _ = ctx.prepare(model, opt)
    trained: list[tuple[int, list[int]]] = []
    for x, y, idx in ctx.batches(_data()):
        if len(idx):
            trained.append((ctx.iteration, idx.tolist()))
        ctx.backward(_loss_sum(model, x, y))
        if ctx.sync_gradients:
            opt.step()
            sched.step()
            opt.zero_grad()
    assert agreement.transport == transport
    return {
        "sched": sched.state_dict(),
        "params": [p.detach().flatten().tolist() for p in model.parameters()],
        "trained": trained,
        "history": agreement.history,
        "refused": agreement.refused,
        "exclusions": ctx.stats.exclusions,
        "iterations": ctx.stats.iterations,
        "global_samples": ctx.stats.global_samples,
        "losses": ctx.stats.losses,
        "rows": [(r.iteration, r.batch_size, r.plan_version, r.probe) for r in records],
        "log": ctx.membership.log,
        "regroup_ms": ctx.membership.regroup_ms,
        "resync_ms": ctx.stats.resync_ms,
    }


def _resync_worker(rank: int, world: int) -> list[object]:
    """Parameters, buffers and Adam state (moments, step) all come from the root."""
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(rank):  # rank 0: no state at all; rank 2: two steps' worth
        model(torch.randn(8, 3)).sum().backward()
        opt.step()
    extra = resync(
        model,
        opt,
        rank=rank,
        root=2,
        apply=rank == 0,  # rank 1 takes part without changing anything
        group=None,
        control=None,
        extra={"from": rank},
    )
    state = opt.state_dict()["state"]
    return [
        extra,
        [t.detach().flatten().tolist() for t in [*model.parameters(), *model.buffers()]],
        {k: {n: v.tolist() for n, v in s.items()} for k, s in state.items()},
    ]


def _all(rank: int, world: int) -> tuple[dict[str, object], object]:
    runs = {t: _scripted_worker(rank, world, t) for t in TRANSPORTS}
    # DDP's buckets summed over the subgroups, the plan agreement riding its statistics
    runs["overlap"] = _scripted_worker(rank, world, "channel", sync="overlap")
    return runs, _resync_worker(rank, world)


def _single_process() -> list[torch.Tensor]:
    x, y, _ = _data()
    model = _model(seed=100)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=STEP_LR, gamma=GAMMA)
    sampler = GlobalBatchSampler(N, B, seed=1)
    for it in range(ITERATIONS):
        epoch, k = sampler.position(it)
        idx = sampler.permutation(epoch)[k * B : k * B + sampler.global_count(it)]
        opt.zero_grad()
        (_loss_sum(model, x[idx], y[idx]) / len(idx)).backward()
        opt.step()
        sched.step()
    return [p.detach().flatten() for p in model.parameters()]


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_exclusion_and_readmission_keep_every_invariant() -> None:
    results = run_ranks(_all, 3, timeout=80)
    reference = _single_process()
    for transport, (_, _, delay) in TRANSPORTS.items():
        _check_scripted_run([r[0][transport] for r in results], reference, *_shift(delay))
    _check_scripted_run([r[0]["overlap"] for r in results], reference, *_shift(0))

    # re-synchronisation: everything from the root, Adam's moments and step included
    extras = [r[1][0] for r in results]
    assert extras == [{"from": 2}] * 3
    rank0, rank1, rank2 = (r[1] for r in results)
    assert rank0[1] == rank2[1] and rank0[2] == rank2[2] and rank2[2]
    assert rank1[1] != rank2[1]  # apply=False: joined the collectives, changed nothing


def _checkpointed(rank: int, world: int, directory: str) -> dict[str, object]:
    return _scripted_worker(rank, world, "channel", directory)


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_checkpoints_settle_among_the_active_ranks_through_every_membership_change(
    tmp_path: Path,
) -> None:
    """Before each checkpoint the ranks in the loop wait for one another (the leader writes
    once every rank's reports are delivered): a checkpoint at every iteration, through
    exclusions, a new leader and readmissions, never waits on an excluded rank and changes
    nothing the run computes."""
    results = run_ranks(_checkpointed, 3, str(tmp_path), timeout=80)
    _check_scripted_run(results, _single_process(), *_shift(TRANSPORTS["channel"][2]))
    written = CheckpointStore(str(tmp_path), keep=ITERATIONS).iterations()
    assert written == list(range(1, ITERATIONS + 1))


def _check_scripted_run(
    runs: list[Any],
    reference: list[torch.Tensor],
    history: list[tuple[int, int]],
    exclusions: dict[int, list[tuple[int, int]]],
) -> None:
    # all ranks agree on the switch points and on what was refused, and why
    for run in runs:
        assert run["history"] == history
        assert set(run["refused"]) == {3, 4, 9}
    refused = runs[0]["refused"]
    assert refused[3] == "every rank is excluded"
    assert refused[4] == "excluded rank 2 is given 4 samples"
    assert "no rank of the current group [1] stays active" in refused[9]
    assert runs[1]["refused"] == runs[2]["refused"] == refused

    # each rank sat out exactly the agreed windows, and trained only outside them
    for rank, run in enumerate(runs):
        assert run["exclusions"] == exclusions[rank]
        out = {i for a, b in exclusions[rank] for i in range(a, b)}
        assert {i for i, _ in run["trained"]}.isdisjoint(out)
        assert run["iterations"] == ITERATIONS - len(out)
        assert run["global_samples"] == EPOCHS * N  # the job's count, handed over at joins
    # groups: {0,2}, {1,2}, {1} (rank 0 away), {0,1} (rank 2 away): one log, everywhere
    assert runs[0]["log"] == runs[1]["log"] == runs[2]["log"] == [(0, 2), (1, 2), (1,), (0, 1)]

    # exactly once: per epoch, the samples trained by all ranks are every index, once
    for epoch in range(EPOCHS):
        seen = [
            i for run in runs for it, idx in run["trained"] if it // PER_EPOCH == epoch for i in idx
        ]
        assert sorted(seen) == list(range(N))

    # exact: momentum SGD through all of it equals single-process SGD on the global batches
    for run in runs:
        diff = max(
            (torch.tensor(p) - q).abs().max().item()
            for p, q in zip(run["params"], reference, strict=True)
        )
        assert diff < 1e-6
    assert runs[0]["params"] == runs[1]["params"] == runs[2]["params"]
    # the scheduler each rank stepped only while active: all in step, the sat-out ones too
    assert [run["sched"]["last_epoch"] for run in runs] == [ITERATIONS] * 3
    assert runs[0]["losses"] == runs[1]["losses"] == runs[2]["losses"]

    # telemetry: a normal row per trained iteration; probes only inside the exclusion windows,
    # at distinct iterations, so (rank, iteration) never collides
    for rank, run in enumerate(runs):
        rows = run["rows"]
        normal = [i for i, _, _, probe in rows if not probe]
        probes = [i for i, _, _, probe in rows if probe]
        assert normal == [i for i, _ in run["trained"]]
        assert len(set(probes)) == len(probes)
        assert all(any(a <= i < b for a, b in exclusions[rank]) for i in probes)


SLOW, STEP_MS, NO_WAIT_ITERATIONS = 50.0, 10.0, 30


def _no_wait_worker(rank: int, world: int, factor: float) -> list[tuple[int, float, float, bool]]:
    """Rank 2 excluded from the start; its probes take ``factor`` times a normal step."""
    slowdowns = [Slowdown(from_iteration=0, to_iteration=10**6, factor=factor)] if rank == 2 else []
    agreement = PlanAgreement(
        RuntimePlan(1, (6, 6, 0), B, (2,)), rank=rank, world_size=world, global_batch=B
    )
    records: list[TelemetryRecord] = []
    ctx = EvenflowContext(
        _spec(world, NO_WAIT_ITERATIONS),
        agreement,
        rank=rank,
        world_size=world,
        emulator=Emulator(
            EmulatedWorker(per_sample_ms=0.0, intercept_ms=STEP_MS, slowdowns=slowdowns)
        ),
        submit=records.append,
        exclusion=ExclusionOptions(probe_every=4, poll_s=0.001),
    )
    model, _ = ctx.prepare(_model(seed=0))
    for x, y, _ in ctx.batches(_data()):
        ctx.step(_loss_sum(model, x, y))
    assert ctx.stats.exclusions == ([(0, NO_WAIT_ITERATIONS)] if rank == 2 else [])
    return [(r.iteration, r.ts, r.data_ms + r.compute_ms + r.sync_ms, r.probe) for r in records]


def _no_wait_both(rank: int, world: int) -> tuple[Any, Any]:
    return _no_wait_worker(rank, world, 1.0), _no_wait_worker(rank, world, SLOW)


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_active_ranks_never_wait_for_a_slow_excluded_rank() -> None:
    results = run_ranks(_no_wait_both, 3, timeout=80)
    fast, slow = ([r[k] for r in results] for k in (0, 1))
    probes = [ms for _, _, ms, probe in slow[2] if probe]
    assert probes and all(p for p in slow[2])  # rank 2 only probed, ...
    assert min(probes) > 0.8 * SLOW * STEP_MS  # ... and its probes show the slowdown
    for rank in (0, 1):
        base = statistics.median(ms for _, _, ms, _ in fast[rank])
        steps = [ms for _, _, ms, _ in slow[rank]]
        assert len(steps) == NO_WAIT_ITERATIONS
        # iteration times as in the run whose probes are fast, never near a probe's length
        assert statistics.median(steps) < 1.5 * base + 5
        assert max(steps) < 0.5 * min(probes)
        # the whole run of the active ranks took less than one slow probe... twice over
        ts = [t for _, t, _, _ in slow[rank]]
        assert (ts[-1] - ts[0]) * 1000 < 2 * min(probes)
