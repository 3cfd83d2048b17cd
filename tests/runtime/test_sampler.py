"""Every sample is consumed exactly once per epoch, whatever plans change mid-epoch."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.runtime.sampler import GlobalBatchSampler, split_count


@st.composite
def plan(draw: st.DrawFn, world: int, total: int) -> list[int]:
    """A composition of ``total`` into ``world`` non-negative parts (zeros allowed)."""
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=world - 1, max_size=world - 1)))
    bounds = [0, *cuts, total]
    return [bounds[i + 1] - bounds[i] for i in range(world)]


@st.composite
def scenario(draw: st.DrawFn) -> tuple[int, int, int, list[list[int]]]:
    world = draw(st.integers(1, 5))
    global_batch = draw(st.integers(1, 40))
    n = draw(st.integers(1, 200))
    sampler = GlobalBatchSampler(n, global_batch)
    plans = draw(
        st.lists(
            plan(world, global_batch),
            min_size=sampler.batches_per_epoch,
            max_size=sampler.batches_per_epoch,
        )
    )
    return n, global_batch, world, plans


@settings(max_examples=200, deadline=None)
@given(scenario(), st.integers(0, 3), st.integers(0, 1000))
def test_epoch_covers_every_index_exactly_once(
    case: tuple[int, int, int, list[list[int]]], epoch: int, seed: int
) -> None:
    n, global_batch, world, plans = case
    sampler = GlobalBatchSampler(n, global_batch, seed=seed)
    seen: list[int] = []
    first = epoch * sampler.batches_per_epoch
    for k, sizes in enumerate(plans):
        it = first + k
        count = 0
        for rank in range(world):
            idx = sampler.local_indices(it, sizes, rank).tolist()
            assert len(idx) <= sizes[rank]  # partial batches never exceed the plan
            count += len(idx)
            seen.extend(idx)
        assert count == sampler.global_count(it)
    assert sorted(seen) == list(range(n))


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6).flatmap(lambda w: plan(w, 50)), st.integers(0, 50))
def test_split_count_sums_and_respects_plan(sizes: list[int], count: int) -> None:
    if sum(sizes) == 0:
        return
    out = split_count(sizes, count)
    assert sum(out) == count
    assert all(0 <= o <= s for o, s in zip(out, sizes, strict=True))
    # proportional: within one sample of the exact share
    assert all(abs(o - count * s / sum(sizes)) < 1 for o, s in zip(out, sizes, strict=True))


def test_split_count_examples() -> None:
    assert split_count([4, 4, 2], 10) == [4, 4, 2]
    assert split_count([4, 4, 2], 5) == [2, 2, 1]
    assert split_count([5, 0, 5], 3) == [2, 0, 1]  # tie goes to the lower rank
    assert split_count([1, 2, 7], 4) == [0, 1, 3]  # 0.4, 0.8, 2.8 -> remainders pick rank 1
    with pytest.raises(ValueError):
        split_count([1, 2], 4)


def test_permutation_differs_by_epoch_and_matches_across_instances() -> None:
    a = GlobalBatchSampler(100, 10, seed=3)
    b = GlobalBatchSampler(100, 10, seed=3)
    assert a.permutation(0).tolist() == b.permutation(0).tolist()
    assert a.permutation(0).tolist() != a.permutation(1).tolist()
    assert GlobalBatchSampler(100, 10, seed=4).permutation(0).tolist() != b.permutation(0).tolist()


def test_plan_not_summing_to_global_batch_is_refused() -> None:
    s = GlobalBatchSampler(100, 10)
    with pytest.raises(ValueError, match="sums to 9"):
        s.local_indices(0, [4, 5], 0)


def test_final_partial_batch_count() -> None:
    s = GlobalBatchSampler(25, 10)
    assert s.batches_per_epoch == 3
    assert [s.global_count(i) for i in range(4)] == [10, 10, 5, 10]
    assert s.local_sizes(2, [7, 3]) == [4, 1]  # 3.5, 1.5 -> tie to rank 0
