"""A stream (an ``IterableDataset``) split among the ranks in proportion to their shares.

A stream has no length and no index, so the ranks cannot each read only their own samples: every
rank reads the same stream, in the same order, and keeps the samples of its slice of each global
batch (global batch ``i`` is the stream's samples ``[i*B, (i+1)*B)``; rank ``r`` takes the
contiguous part the plan in force gives it, :class:`~agent.runtime.sampler.StreamSampler`). So no
sample is used twice and none is skipped, whatever the plans, and a plan change needs nothing
loaded again. The cost is that every rank reads (and decodes) the whole stream: worth it where
reading is cheap against training; a stream that is expensive to read is better cut into a
map-style dataset.

The same order on every rank: the stream is read through a DataLoader like the user's (same
``num_workers``, ``worker_init_fn``, and a generator seeded the same on every rank: the user's,
else the job's seed), in pieces of the user's batch size. With workers, a DataLoader hands out
each worker's pieces in turn, so with the user's batch size the stream is exactly the sequence of
samples their own single-process DataLoader would produce, and with ``batch_size == global_batch``
each global batch is exactly one of their batches.

Workers send their pieces packed (:mod:`agent.runtime.packing`) and the rank collates its slice
with the user's ``collate_fn`` here. Pieces behind the current global batch are dropped, so memory
stays at the DataLoader's prefetch plus one global batch.

The position is the iteration (``i*B`` samples have gone by): a resumed job reads the stream from
its start and drops what it had trained on, which costs reading it again. A stream that ends
before the job's last iteration ends the job with :class:`StreamEnded` on every rank at the same
iteration, never a hang.

Sharded streams
---------------
A stream that declares its shards is read only by the ranks that train on them. The protocol
(:class:`ShardedSource`): ``num_shards`` (how many independent streams it is made of: files,
object-store prefixes) and ``read_shard(shard, start)`` (that shard's samples from its
``start``-th). Shards are dealt to ranks in turn (shard ``s`` to rank ``s % world``, as
``split_by_node`` does in other libraries) and a rank's shards to its DataLoader workers in turn;
each worker reads its shards one after the other. A rank takes its share of each iteration from
its own shards, in the order its DataLoader delivers them, so ranks read in proportion to their
shares, and no sample is used twice or skipped. A checkpoint holds how many samples of each
shard were trained on (the ranks' counts gathered at the checkpoint's iteration, an excluded
rank's as of its exclusion), and a resumed job, on any number of ranks, starts every shard
there: nothing is read again. A rank whose shards are all read ends the job with
:class:`StreamEnded`; with unequal shares the fastest rank reads its shards first, so a corpus
of many more shards than ranks wastes least at its end.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from agent.runtime.datasets import LoaderSettings, Source, empty_like
from agent.runtime.errors import FatalJobError
from agent.runtime.packing import Packed, pack

PIECE = 64
"""Samples per piece when the user gave no batch size (a bare IterableDataset)."""


class StreamEnded(FatalJobError):
    """The stream ran out before the job's last iteration."""


@runtime_checkable
class ShardedSource(Protocol):
    """An ``IterableDataset`` made of shards that each rank may read on its own."""

    num_shards: int

    def read_shard(self, shard: int, start: int) -> Iterable[Any]:
        """Shard ``shard``'s samples from its ``start``-th (0-based) to its end."""
        ...


def sharded(dataset: Any) -> bool:
    """Whether ``dataset`` declares shards (:class:`ShardedSource`)."""
    return isinstance(dataset, ShardedSource) and isinstance(dataset.num_shards, int)


class _RankShards(IterableDataset[tuple[int, int, Any]]):
    """One rank's shards, each from where the job stands in it: every DataLoader worker reads
    its part of them one after the other, and each sample comes tagged (shard, offset)."""

    def __init__(self, source: ShardedSource, shards: list[int], starts: dict[int, int]):
        self.source, self.shards, self.starts = source, shards, starts

    def __iter__(self) -> Iterator[tuple[int, int, Any]]:
        info = get_worker_info()
        k, n = (info.id, info.num_workers) if info is not None else (0, 1)
        for shard in self.shards[k::n]:
            start = self.starts.get(shard, 0)
            for offset, sample in enumerate(self.source.read_shard(shard, start), start):
                yield shard, offset, sample


def _as_list(samples: list[Any]) -> list[Any]:
    return samples


class _Piece:
    """A run of consecutive samples of the stream, unpacked on first use."""

    __slots__ = ("_packed", "_samples", "start")

    def __init__(self, start: int, data: Packed | list[Any]) -> None:
        self.start = start
        self._packed = data if isinstance(data, Packed) else None
        self._samples = None if isinstance(data, Packed) else data

    def __len__(self) -> int:
        return len(self._packed if self._packed is not None else self._samples or ())

    def samples(self) -> list[Any]:
        if self._samples is None:
            assert self._packed is not None
            self._samples, self._packed = self._packed.samples(), None
        return self._samples


class StreamLoader(Source):
    """Every rank reads the stream and keeps its slice of each global batch (module docstring)."""

    def __init__(
        self,
        dataset: IterableDataset[Any],
        settings: LoaderSettings,
        *,
        global_batch: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.size = None
        self.dataset, self.settings = dataset, settings
        self.global_batch = global_batch
        self.piece = settings.batch_size or PIECE
        self.rank, self.world_size = rank, world_size
        self.sharded = sharded(dataset)
        """Read only this rank's shards (module docstring), else the whole stream."""
        self._generator = settings.generator
        if self._generator is None:  # the same on every rank: the stream must be
            self._generator = torch.Generator().manual_seed(seed)
        self._starts: dict[int, int] = {}
        """Shard -> the sample a resumed job starts it at."""
        self._consumed: dict[int, int] = {}
        """Shard -> samples of it this rank trained on (its offsets are in order)."""
        self._begin: dict[int, tuple[int, int]] = {}
        """Sharded: iteration -> (its first position asked for, this rank's own position)."""
        self._end = 0
        """Sharded: the rank's own samples taken so far."""
        self._iter: Iterator[Packed | list[Any]] | None = None
        self._pieces: deque[_Piece] = deque()
        self._read = 0
        """Samples of the stream read so far."""
        self._empty: Any = None
        self.pin = settings.pin_memory and torch.cuda.is_available()

    def take(self, iteration: int, indices: torch.Tensor) -> Any:
        if not len(indices):
            return self.empty()
        first, end = int(indices[0]), int(indices[-1]) + 1
        low = iteration * self.global_batch
        if self.sharded:  # this rank's own samples, in the order they come
            for old in [k for k in self._begin if k < iteration]:
                del self._begin[old]
            base, own = self._begin.setdefault(iteration, (first, self._end))
            first, end = own + first - base, own + end - base
            self._end = max(self._end, end)
            low = own
        if iteration >= 0:
            self._drop_before(low)
        while self._read < end:
            self._pull(iteration, end)
        samples = self._slice(first, end)
        if self.sharded:
            for shard, offset, _ in samples:
                self._consumed[shard] = max(self._consumed.get(shard, 0), offset + 1)
            samples = [sample for _, _, sample in samples]
        return self._collate(samples)

    def load(self, indices: torch.Tensor) -> Any:
        """Samples for a speed probe: the first ones buffered (a probe trains on nothing)."""
        if not self._pieces:
            self._pull(-1, self._read + 1)
        samples = [s for p in self._pieces for s in p.samples()][: len(indices)]
        if self.sharded:
            samples = [sample for _, _, sample in samples]
        return self._collate(samples)

    def empty(self) -> Any:
        if self._empty is None:
            self._empty = empty_like(self.load(torch.zeros(1, dtype=torch.long)))
        return self._empty

    def state(self) -> dict[str, Any]:
        if self.sharded:
            return {"num_shards": self.dataset.num_shards}  # type: ignore[attr-defined]
        return {"stream_piece": self.piece, "num_workers": self.settings.num_workers}

    def rank_state(self) -> dict[int, int] | None:
        """Sharded: how far this rank trained into each of its shards (what checkpoints
        gather from every rank); None for a stream every rank reads whole."""
        return {**self._starts, **self._consumed} if self.sharded else None

    def restore(self, positions: dict[int, int]) -> None:
        """Sharded: start each shard where the checkpoint's ranks had trained to."""
        self._starts = {int(s): int(n) for s, n in positions.items()}

    def close(self) -> None:
        it, self._iter = self._iter, None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def _pull(self, iteration: int, end: int) -> None:
        if self._iter is None:
            self._iter = iter(self._loader())
        try:
            data = next(self._iter)
        except StopIteration:
            if self.sharded:
                raise StreamEnded(
                    f"rank {self.rank}'s shards of the IterableDataset are all read (shards "
                    f"{self._shards()[:8]}...: {self._read} samples), but iteration {iteration} "
                    "needs more: give the job fewer iterations, or the stream more shards"
                ) from None
            raise StreamEnded(
                f"the IterableDataset ended after {self._read} samples, but iteration "
                f"{iteration} needs samples up to {end} (global batch {self.global_batch}): "
                "give the job fewer iterations, or a stream that does not end"
            ) from None
        piece = _Piece(self._read, data)
        self._pieces.append(piece)
        self._read += len(piece)
        if iteration >= 0 and not self.sharded:
            self._drop_before(iteration * self.global_batch)

    def _shards(self) -> list[int]:
        count: int = self.dataset.num_shards  # type: ignore[attr-defined]
        return list(range(self.rank, count, self.world_size))

    def _loader(self) -> DataLoader[Any]:
        dataset: IterableDataset[Any] = self.dataset
        if self.sharded:
            dataset = _RankShards(self.dataset, self._shards(), self._starts)  # type: ignore[arg-type]
        return DataLoader(
            dataset,
            batch_size=self.piece,
            collate_fn=pack if self.settings.num_workers > 0 else _as_list,
            generator=self._generator,
            **self.settings.loader_kwargs(),
        )

    def _drop_before(self, position: int) -> None:
        while self._pieces and self._pieces[0].start + len(self._pieces[0]) <= position:
            self._pieces.popleft()

    def _slice(self, first: int, end: int) -> list[Any]:
        out: list[Any] = []
        for p in self._pieces:
            lo, hi = max(first, p.start), min(end, p.start + len(p))
            if lo < hi:
                out.extend(p.samples()[lo - p.start : hi - p.start])
        return out

    def _collate(self, samples: list[Any]) -> Any:
        from torch.utils.data._utils.pin_memory import pin_memory

        batch = self.settings.collate_fn(samples)
        if self._empty is None:
            self._empty = empty_like(batch)
        return pin_memory(batch) if self.pin else batch
