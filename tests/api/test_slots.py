"""The database slots (``server.api.slots``): a bound, and a person's request served before the
fleet's heartbeats."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.api.slots import DbSlots
from server.context import context_of
from tests.harness import Api


async def _until(cond: object) -> None:
    for _ in range(1000):
        if cond():  # type: ignore[operator]
            return
        await asyncio.sleep(0)
    raise AssertionError("never came")


def test_a_freed_slot_goes_to_a_person_before_any_heartbeat_each_kind_in_turn() -> None:
    async def main() -> list[str]:
        slots, order = DbSlots(1), []
        release = asyncio.Event()

        async def hold(name: str, first: bool) -> None:
            async with slots.take(first=first):
                order.append(name)
                if name == "holder":
                    await release.wait()

        holder = asyncio.ensure_future(hold("holder", True))
        await _until(lambda: order == ["holder"])
        tasks = [asyncio.ensure_future(hold(f"hb{i}", False)) for i in range(3)]
        await _until(lambda: slots.waiting == (0, 3))
        tasks += [asyncio.ensure_future(hold(f"person{i}", True)) for i in range(2)]
        await _until(lambda: slots.waiting == (2, 3))
        release.set()
        await asyncio.gather(holder, *tasks)
        assert slots.value == 1 and slots.waiting == (0, 0)
        return order

    assert asyncio.run(main()) == ["holder", "person0", "person1", "hb0", "hb1", "hb2"]


def test_a_waiter_cancelled_gives_up_its_place_and_one_handed_a_slot_hands_it_on() -> None:
    async def main() -> None:
        slots = DbSlots(1)
        await slots.__aenter__()
        gone = asyncio.ensure_future(slots.__aenter__())
        later = asyncio.ensure_future(slots.__aenter__())
        await _until(lambda: slots.waiting == (2, 0))
        gone.cancel()  # cancelled while waiting: leaves the queue
        await _until(lambda: gone.done())
        assert slots.waiting == (1, 0)
        await slots.__aexit__()
        await later  # the slot went to the one still waiting
        lucky = asyncio.ensure_future(slots.__aenter__())
        await _until(lambda: slots.waiting == (1, 0))
        await slots.__aexit__()  # handed to `lucky`...
        lucky.cancel()  # ...which is cancelled before it runs: the slot is not lost
        with pytest.raises(asyncio.CancelledError):
            await lucky
        assert slots.value == 1

    asyncio.run(main())


def test_no_slots_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        DbSlots(0)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 4),
    steps=st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.booleans()), max_size=30),
)
def test_never_more_holders_than_slots_and_none_lost(
    n: int, steps: list[tuple[bool, int, bool]]
) -> None:
    """Requests of both kinds that hold for a while, some cancelled (waiting, or as they are
    handed a slot): never more than ``n`` hold at once, and every slot is free at the end."""

    async def main() -> None:
        slots, holding, most = DbSlots(n), [0], [0]

        async def request(first: bool, ticks: int) -> None:
            async with slots.take(first=first):
                holding[0] += 1
                most[0] = max(most[0], holding[0])
                try:
                    for _ in range(ticks):
                        await asyncio.sleep(0)
                finally:
                    holding[0] -= 1

        tasks = []
        for first, ticks, cancel in steps:
            task = asyncio.ensure_future(request(first, ticks))
            tasks.append(task)
            await asyncio.sleep(0)
            if cancel:
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert most[0] <= n
        assert holding[0] == 0 and slots.value == n and slots.waiting == (0, 0)

    asyncio.run(main())


def test_only_the_heartbeats_database_work_waits_behind_the_rest(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Which kind each route asks for: a heartbeat worked out in the database waits behind
    everyone; a job's submission and a listing go first."""
    slots = context_of(api.client.app).db_slots  # type: ignore[arg-type]
    asked: list[bool] = []
    take = slots.take

    def recording(*, first: bool = True) -> Any:
        asked.append(first)
        return take(first=first)

    monkeypatch.setattr(slots, "take", recording)
    monkeypatch.setattr(type(slots), "__aenter__", _recorded(asked, DbSlots.__aenter__))
    host = api.register("h", devices=1)
    asked.clear()
    beat = api.client.post(
        f"/api/v1/hosts/{host['id']}/heartbeat", json={"workers": []}, headers=api.headers()
    )
    assert beat.status_code == 200 and asked == [False]
    asked.clear()
    assert api.client.get("/api/v1/hosts", headers=api.headers()).status_code == 200
    assert asked == [True]
    api.submit(workers=1)  # (the helper reads the job back too)
    assert len(asked) >= 2 and all(asked)


def _recorded(asked: list[bool], enter: Any) -> Any:
    async def aenter(self: DbSlots) -> None:
        asked.append(True)
        await enter(self)

    return aenter
