"""All ranks switch plans at the same iteration; bad plans are refused everywhere."""

from __future__ import annotations

import random
import threading
import time
from datetime import UTC, datetime

import pytest
import torch
from torch import nn

from agent.runtime.gradients import GradientSync
from agent.runtime.plan_sync import (
    PlanAgreement,
    PlanFetcher,
    RuntimePlan,
    agree_initial,
    message_length,
    plan_problem,
)
from contract.agent import PlanOut
from contract.enums import PlanSource

from .spawn import run_ranks

B = 12


def plan_out(version: int, sizes: list[int], global_batch: int = B) -> PlanOut:
    return PlanOut(
        job_id=1,
        version=version,
        batch_sizes=sizes,
        global_batch=global_batch,
        source=PlanSource.AUTOMATIC,
        reason="test",
        created_at=datetime.now(UTC),
    )


def test_plan_problem() -> None:
    assert plan_problem(RuntimePlan(1, (4, 4, 4)), 3, B) is None
    assert plan_problem(RuntimePlan(1, (0, 12, 0)), 3, B) is None
    assert "sum to 13" in str(plan_problem(RuntimePlan(1, (4, 4, 5)), 3, B))
    assert "2 batch sizes for 3" in str(plan_problem(RuntimePlan(1, (6, 6)), 3, B))
    assert "negative" in str(plan_problem(RuntimePlan(1, (-1, 7, 6)), 3, B))
    assert "global batch 24" in str(plan_problem(RuntimePlan(1, (4, 4, 4), 24), 3, B))
    assert "version 0" in str(plan_problem(RuntimePlan(0, (4, 4, 4)), 3, B))
    assert plan_problem(RuntimePlan(1, (2, 5, 5)), 3, B, max_batch=5) is None
    assert "above max_batch_per_worker 5" in str(plan_problem(RuntimePlan(1, (2, 4, 6)), 3, B, 5))


# Rank 0's candidates by iteration: a good change, a wrong sum, a wrong length, a good one
# giving a rank 0 samples, and a stale version that must be ignored.
SCRIPT = [
    (4, plan_out(2, [2, 5, 5])),
    (8, plan_out(3, [2, 5, 6])),
    (10, plan_out(4, [6, 6])),
    (12, plan_out(5, [0, 6, 6])),
    (16, plan_out(1, [12, 0, 0])),
]


class Scripted:
    """What rank 0's fetcher would hold at the current iteration (set by the loop)."""

    def __init__(self) -> None:
        self.iteration = 0

    def __call__(self) -> PlanOut | None:
        current = None
        for at, p in SCRIPT:
            if self.iteration >= at:
                current = p
        return current


def _agreement_worker(rank: int, world: int) -> dict[str, object]:
    out: dict[str, object] = {}
    rng = random.Random(rank)
    for name, kwargs in {
        "channel": {},
        "channel_late": {},  # candidates appear only after the boundary, during the iteration
        "pipelined": {"pipelined": True},
        "blocking_every_3": {"pipelined": False, "every": 3},
    }.items():
        initial = agree_initial(
            plan_out(1, [4, 4, 4]) if rank == 0 else None,
            rank=rank,
            world_size=world,
            global_batch=B,
        )
        script = Scripted()
        agreement = PlanAgreement(
            initial, rank=rank, world_size=world, global_batch=B, propose=script, **kwargs
        )
        sync = GradientSync(nn.Linear(2, 1).parameters(), control_slots=agreement.message_length)
        if name.startswith("channel"):
            assert agreement.use_channel(sync) and agreement.transport == "channel"
        log = []
        for it in range(24):
            script.iteration = it - 1 if name == "channel_late" else it
            plan = agreement.at_boundary(it)
            script.iteration = it
            assert sum(plan.batch_sizes) == B and len(plan.batch_sizes) == world
            log.append((it, plan.version, plan.batch_sizes))
            time.sleep(rng.random() * 0.002)  # ranks reach boundaries at different moments
            sync.all_reduce(B)  # the iteration's gradient all-reduce
        agreement.close()
        out[name] = {"log": log, "refused": agreement.refused, "history": agreement.history}
    return out


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_all_ranks_switch_at_the_same_iteration_and_refuse_bad_plans() -> None:
    results = run_ranks(_agreement_worker, 3)
    # every 3: boundaries 9 and 12 straddle v4's window, so v4 is superseded unseen
    cases = (
        ("channel", {3, 4}),
        ("channel_late", {3, 4}),
        ("pipelined", {3, 4}),
        ("blocking_every_3", {3}),
    )
    for name, refused in cases:
        logs = [r[name]["log"] for r in results]
        assert logs[0] == logs[1] == logs[2]
        versions = [v for _, v, _ in logs[0]]
        assert versions == sorted(versions)
        assert set(versions) == {1, 2, 5}  # 3 and 4 refused, stale 1 ignored
        for r in results:
            assert set(r[name]["refused"]) == refused
            assert "sum to 13" in r[name]["refused"][3]
    assert "2 batch sizes" in results[1]["pipelined"]["refused"][4]
    # channel and pipelined: a candidate seen at boundary i is in force from boundary i+1; the
    # channel reads the candidate as the all-reduce starts, so one that arrives during
    # iteration i is in force from i+1 as well
    assert results[0]["channel"]["history"] == [(0, 1), (5, 2), (13, 5)]
    assert results[0]["channel_late"]["history"] == [(0, 1), (5, 2), (13, 5)]
    assert results[0]["pipelined"]["history"] == [(0, 1), (5, 2), (13, 5)]
    # blocking every 3: boundaries at 0, 3, 6, ...; a candidate seen there takes effect at once
    assert results[0]["blocking_every_3"]["history"] == [(0, 1), (6, 2), (12, 5)]


def test_agreement_without_process_group_applies_and_refuses() -> None:
    for pipelined, delay in ((False, 0), (True, 1)):
        script = Scripted()
        a = PlanAgreement(
            RuntimePlan(1, (4, 4, 4)),
            rank=0,
            world_size=3,
            global_batch=B,
            propose=script,
            pipelined=pipelined,
        )
        versions = []
        for i in range(20):
            script.iteration = i
            versions.append(a.at_boundary(i).version)
        assert versions == [1] * (4 + delay) + [2] * 8 + [5] * (8 - delay)
        assert set(a.refused) == {3, 4}


def test_gradient_control_slots_carry_integers_and_need_a_cpu_float_buffer() -> None:
    model = nn.Linear(3, 2)
    sync = GradientSync(model.parameters(), control_slots=6)
    assert sync.control_capacity == 6
    sync.send_control([7, -1, 3, 16_000_000, 0])
    model(torch.ones(4, 3)).sum().backward()
    sync.all_reduce(4, torch.tensor(8.0))
    assert sync.received_control() == [7, -1, 3, 16_000_000, 0, 0]  # not scaled by 1/4
    assert sync.received_control() is None  # consumed
    assert model.bias.grad is not None and torch.allclose(model.bias.grad, torch.ones(2))
    with pytest.raises(ValueError, match="below"):
        sync.send_control([2**24])
    half = GradientSync(nn.Linear(3, 2).to(torch.bfloat16).parameters(), control_slots=6)
    assert half.control_capacity == 0
    a = PlanAgreement(RuntimePlan(1, (4, 4, 4)), rank=0, world_size=3, global_batch=B)
    assert not a.use_channel(half) and a.transport == "pipelined"


def test_initial_plan_must_be_valid() -> None:
    with pytest.raises(ValueError, match="rank 0 has no initial plan"):
        agree_initial(None, rank=0, world_size=3, global_batch=B)
    with pytest.raises(ValueError, match="sum to 13"):
        agree_initial(plan_out(1, [4, 4, 5]), rank=0, world_size=3, global_batch=B)
    with pytest.raises(ValueError, match="2 batch sizes for 3"):
        agree_initial(plan_out(1, [6, 6]), rank=0, world_size=3, global_batch=B)
    assert agree_initial(
        plan_out(7, [2, 2, 8]), rank=0, world_size=3, global_batch=B
    ) == RuntimePlan(7, (2, 2, 8), B)


def test_fetcher_survives_errors_and_keeps_newest() -> None:
    answers: list[object] = [
        ConnectionError("down"),
        RuntimeError("500"),
        plan_out(1, [4, 4, 4]),  # not newer than the known version 1
        None,
        plan_out(3, [2, 5, 5]),
        plan_out(2, [5, 5, 2]),  # older than 3: ignored
    ]
    done = threading.Event()

    def fetch() -> PlanOut | None:
        if not answers:
            done.set()
            return None
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a  # type: ignore[return-value]

    f = PlanFetcher(fetch, interval_s=0.001, max_backoff_s=0.004, known_version=1)
    assert f.latest() is None
    f.start()
    assert done.wait(5)
    f.close()
    latest = f.latest()
    assert latest is not None and latest.version == 3
    assert f.errors == 2
    assert f.fetches >= 4


def test_a_plan_too_large_for_the_channel_is_ignored_not_rounded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    huge = 2**24 + 1
    sync = GradientSync(nn.Linear(2, 1).parameters(), control_slots=message_length(2))
    a = PlanAgreement(
        RuntimePlan(1, (6, 6)),
        rank=0,
        world_size=2,
        global_batch=B,
        propose=lambda: RuntimePlan(huge, (2, 10)),
    )
    assert a.use_channel(sync)
    for i in range(5):
        assert a.at_boundary(i) == RuntimePlan(1, (6, 6))
        sync.all_reduce(B)
    assert caplog.text.count("too large") == 1
