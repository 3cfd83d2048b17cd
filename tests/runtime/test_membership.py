"""Membership pieces without a process group: plan validation and codec, notices, the excluded
rank's waiting loop, probes, and the leader-only fetcher."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from agent.runtime.context import EvenflowContext
from agent.runtime.fetcher import PlanFetcher
from agent.runtime.membership import ExclusionOptions, Membership, Notice
from agent.runtime.plan_sync import (
    PlanAgreement,
    RuntimePlan,
    decode_plan,
    encode_plan,
    plan_problem,
)
from agent.runtime.probes import forward_sum, probe_size
from contract.spec import JobSpec

B = 12


def test_plan_problem_with_excluded_ranks() -> None:
    assert plan_problem(RuntimePlan(1, (6, 0, 6), B, (1,)), 3, B) is None
    assert plan_problem(RuntimePlan(1, (0, 12, 0), B, (0, 2)), 3, B) is None
    assert plan_problem(RuntimePlan(1, (0, 0, 0), B, (0, 1, 2)), 3, B) == "every rank is excluded"
    assert (
        plan_problem(RuntimePlan(1, (4, 4, 4), B, (2,)), 3, B)
        == "excluded rank 2 is given 4 samples"
    )
    assert "excluded twice" in str(plan_problem(RuntimePlan(1, (6, 0, 6), B, (1, 1)), 3, B))
    assert "outside 0..2" in str(plan_problem(RuntimePlan(1, (6, 0, 6), B, (1, 3)), 3, B))
    p = RuntimePlan(1, (0, 6, 6), B, (0,))
    assert p.active == (1, 2) and p.leader == 1
    assert RuntimePlan(1, (4, 4, 4)).active == (0, 1, 2) and RuntimePlan(1, (4, 4, 4)).leader == 0


def test_plan_message_round_trip_keeps_bad_exclusions_detectable() -> None:
    for plan in (
        RuntimePlan(3, (6, 0, 6), B, (1,)),
        RuntimePlan(4, (0, 12, 0), B, (2, 0)),
        RuntimePlan(5, (4, 4, 4), B),
    ):
        decoded, problem = decode_plan(encode_plan(plan, 3), 3)
        assert problem is None
        assert decoded == RuntimePlan(
            plan.version, plan.batch_sizes, B, tuple(sorted(plan.excluded))
        )
    twice, problem = decode_plan(encode_plan(RuntimePlan(6, (6, 0, 6), B, (1, 1)), 3), 3)
    assert problem is None and "twice" in str(plan_problem(twice, 3, B))
    _, problem = decode_plan(encode_plan(RuntimePlan(7, (6, 0, 6), B, (1, 5)), 3), 3)
    assert problem == "2 excluded ranks named, 1 of them in range"
    _, problem = decode_plan(encode_plan(RuntimePlan(8, (6, 6), B), 3), 3)
    assert problem == "2 batch sizes for 3 ranks"


def test_without_a_membership_hook_excluding_plans_are_refused() -> None:
    proposals = iter([RuntimePlan(2, (6, 0, 6), B, (1,)), RuntimePlan(3, (2, 4, 6), B)])
    a = PlanAgreement(
        RuntimePlan(1, (4, 4, 4)),
        rank=0,
        world_size=3,
        global_batch=B,
        propose=lambda: next(proposals, None),
        pipelined=False,
    )
    assert [a.at_boundary(i).version for i in range(3)] == [1, 3, 3]
    assert "cannot change the all-reduce group" in a.refused[2]


def test_a_plan_excluding_ranks_needs_a_process_group() -> None:
    job = JobSpec.model_validate(
        {"name": "t", "workload": {"builtin": "mlp"}, "global_batch": B, "workers": 2}
        | {"iterations": 2}
    )
    a = PlanAgreement(RuntimePlan(1, (12, 0), B, (1,)), rank=0, world_size=2, global_batch=B)
    with pytest.raises(ValueError, match="needs an initialised process group"):
        EvenflowContext(job, a, rank=0, world_size=2).prepare(nn.Linear(2, 1))


def test_notice_round_trip() -> None:
    n = Notice("join", 14, 10, (10, 12, 3, 1, 5, 7, 0, 0, 0, 1), 1, ((0, 2), (1,)))
    assert Notice.loads(n.dumps()) == n
    assert Notice.loads(Notice("tick", 3, 2).dumps()) == Notice("tick", 3, 2)


def test_excluded_rank_probes_once_per_fresh_tick_and_returns_at_its_join() -> None:
    store = dist.HashStore()
    m = Membership(1, 3, store=store, options=ExclusionOptions(poll_s=0.001))
    m.setup(RuntimePlan(1, (4, 4, 4)))
    leader = Membership(0, 3, store=store)
    leader.setup(RuntimePlan(1, (4, 4, 4)))
    excluded = RuntimePlan(2, (6, 0, 6), B, (1,))
    leader._post(1, Notice("join", 2, 1, root=0), with_log=False)  # stale: an earlier period

    def active_ranks() -> None:
        for it in range(4, 9):
            leader.tick(it, excluded)  # probe_every 4: ticks at 4 and 8 only
            time.sleep(0.03)
        leader._post(1, Notice("join", 9, 3, root=0), with_log=True)

    probes: list[tuple[int, int]] = []
    thread = threading.Thread(target=active_ranks)
    thread.start()
    notice = m.wait(4, lambda it, version: probes.append((it, version)))
    thread.join()
    assert probes == [(4, 2), (8, 2)]
    assert (notice.kind, notice.iteration, notice.root) == ("join", 9, 0)


def test_an_excluded_rank_gives_up_on_silence_and_stops_on_abort() -> None:
    store = dist.HashStore()
    m = Membership(2, 3, store=store, options=ExclusionOptions(silence_timeout_s=0.05))
    m.setup(RuntimePlan(1, (4, 4, 4)))
    with pytest.raises(TimeoutError, match="no word from the active ranks"):
        m.wait(7, lambda it, version: None)
    active = Membership(0, 3, store=store)
    active.setup(RuntimePlan(1, (4, 4, 4)))
    active.abort(9, RuntimePlan(2, (6, 6, 0), B, (2,)))
    with pytest.raises(RuntimeError, match="active ranks stopped at iteration 9"):
        m.wait(7, lambda it, version: None)


def test_probe_batch_and_the_default_probe_loss() -> None:
    assert probe_size(2, 12, 64, None, 1000) == 6
    assert probe_size(3, 100, 16, None, 1000) == 16
    assert probe_size(3, 100, 64, 20, 5) == 5
    model = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    expected = model(x).sum()
    for batch in ((x, torch.zeros(4)), [x], x):
        assert torch.allclose(forward_sum(model)(batch), expected)

    class Keywords(nn.Module):
        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            return inputs * 2

    assert forward_sum(Keywords())({"inputs": torch.ones(3)}).item() == 6


def test_fetcher_polls_only_while_asked() -> None:
    calls: list[float] = []

    def fetch() -> None:
        calls.append(time.monotonic())

    f = PlanFetcher(fetch, interval_s=0.002, idle_after_s=0.05)
    assert not f.started
    time.sleep(0.03)
    assert calls == []  # nobody asked: no thread, no requests
    f.latest()
    time.sleep(0.15)
    quiet = len(calls)
    assert quiet > 3
    time.sleep(0.1)
    assert len(calls) <= quiet + 1  # idle: it stopped asking the control plane
    f.latest()
    time.sleep(0.05)
    assert len(calls) > quiet + 1  # asked again: polling resumed
    f.close()
