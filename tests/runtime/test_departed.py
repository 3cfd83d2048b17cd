"""Departed ranks in the runtime's plans: carried by the agreement message, always excluded,
never readmitted (pure: one process, no process group)."""

from __future__ import annotations

from agent.runtime.plan_sync import (
    PlanAgreement,
    RuntimePlan,
    decode_plan,
    encode_plan,
    message_length,
    plan_problem,
)

B = 12


def test_departed_ranks_travel_in_the_message() -> None:
    plan = RuntimePlan(3, (6, 0, 0, 6), B, (1, 2), (), (2,))
    message = encode_plan(plan, 4)
    assert len(message) == message_length(4)
    decoded, problem = decode_plan(message, 4)
    assert problem is None and decoded == plan
    assert decoded.members == (0, 1, 3) and decoded.active == (0, 3)


def test_a_departed_rank_must_be_excluded() -> None:
    plan = RuntimePlan(2, (4, 4, 4), B, (), (), (2,))
    assert plan_problem(plan, 3, B) == "departed rank 2 is not excluded"


def test_no_plan_readmits_a_departed_rank() -> None:
    gone = RuntimePlan(2, (6, 0, 6), B, (1,), (), (1,))
    candidates = [RuntimePlan(3, (4, 4, 4), B), RuntimePlan(4, (6, 0, 6), B, (1,), (), (1,))]
    agreement = PlanAgreement(
        gone,
        rank=0,
        world_size=3,
        global_batch=B,
        propose=lambda: candidates[0],
        pipelined=False,
    )
    agreement.at_boundary(0)
    assert agreement.current == gone
    assert agreement.refused == {3: "rank 1 has departed; a plan cannot readmit it"}
    candidates.pop(0)
    agreement.at_boundary(1)
    assert agreement.current.version == 4 and agreement.current.departed == (1,)
