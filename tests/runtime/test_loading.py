"""The user's data pipeline under plans: DataLoader workers load ahead, a plan change loads only
what changed, and every sample is taken once per epoch; streams split among ranks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, SequentialSampler

from agent.runtime.datasets import LoaderSettings, as_source, empty_like
from agent.runtime.loading import WorkerLoader
from agent.runtime.packing import pack
from agent.runtime.sampler import GlobalBatchSampler, StreamSampler
from agent.runtime.streams import StreamEnded, StreamLoader

N, B, WORLD = 53, 8, 3  # 53 % 8 = 5: a partial last global batch


class Indexed(Dataset[dict[str, Any]]):
    """Each sample says which it is, with a variable-length payload."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"i": i, "x": torch.full((1 + i % 3,), float(i)), "name": f"s{i}"}


def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    """A custom collate (variable lengths: pad), as text pipelines have."""
    longest = max(len(it["x"]) for it in items)
    x = torch.zeros(len(items), longest)
    for j, it in enumerate(items):
        x[j, : len(it["x"])] = it["x"]
    return {"i": torch.tensor([it["i"] for it in items]), "x": x}


def passes_under(sampler: Any, sizes: tuple[int, ...], rank: int, cap: int | None) -> Any:
    def passes(it: int) -> list[torch.Tensor]:
        idx = sampler.local_indices(it, sizes, rank)
        return [idx] if cap is None or len(idx) <= cap else list(idx.split(cap))

    return passes


def split(idx: torch.Tensor, cap: int | None) -> list[torch.Tensor]:
    return [idx] if cap is None or len(idx) <= cap else list(idx.split(cap))


def drive(
    loaders: list[Any] | dict[int, Any],
    sampler: Any,
    plans: list[tuple[tuple[int, ...], int | None]],
    start: int,
    stream: bool = False,
) -> dict[int, list[int]]:
    """Every rank (a list: numbered from 0) takes its passes of each iteration under that
    iteration's plan; the samples they got, by iteration (each batch of a dataset checked
    against the indices asked; a stream's are positions, not sample numbers)."""
    got: dict[int, list[int]] = {}
    by_rank = loaders if isinstance(loaders, dict) else dict(enumerate(loaders))
    for it, (sizes, cap) in enumerate(plans[start:], start):
        for rank, loader in by_rank.items():
            loader.expect(passes_under(sampler, sizes, rank, cap))
            for chunk in split(sampler.local_indices(it, sizes, rank), cap):
                if not len(chunk):
                    continue
                batch = loader.take(it, chunk)
                assert batch["x"][:, 0].tolist() == [float(i) for i in batch["i"].tolist()]
                if not stream:  # the samples asked, in order
                    assert batch["i"].tolist() == chunk.tolist()
                got.setdefault(it, []).extend(batch["i"].tolist())
    return got


def sizes(world: int) -> st.SearchStrategy[tuple[int, ...]]:
    """Plans of ``world`` ranks summing to B (zero shares included)."""
    head = st.lists(st.integers(0, B), min_size=world - 1, max_size=world - 1)
    return head.filter(lambda h: sum(h) <= B).map(lambda h: (*h, B - sum(h)))


Plans = list[tuple[tuple[int, ...], int | None]]


@st.composite
def plans_of(draw: Any, world: int, count: int) -> Plans:
    """``count`` iterations of plans of ``world`` ranks, each kept a few iterations, with
    memory caps now and then."""
    plans: Plans = []
    while len(plans) < count:
        cap = draw(st.sampled_from([None, None, 2, 3]))
        plans += [(draw(sizes(world)), cap)] * draw(st.integers(1, 4))
    return plans[:count]


@st.composite
def plan_runs(draw: Any) -> tuple[Plans, int, int, int]:
    """Two epochs of plans: 3 ranks until a resume, then another number of ranks, reading
    with another number of DataLoader workers."""
    total = 2 * -(-N // B)
    resume_at = draw(st.integers(1, total - 1))
    world_after = draw(st.integers(1, 4))
    before = draw(plans_of(WORLD, resume_at))
    after = draw(plans_of(world_after, total - resume_at))
    return before + after, resume_at, world_after, draw(st.sampled_from([0, 1, 2]))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(run=plan_runs())
def test_every_sample_once_per_epoch_through_plan_changes_exclusions_and_a_resume(
    run: tuple[Plans, int, int, int],
) -> None:
    plans, resume_at, world_after, workers_after = run
    sampler = GlobalBatchSampler(N, B, seed=3)
    loader = DataLoader(Indexed(), collate_fn=collate, num_workers=2, prefetch_factor=2)

    def loaders(data: DataLoader[Any], world: int) -> list[Any]:
        return [
            as_source(data, rank=r, seed=3, global_batch=B, world_size=world)[0]
            for r in range(world)
        ]

    first = loaders(loader, WORLD)
    got = drive(first, sampler, plans[:resume_at], 0)
    for source in first:
        source.close()
    # a resume from the checkpoint's iteration: fresh processes, another number of ranks,
    # another number of DataLoader workers
    again = DataLoader(Indexed(), collate_fn=collate, num_workers=workers_after)
    second = loaders(again, world_after)
    got |= drive(second, sampler, plans, resume_at)
    for source in second:
        source.close()
    per_epoch = sampler.batches_per_epoch
    for epoch in range(2):
        seen = [i for it in range(epoch * per_epoch, (epoch + 1) * per_epoch) for i in got[it]]
        assert sorted(seen) == list(range(N))


def test_a_plan_change_loads_only_the_samples_that_moved() -> None:
    sampler = GlobalBatchSampler(400, B, seed=1)
    data = DataLoader(Indexed400(), collate_fn=collate, num_workers=2, prefetch_factor=2)
    source, _ = as_source(data, rank=1, seed=0, global_batch=B, world_size=2)
    assert isinstance(source, WorkerLoader)
    before, after = (4, 4), (3, 5)  # rank 1's slice grows by one sample at the front
    plans = [(before, None)] * 10 + [(after, None)] * 10
    got = drive({1: source}, sampler, plans, 0)
    source.close()
    assert len(got) == 20
    # The iterations loaded ahead under the old plan (prefetch_factor * workers = 4 of them)
    # were assembled from what they held plus the one sample each that moved: 4 samples read
    # again, not 4 whole shares of 5.
    assert source.reloaded == 4


class Indexed400(Indexed):
    def __len__(self) -> int:
        return 400


def test_a_loader_whose_batches_cannot_be_replaced_is_refused() -> None:
    ds = Indexed()
    custom = DataLoader(ds, batch_sampler=BatchSampler(SequentialSampler(ds), 4, False))
    with pytest.raises(ValueError, match="a custom batch_sampler: Evenflow's plan decides"):
        LoaderSettings.of(custom)
    with pytest.raises(ValueError, match=r"batch_size=None \(each item a batch\)"):
        LoaderSettings.of(DataLoader(ds, batch_size=None))
    with pytest.raises(TypeError, match="takes a DataLoader, a Dataset"):
        as_source([1, 2, 3], rank=0, seed=0, global_batch=B, world_size=1)


def test_an_empty_batch_keeps_the_structure_with_no_samples() -> None:
    batch = collate([Indexed()[i] for i in (4, 5)])
    empty = empty_like({**batch, "names": ["a", "b"], "pair": (batch["x"], 3)})
    assert empty["i"].shape == (0,) and empty["x"].shape == (0, 3)
    assert empty["names"] == [] and empty["pair"][0].shape == (0, 3) and empty["pair"][1] == 3
    source, _ = as_source(
        DataLoader(Indexed(), collate_fn=collate, num_workers=1),
        rank=0,
        seed=0,
        global_batch=B,
        world_size=2,
    )
    assert source.empty()["x"].shape[0] == 0
    source.close()


def test_samples_pack_into_one_buffer_and_come_back_equal() -> None:
    samples = [Indexed()[i] for i in range(5)]
    packed = pack(samples)
    assert packed.buffer.dtype == torch.uint8
    back = packed.samples()
    for a, b in zip(samples, back, strict=True):
        assert a["i"] == b["i"] and a["name"] == b["name"] and torch.equal(a["x"], b["x"])
        assert b["x"].untyped_storage().data_ptr() == packed.buffer.untyped_storage().data_ptr()


class Stream(IterableDataset[dict[str, Any]]):
    """A stream of numbered samples; each DataLoader worker yields its own part."""

    def __init__(self, length: int | None = None) -> None:
        self.length = length

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        k, n = (info.id, info.num_workers) if info else (0, 1)
        i = k
        while self.length is None or i < self.length:
            yield {"i": i, "x": torch.full((1 + i % 2,), float(i))}
            i += n


def _own_batches(stream: Stream, workers: int, batch: int, count: int) -> list[list[int]]:
    """What the user's own single-process DataLoader yields."""
    loader = DataLoader(stream, batch_size=batch, collate_fn=collate, num_workers=workers)
    out = []
    for b in loader:
        out.append(b["i"].tolist())
        if len(out) == count:
            break
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_is_split_among_ranks_in_proportion_and_resumes_in_place(workers: int) -> None:
    sampler = StreamSampler(B)
    loader = DataLoader(Stream(), batch_size=B, collate_fn=collate, num_workers=workers)
    ranks = [StreamLoader(Stream(), LoaderSettings.of(loader), global_batch=B, seed=1)]
    ranks += [StreamLoader(Stream(), LoaderSettings.of(loader), global_batch=B, seed=1)]
    plans = [((5, 3), None)] * 4 + [((8, 0), None)] * 2 + [((1, 7), 3)] * 3
    got = drive(ranks, sampler, plans, 0, stream=True)
    # with batch_size == global_batch, global batch i is exactly the user's own batch i
    assert [sorted(got[it]) for it in range(len(plans))] == [
        sorted(b) for b in _own_batches(Stream(), workers, B, len(plans))
    ]
    assert [got[it] for it in range(len(plans))] == _own_batches(Stream(), workers, B, len(plans))
    for r in ranks:
        r.close()
    resumed = StreamLoader(Stream(), LoaderSettings.of(loader), global_batch=B, seed=1)
    again = drive({0: resumed}, sampler, plans, 6, stream=True)  # rank 0 alone, from iteration 6
    assert [again[it] for it in (6, 7, 8)] == [got[it][:1] for it in (6, 7, 8)]
    resumed.close()


def test_a_stream_that_ends_before_the_job_says_so() -> None:
    loader = DataLoader(Stream(length=20), batch_size=4, collate_fn=collate)
    source = StreamLoader(Stream(length=20), LoaderSettings.of(loader), global_batch=B, seed=0)
    sampler = StreamSampler(B)
    source.take(0, sampler.local_indices(0, (B,), 0))
    source.take(1, sampler.local_indices(1, (B,), 0))
    with pytest.raises(StreamEnded, match="ended after 20 samples, but iteration 2 needs"):
        source.take(2, sampler.local_indices(2, (B,), 0))


class Shards(IterableDataset[dict[str, Any]]):
    """A corpus of shards (as files would be): sample ``k`` of shard ``s`` is ``1000*s + k``."""

    num_shards = 8

    def __init__(self, length: int = 40) -> None:
        self.length = length
        self.opened: list[tuple[int, int, int]] = []
        """(pid, shard, start) of every read_shard, in the process that read it."""

    def read_shard(self, shard: int, start: int) -> Iterator[dict[str, Any]]:
        import os

        self.opened.append((os.getpid(), shard, start))
        for k in range(start, self.length):
            i = 1000 * shard + k
            yield {"i": i, "x": torch.full((1 + k % 2,), float(i))}

    def __iter__(self) -> Iterator[dict[str, Any]]:  # a plain loop's order: shard by shard
        for shard in range(self.num_shards):
            yield from self.read_shard(shard, 0)


def _sharded_ranks(world: int, workers: int, starts: dict[int, int]) -> list[StreamLoader]:
    loader = DataLoader(Shards(), batch_size=4, collate_fn=collate, num_workers=workers)
    out = []
    for rank in range(world):
        source = StreamLoader(
            Shards(), LoaderSettings.of(loader), global_batch=B, seed=0, rank=rank, world_size=world
        )
        source.restore(starts)
        out.append(source)
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sharded_stream_is_read_only_by_the_ranks_that_train_on_it(workers: int) -> None:
    sampler = StreamSampler(B)
    first = _sharded_ranks(2, workers, {})
    plans = [((5, 3), None)] * 3 + [((8, 0), None)] * 2 + [((2, 6), 3)] * 3
    got = drive(first, sampler, plans, 0, stream=True)
    taken = {
        r: [i for it in range(len(plans)) for i in got.get(it, []) if i in mine]
        for r, mine in ((r, _owned(r, 2)) for r in range(2))
    }
    assert sorted(i for it in got for i in got[it]) == sorted(taken[0] + taken[1])  # nothing else
    for r in range(2):  # each rank read its own shards, in order, nothing skipped
        assert _prefixes(taken[r])
    positions: dict[int, int] = {}
    for source in first:
        for shard, n in (source.rank_state() or {}).items():
            positions[shard] = max(positions.get(shard, 0), n)
        source.close()
    # resumed on three ranks from those positions: every shard goes on where it stood
    second = _sharded_ranks(3, workers, positions)
    more = drive(second, sampler, [((3, 3, 2), None)] * 6, 0, stream=True)
    for source in second:
        source.close()
    everything = [i for part in (got, more) for it in part for i in part[it]]
    assert len(everything) == len(set(everything)) == B * 14  # none twice
    assert _prefixes(everything)  # none skipped


def _owned(rank: int, world: int) -> set[int]:
    return {1000 * s + k for s in range(rank, 8, world) for k in range(40)}


def _prefixes(ids: list[int]) -> bool:
    """Whether the samples of each shard are its first ones, each once."""
    by_shard: dict[int, list[int]] = {}
    for i in ids:
        by_shard.setdefault(i // 1000, []).append(i % 1000)
    return all(sorted(v) == list(range(len(v))) for v in by_shard.values())
